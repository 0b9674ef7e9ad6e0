"""linear on weight format int8_a8 (quantization="w8a8"): int8 weights against inputs rounded to
int8 with one scale per row. The integer sums are exact, so every CPU kernel level, row count and
tile layout must give the bits of an exact reference; non-finite and zero rows; the input limit.
(quantization="w8a8" itself and its refusal on CUDA: test_linear_int8_inputs.py.)"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo import _C
from octavo.layers.linear import QuantizedWeight


def reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's result, emulated exactly: a = rint(x * (127 / m)) in float64 (ties to even), m
    the row's largest |x|, d = m / 127 rounded to float32; the integer sums (exact in float64 at these
    sizes) rounded to float32 and scaled by s * d in float32, plus the bias in float32."""
    x32 = x.float()
    m = x32.abs().amax(-1, keepdim=True)
    inv = torch.where(m > 0, torch.full_like(m, 127, dtype=torch.float64) / m.double(), 0.0)
    a = torch.round(x32.double() * inv).clamp(-127, 127)
    d = (m.double() / 127).float()
    sums = a @ w.qweight.double().t()
    y = sums.float() * (w.scales[None, :] * d)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def run(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _C.ops.linear(out, x, w.qweight, bias, "int8_a8", w.scales, None, 0)
    return out


def random_weight(n: int, k: int, generator=None) -> QuantizedWeight:
    """int8 weights over the whole type, -128 included (checkpoints may hold it)."""
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    scales = torch.rand(n, generator=generator) * 1e-2 + 1e-4
    return QuantizedWeight(q, "int8_a8", k, scales=scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# The AMX level multiplies on int8 tiles from 4 rows when K is a multiple of 64 (from 2 on weights of
# 16 MB or more: test_two_rows_of_a_large_weight_take_the_tiles): up to 64 rows with
# the weights as the first operand (whole tiles of 16 weight rows read from the weight itself, a
# last partial one copied), then on panels, or for rows longer than 8192 inputs in passes of 64
# rows. Below, and at the other levels, the vector kernel (4, 2 and 1 rows per pass).
@pytest.mark.parametrize("n,k,rows", [(8, 64, 1), (13, 96, 3), (37, 128, 4), (48, 256, 16), (5, 160, 17),
                                      (70, 384, 40), (33, 512, 64), (40, 256, 65), (64, 192, 100),
                                      (21, 8448, 130), (33, 320, 300)])
def test_int8_a8_gives_the_exact_reference_bits(isa, dtype, n, k, rows):
    torch.manual_seed(n + rows)
    w = random_weight(n, k)
    x = (torch.randn(rows, k) * 3).to(dtype)
    bias = torch.randn(n).to(dtype)
    assert torch.equal(run(x, w), reference(x, w))
    assert torch.equal(run(x, w, bias), reference(x, w, bias))


@pytest.mark.parametrize("rows", [2, 3])
def test_two_rows_of_a_large_weight_take_the_tiles(isa, rows):
    """From 16 MB of weight (4112 x 4096: a last partial tile of 16 rows), W8A8 takes the AMX
    level's tiles from 2 rows: the same exact bits as every level's vector kernel."""
    torch.manual_seed(rows)
    w = random_weight(4112, 4096)
    x = (torch.randn(rows, 4096) * 3).to(torch.bfloat16)
    assert torch.equal(run(x, w), reference(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Prefill orders of the AMX level: the weights first in passes of 64 rows where the int8 inputs fit
# in L2 (300 rows of 1024); else panels, with rows in chunks that stay in L2 (several chunks at 4200
# rows of 2048), groups of panels against all the rows (1500 rows of 1024), the same in slices of
# 4096 inputs for longer rows (130 and 120 rows of 8448: two slices and 256 inputs, 10 panels in two
# groups, last blocks of 2 and 24 rows; 300 rows of 4160: a last slice of one step; 1000 rows of
# 8448, past the 8 MB of inputs other groups stop at), and past 4096 such rows, passes of 64 with
# the weights first again (4200 of 8448).
@pytest.mark.parametrize("n,k,rows", [(70, 1024, 300), (40, 2048, 4200), (21, 8448, 130), (300, 8448, 130),
                                      (300, 8448, 120), (300, 4160, 300), (70, 1024, 1500), (21, 8448, 1000),
                                      (21, 8448, 4200)])
def test_int8_a8_prefill_gives_the_exact_reference_bits(dtype, n, k, rows):
    torch.manual_seed(n + rows)
    w = random_weight(n, k)
    x = torch.randn(rows, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    assert torch.equal(run(x, w, bias), reference(x, w, bias))


def test_every_level_and_batch_gives_the_same_bits():
    torch.manual_seed(1)
    w = random_weight(40, 256)
    x = torch.randn(150, 256).bfloat16()
    previous = _C.cpu_isa()
    try:
        results = []
        for level in _C.supported_cpu_isas():
            _C.set_cpu_isa(level)
            results.append(run(x, w))
            for begin, end in ((0, 1), (1, 4), (4, 20), (20, 85), (85, 150)):
                assert torch.equal(run(x[begin:end], w), results[-1][begin:end]), (level, begin, end)
    finally:
        _C.set_cpu_isa(previous)
    assert all(torch.equal(r, results[0]) for r in results)


def test_non_finite_inputs_make_their_row_nan_and_zero_rows_give_the_bias(isa):
    torch.manual_seed(2)
    w = random_weight(20, 128)
    x = torch.randn(4, 128)
    x[1, 70] = math.inf
    x[2, 3] = math.nan
    x[3] = 0.0
    bias = torch.randn(20)
    for extra in (0, 12, 70):  # 4, 16 and 74 rows: the vector kernel, then tiles at the AMX level
        rows = torch.cat([x, torch.randn(extra, 128)])
        out = run(rows, w, bias)
        assert out[1].isnan().all() and out[2].isnan().all()
        assert torch.equal(out[3], bias)
        finite = [0, *range(4, 4 + extra)]
        assert torch.equal(out[finite], reference(rows[finite], w, bias))


def test_the_largest_sums_at_the_input_limit():
    """131072 inputs of -128 x 127: the largest int32 sum the kernel promises, exact; one block
    more is refused."""
    k = 1 << 17
    w = QuantizedWeight(torch.full((2, k), -128, dtype=torch.int8), "int8_a8", k, scales=torch.ones(2))
    x = torch.ones(5, k)
    assert torch.equal(run(x, w), torch.full((5, 2), -128.0 * 127 * k / 127))
    with pytest.raises(ValueError, match="at most 131072 inputs"):
        _C.ops.linear(torch.empty(1, 2), torch.ones(1, k + 32), torch.zeros(2, k + 32, dtype=torch.int8), None,
                      "int8_a8", torch.ones(2), None, 0)


@settings(max_examples=40, deadline=None)
@given(exponent=st.integers(-40, 37), rows=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_rows_of_any_float32_magnitude(exponent, rows, seed):
    g = torch.Generator().manual_seed(seed)
    w = random_weight(17, 192, g)
    x = torch.randn(rows, 192, generator=g) * 10.0**exponent
    out = run(x, w)
    assert out.isfinite().all()
    assert torch.equal(out, reference(x, w))
