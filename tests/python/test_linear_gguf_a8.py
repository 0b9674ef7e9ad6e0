"""``linear`` on GGUF blocks with int8 inputs (``int8_inputs=True``, llama.cpp's way on the CPU):
each input row rounded per block of 32 (a = rint(x * 127 / m), d = m / 127, m the block's largest
|x|), then multiplied exactly by the blocks' integers. The result is float64's product of the
dequantized weights and the rounded inputs, up to float32 rounding of the per-block terms, on every
compiled ISA and every block layout (random bytes: every value of every field)."""

import pytest
import torch

from octavo import _C
from test_linear_gguf import QTYPES, dequantized, inputs, quantized

# From PANEL_ROWS rows the kernel takes decoded panels of 32 weight rows (on AVX512-VNNI levels):
# shapes on both sides, with partial panels and input rows past a multiple of 4.
PANEL_ROWS = 16
SPLIT_ROWS = 128  # input rows per thread from which the threads split the rows, not the panels
SHAPES = [(1, 1, 32), (1, 7, 64), (2, 33, 96), (3, 64, 576), (4, 9, 1536), (5, 130, 32), (9, 12, 512), (17, 20, 256),
          (16, 32, 64), (23, 70, 1536), (64, 33, 576)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(5)


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x's rows rounded per block of 32 as the kernel rounds them, as float64 d * a."""
    blocks = x.float().double().reshape(x.shape[0], -1, 32)
    m = blocks.abs().amax(dim=2, keepdim=True).float()
    d = (m.double() / 127).float().double()
    inv = torch.where(m > 0, 127.0 / m.double(), torch.zeros_like(d))
    a = torch.round(blocks * inv).clamp(-127, 127)  # torch.round: half to even, as nearbyint
    return (a * d).reshape(x.shape)


def product(x: torch.Tensor, q: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype)
    _C.ops.linear(out, x, q, bias, fmt, int8_inputs=True)
    return out


def assert_matches_rounded_inputs(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b, tolerance: float) -> None:
    """out against float64 on the rounded inputs, relative to the sums of |x| |w| per output."""
    xr = rounded(x)
    ref = xr @ w.double().T + (0 if b is None else b.double())
    bound = xr.abs() @ w.double().abs().T + (0 if b is None else b.double().abs()) + 1e-30
    err = ((out.double() - ref).abs() / bound).max().item()
    assert err < tolerance, f"relative error {err:.3g} >= {tolerance:g}"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("fmt", QTYPES)
def test_int8_inputs_multiply_the_rounded_inputs(isa, fmt, m, n, k, bias):
    k = inputs(k, fmt)
    q = quantized(n, k, fmt, seed=m * 1000 + n)
    x = torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]
    b = torch.randn(n) if bias else None
    assert_matches_rounded_inputs(product(x, q, fmt, b), x, dequantized(q, fmt), b, 2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q6_k", "q4_k"])
def test_16_bit_inputs_are_rounded_from_their_own_values(isa, fmt, dtype):
    k = inputs(256, fmt)
    q = quantized(24, k, fmt)
    x = torch.randn(PANEL_ROWS + 6, k).to(dtype)
    out = product(x, q, fmt)
    assert out.dtype == dtype
    assert_matches_rounded_inputs(out, x, dequantized(q, fmt), None, 1e-2)


@pytest.mark.parametrize("fmt", QTYPES)
def test_a_row_does_not_depend_on_the_rows_beside_it(fmt):
    k = inputs(512, fmt)
    q = quantized(40, k, fmt)
    x = torch.randn(11, k)
    together = product(x, q, fmt)
    for i in range(11):
        assert torch.equal(product(x[i:i + 1], q, fmt), together[i:i + 1]), f"row {i}"


@pytest.mark.parametrize("fmt", QTYPES)
def test_a_row_of_a_batch_does_not_depend_on_the_rows_beside_it(fmt):
    """Batches of PANEL_ROWS rows or more: a row gets the same bits at any place in any of them."""
    k = inputs(512, fmt)
    q = quantized(40, k, fmt)
    x = torch.randn(2 * PANEL_ROWS + 3, k)
    together = product(x, q, fmt)
    for i in (0, 5, PANEL_ROWS, 2 * PANEL_ROWS + 2):
        others = torch.cat([x[i:i + 1], torch.randn(PANEL_ROWS, k)])
        assert torch.equal(product(others, q, fmt)[0], together[i]), f"row {i}"


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_0"])
def test_many_rows_split_over_the_threads_give_each_row_its_bits(fmt, threads):
    """From SPLIT_ROWS rows per thread the threads share the rows (each rounding its own) instead of
    the panels: the same product, and each row the bits it gets in a small batch."""
    k = inputs(1536, fmt)
    q = quantized(70, k, fmt)
    x = torch.randn(SPLIT_ROWS * threads + 6, k)
    previous = _C.get_num_threads()
    _C.set_num_threads(threads)
    try:
        out = product(x, q, fmt)
    finally:
        _C.set_num_threads(previous)
    assert_matches_rounded_inputs(out, x, dequantized(q, fmt), None, 2e-6)
    for i in (0, SPLIT_ROWS + 1, x.shape[0] - 1):
        small = torch.cat([x[i:i + 1], x[:PANEL_ROWS]])
        assert torch.equal(product(small, q, fmt)[0], out[i]), f"row {i}"


def test_a_large_output_is_written_around_the_caches():
    """From 16 MB of output the panels' stores bypass the caches: the values of a small product."""
    k = 64
    q = quantized(65536, k, "q8_0")
    x = torch.randn(4 * PANEL_ROWS + 1, k)
    out = product(x, q, "q8_0")
    assert out.numel() * 4 >= 16 << 20
    assert torch.equal(out[:, :96], product(x, q[:96], "q8_0"))
    assert torch.equal(out[:, -40:], product(x, q[-40:], "q8_0"))


@pytest.mark.parametrize("rows", [3, PANEL_ROWS + 1])
@pytest.mark.parametrize("fmt", ["q4_0", "q5_1", "q3_k", "q6_k", "q8_0"])
def test_a_non_finite_input_makes_only_its_row_nan(isa, fmt, rows):
    k = inputs(256, fmt)
    q = quantized(8, k, fmt)
    x = torch.randn(rows, k)
    x[1, 40] = float("inf")
    x[rows - 1, 3] = float("nan")
    out = product(x, q, fmt)
    assert out[1].isnan().all() and out[rows - 1].isnan().all()
    assert out[[i for i in range(rows) if i not in (1, rows - 1)]].isfinite().all()


@pytest.mark.parametrize("rows", [3, PANEL_ROWS])
def test_zero_inputs_give_zero_and_extreme_ones_stay_finite(isa, rows):
    q = quantized(16, 256, "q4_k")
    x = torch.zeros(rows, 256)
    x[1] = torch.finfo(torch.float32).max * torch.sign(torch.randn(256))
    x[2, :32] = torch.finfo(torch.float32).tiny / 4  # one block of subnormals
    out = product(x, q, "q4_k")
    assert torch.equal(out[0], torch.zeros(16))
    assert out[2].isfinite().all()
    assert_matches_rounded_inputs(out[2:], x[2:], dequantized(q, "q4_k"), None, 2e-6)


@pytest.mark.parametrize("rows", [4, PANEL_ROWS + 4])
def test_a_strided_input_is_read_by_its_rows(rows):
    q = quantized(12, 64, "q8_0")
    wide = torch.randn(rows, 96)
    x = wide[:, 16:80]
    assert torch.equal(product(x, q, "q8_0"), product(x.contiguous(), q, "q8_0"))


def test_int8_inputs_need_a_gguf_format():
    out, x = torch.empty(1, 4), torch.randn(1, 32)
    with pytest.raises(ValueError, match="int8_inputs needs a GGUF block format, got dense"):
        _C.ops.linear(out, x, torch.randn(4, 32), None, "dense", int8_inputs=True)
    q = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="int8_inputs needs a GGUF block format, got int4"):
        _C.ops.linear(out, x, q, None, "int4", torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.uint8), 32,
                      int8_inputs=True)

