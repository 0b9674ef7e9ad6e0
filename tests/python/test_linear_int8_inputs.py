"""linear on weight format int4_a8 (quantization="w4a8"): int4 weights against inputs rounded to
int8 with one scale per weight group, at every CPU kernel level, against a float64 product of
the same rounded inputs; non-finite and zero groups; the refusal on CUDA."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo import _C
from octavo.layers.linear import CPU_BF16_GEMM_FROM_ROWS, QuantizedWeight, linear
from octavo.layers.quantize import quantize, quantize_int4


def nibbles(w: QuantizedWeight) -> torch.Tensor:
    """The [N, K] values 0..15 of an int4 weight (each 32 in 16 bytes, low nibbles first)."""
    blocks = w.qweight.view(w.qweight.shape[0], -1, 16)
    return torch.cat([blocks & 15, blocks >> 4], -1).reshape(blocks.shape[0], -1).long()


def rounded_inputs(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's int8 inputs a [M, groups, group] and scales d [M, groups, 1] (float32 values):
    a = rint(x * (127 / m)) in float64, m a group's largest |x|, d = m / 127 rounded to float32."""
    x32 = x.float().view(x.shape[0], -1, group)
    m = x32.abs().amax(-1, keepdim=True)
    inv = torch.where(m > 0, torch.full_like(m, 127, dtype=torch.float64) / m.double(), 0.0)  # IEEE division
    a = torch.round(x32.double() * inv).clamp(-127, 127)
    return a, (m.double() / 127).float().double()


