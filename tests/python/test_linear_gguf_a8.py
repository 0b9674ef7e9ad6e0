"""``linear`` on GGUF blocks with int8 inputs (``int8_inputs=True``, llama.cpp's way on the CPU):
each input row rounded per block of 32 (a = rint(x * 127 / m), d = m / 127, m the block's largest
|x|), then multiplied exactly by the blocks' integers. The result is float64's product of the
dequantized weights and the rounded inputs, up to float32 rounding of the per-block terms, on every
compiled ISA and every block layout (random bytes: every value of every field)."""

import pytest
import torch

from octavo import _C
from test_linear_gguf import QTYPES, dequantized, inputs, quantized

SHAPES = [(1, 1, 32), (1, 7, 64), (2, 33, 96), (3, 64, 576), (4, 9, 1536), (5, 130, 32), (9, 12, 512), (17, 20, 256)]


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
    x = torch.randn(6, k).to(dtype)
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


@pytest.mark.parametrize("fmt", ["q4_0", "q5_1", "q3_k", "q6_k"])
def test_a_non_finite_input_makes_only_its_row_nan(isa, fmt):
    k = inputs(256, fmt)
    q = quantized(8, k, fmt)
    x = torch.randn(3, k)
    x[1, 40] = float("inf")
    out = product(x, q, fmt)
    assert out[1].isnan().all()
    assert out[[0, 2]].isfinite().all()


def test_zero_inputs_give_zero_and_extreme_ones_stay_finite(isa):
    q = quantized(16, 256, "q4_k")
    x = torch.zeros(3, 256)
    x[1] = torch.finfo(torch.float32).max * torch.sign(torch.randn(256))
    x[2, :32] = torch.finfo(torch.float32).tiny / 4  # one block of subnormals
    out = product(x, q, "q4_k")
    assert torch.equal(out[0], torch.zeros(16))
    assert out[2].isfinite().all()
    assert_matches_rounded_inputs(out[2:], x[2:], dequantized(q, "q4_k"), None, 2e-6)


def test_a_strided_input_is_read_by_its_rows():
    q = quantized(12, 64, "q8_0")
    wide = torch.randn(4, 96)
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