def reference(x: torch.Tensor, w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product of the rounded inputs and the weights, and the sum of its terms' sizes,
    a term per block of 32 inputs: the vector kernel sums a group's blocks in separate lanes, each
    rounded to float32, before it adds them."""
    g = w.group_size
    a, d = rounded_inputs(x, g)
    m, n, blocks = x.shape[0], w.shape[0], g // 32
    q = nibbles(w).view(n, -1, blocks, 32).double()
    a = a.view(m, -1, blocks, 32)
    dots = torch.einsum("mgbk,ngbk->mngb", a, q) - w.zeros.double()[None, :, :, None] * a.sum(-1)[:, None]
    terms = dots * (w.scales.double()[None] * d.view(m, 1, -1))[..., None]
    return terms.sum((-1, -2)), terms.abs().sum((-1, -2))


def run(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _C.ops.linear(out, x, w.qweight, bias, "int4_a8", w.scales, w.zeros, w.group_size)
    return out


def assert_near_reference(out: torch.Tensor, x: torch.Tensor, w: QuantizedWeight, bias=None) -> None:
    want, size = reference(x, w)
    if bias is not None:
        want, size = want + bias.double(), size + bias.double().abs()
    # float32 sums of the per-group terms; 16-bit outputs are then rounded once more.
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out.dtype]
    err = (out.double() - want).abs()
    assert (err <= 1e-5 * size + rounding * want.abs() + 1e-30).all(), err.max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# From 4 rows with groups of 64s, the AMX level multiplies on int8 tiles (linear_int8_tiles.h): up
# to 64 rows with the weights as the first operand (1-4 input tiles), then on panels (partial
# blocks of rows and panels of features, groups of one and of four tiles; 130 rows of 8448, more
# than a chunk of such rows, as groups of panels against all the rows).
@pytest.mark.parametrize("n,k,group,rows", [(8, 64, 32, 1), (13, 384, 96, 3), (37, 2048, 128, 5), (5, 160, 32, 17),
                                            (20, 256, 64, 4), (70, 384, 64, 8), (16, 128, 128, 16),
                                            (37, 2048, 128, 40), (20, 256, 64, 61), (33, 512, 256, 70),
                                            (40, 256, 64, 100), (21, 8448, 128, 130)])
def test_int4_a8_is_the_product_of_the_rounded_inputs(isa, dtype, n, k, group, rows):
    torch.manual_seed(n + rows)
    w = quantize_int4(torch.randn(n, k), group, weight_format="int4_a8")
    assert w.group_size == group
    x = torch.randn(rows, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    assert_near_reference(run(x, w), x, w)
    assert_near_reference(run(x, w, bias), x, w, bias)


def test_rows_do_not_depend_on_the_batch(isa):
    torch.manual_seed(1)
    w = quantize(torch.randn(40, 256), "w4a8")
    on_tiles = _C.cpu_isa() == "amx"
    x = torch.randn(3 if on_tiles else 7, 256)  # passes of 4, 2 and 1 rows on AVX-512
    batched = run(x, w)
    for i in range(x.shape[0]):
        assert torch.equal(run(x[i:i + 1], w), batched[i:i + 1])
    # From 4 rows on (int8 tiles at the AMX level): any batch of at least 4 rows, on either side
    # of 64 (the weights as the tiles' first operand with 1-4 input tiles, then panels).
    x = torch.randn(150, 256)
    batched = run(x, w)
    for begin, end in ((0, 4), (4, 20), (20, 52), (52, 101), (101, 150), (85, 150), (67, 75)):
        assert torch.equal(run(x[begin:end], w), batched[begin:end])
    # Rows longer than 8192 inputs: passes of 64 rows with the weights first (72 rows, and 1000 rows
    # whose int8 inputs pass 8 MB), or groups of panels (130 and 860 rows), at any alignment.
    w = quantize(torch.randn(24, 8448), "w4a8")
    x = torch.randn(1000, 8448)
    batched = run(x, w)
    for begin, end in ((0, 4), (4, 68), (68, 140), (10, 140), (140, 1000)):
        assert torch.equal(run(x[begin:end], w), batched[begin:end])


def test_non_finite_inputs_make_their_row_nan_and_zero_rows_give_the_bias(isa):
    torch.manual_seed(2)
    w = quantize(torch.randn(6, 128), "w4a8")
    x = torch.randn(4, 128)
    x[1, 70] = math.inf
    x[2, 3] = math.nan
    x[3] = 0.0
    bias = torch.randn(6)
    out = run(x, w, bias)
    assert out[1].isnan().all() and out[2].isnan().all()
    assert torch.equal(out[3], bias)
    assert_near_reference(out[:1], x[:1], w, bias)
    for extra in (12, 30, 70):  # 16, 34 and 74 rows: 1 and 3 input tiles, then panels at the AMX level
        tiled = run(torch.cat([x, torch.randn(extra, 128)]), w, bias)
        assert tiled[1].isnan().all() and tiled[2].isnan().all() and torch.equal(tiled[3], bias)
        assert tiled[[0, *range(4, 4 + extra)]].isfinite().all()


@settings(max_examples=40, deadline=None)
@given(exponents=st.lists(st.integers(-40, 37), min_size=4, max_size=4), seed=st.integers(0, 2**31 - 1))
def test_groups_of_any_float32_magnitude(exponents, seed):
    """Each group of inputs at its own power of ten, from near float32's smallest normal to near
    its largest (the weights' sums stay finite)."""
    g = torch.Generator().manual_seed(seed)
    w = quantize_int4(torch.randn(3, 128, generator=g) * 1e-3, 32, weight_format="int4_a8")
    x = torch.randn(2, 128, generator=g).view(2, 4, 32)
    x = (x * torch.tensor([10.0**e for e in exponents]).view(1, 4, 1)).view(2, 128)
    out = run(x, w)
    assert out.isfinite().all()
    assert_near_reference(out, x, w)


@pytest.mark.parametrize("method,weights", [("w4a8", "int4"), ("w8a8", "int8")])
def test_int8_activations_keep_the_weights_of_their_format(method, weights):
    torch.manual_seed(3)
    w = torch.randn(16, 192)
    plain, a8 = quantize(w, weights), quantize(w, method)
    assert a8.weight_format == f"{weights}_a8" and plain.weight_format == weights
    assert torch.equal(a8.qweight, plain.qweight) and torch.equal(a8.dequantize(), plain.dequantize())
    x = torch.randn(2, 192)
    assert not torch.equal(linear(x, a8), linear(x, plain))  # the inputs were rounded
    # Rounding the inputs moves each output by about sqrt(K) * |w| * m / 254: a few % of the largest.
    scale = linear(x, plain).abs().max().item()
    torch.testing.assert_close(linear(x, a8), linear(x, plain), rtol=0, atol=0.03 * scale)
    # 16-bit inputs go to the kernel as they are: the bits of the float32 call, rounded once.
    x16 = x.bfloat16()
    assert torch.equal(linear(x16, a8), linear(x16.float(), a8).bfloat16())


@pytest.mark.parametrize("method", ["w4a8", "w8a8"])
def test_bfloat16_prefill_keeps_the_int8_inputs_where_the_cpu_has_amx(isa, method):
    """From CPU_BF16_GEMM_FROM_ROWS rows, bfloat16 products of quantized weights go to torch's GEMM
    on dequantized weights; int4_a8 and int8_a8 stay on their own kernel where the level has AMX
    int8 tiles."""
    torch.manual_seed(4)
    w = quantize_int4(torch.randn(48, 256), 64, weight_format="int4_a8") if method == "w4a8" else \
        quantize(torch.randn(48, 256), method)
    x = torch.randn(CPU_BF16_GEMM_FROM_ROWS + 3, 256).bfloat16()
    out = linear(x, w)
    if _C.cpu_isa() == "amx":
        kernel = torch.empty_like(out)
        _C.ops.linear(kernel, x, w.qweight, None, w.weight_format, w.scales, w.zeros, w.group_size)
        assert torch.equal(out, kernel)
        if method == "w4a8":
            assert_near_reference(out, x, w)
    else:
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)))


@pytest.mark.parametrize("method,weights", [("w4a8", "int4"), ("w8a8", "int8")])
def test_int8_activations_are_refused_on_cuda(monkeypatch, method, weights):
    import octavo.engine.llm_engine as engine

    monkeypatch.setattr(engine, "resolve_device", lambda device: torch.device("cuda", 0))
    with pytest.raises(ValueError, match=f"'{method}' multiplies int8 activations on the CPU only \\(use '{weights}'"):
        engine._device("any-model", "cuda", method)
    assert engine._device("any-model", "auto", method) == torch.device("cpu")
