"""``linear`` and ``dequantize`` on GGUF blocks kept as the file stores them (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, IQ4_NL in blocks of 32; Q3_K, Q4_K, Q5_K, Q6_K in super-blocks of 256): dequantization
bit-exact against the gguf package, the quantized product bit-exact against the dense kernel on
the dequantized weights and close to float64, on every compiled ISA."""

import numpy as np
import pytest
import torch

from octavo import _C
from test_elementwise_ops import DTYPE_IDS, DTYPES
from test_linear import TOLERANCE, reference

gguf = pytest.importorskip("gguf")
QTYPES = {name: getattr(gguf.GGMLQuantizationType, name.upper())
          for name in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q3_k", "q4_k", "q5_k", "q6_k")}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18, "q3_k": 110, "q4_k": 144,
               "q5_k": 176, "q6_k": 210}
K_QUANTS = ("q3_k", "q4_k", "q5_k", "q6_k")
# Where each block keeps its float16 fields (d, then dmin / m), and its integer scale bytes.
HALVES = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "iq4_nl": (0,), "q3_k": (108,),
          "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
SCALE_BYTES = {"q3_k": range(96, 108), "q4_k": range(4, 16), "q5_k": range(4, 16), "q6_k": range(192, 208)}
QUANTIZED_BY_GGUF = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(11)


def assert_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype) -> None:
    """out against float64, relative to the sums of |x| |w| (+ |b|) that bound a dot product's
    rounding: relative to the result itself, an output near 0 by cancellation (likely with a
    single output of 32 random products) would fail any tolerance."""
    bound = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    err = ((out.double() - reference(x, w, b)).abs().max() / bound.max()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} >= {TOLERANCE[dtype]:g} ({dtype})"


def block_weights(fmt: str) -> int:
    return 256 if fmt in K_QUANTS else 32


def inputs(k: int, fmt: str) -> int:
    """k rounded up to whole blocks of fmt (the test shapes are written for blocks of 32)."""
    return -(-k // block_weights(fmt)) * block_weights(fmt)


def set_halves(blocks: np.ndarray, fmt: str, values: np.ndarray) -> None:
    """Writes float16 values (one per block and field) into blocks [count, block bytes]."""
    for i, at in enumerate(HALVES[fmt]):
        blocks[:, at:at + 2] = values[:, i].astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantized(n: int, k: int, fmt: str, seed: int = 0) -> torch.Tensor:
    """GGUF blocks of an [n, k] matrix: a random matrix quantized by the gguf package where it
    quantizes the format, else random bytes with finite float16 fields. Rows get scales from
    1e-3 to 10 so the float16 block scales cover a wide range (subnormal ones included)."""
    rng = np.random.default_rng(seed)
    magnitude = np.logspace(-3, 1, n, dtype=np.float32)[:, None]
    if fmt in QUANTIZED_BY_GGUF:
        w = rng.standard_normal((n, k)).astype(np.float32) * magnitude
        return torch.from_numpy(gguf.quants.quantize(w, QTYPES[fmt]))
    count = k // block_weights(fmt)
    blocks = rng.integers(0, 256, (n * count, BLOCK_BYTES[fmt]), dtype=np.uint8)
    halves = rng.standard_normal((n * count, len(HALVES[fmt]))) * np.repeat(magnitude, count, axis=0) / 64
    set_halves(blocks, fmt, halves)
    return torch.from_numpy(blocks.reshape(n, count * BLOCK_BYTES[fmt]))


def dequantized(q: torch.Tensor, fmt: str) -> torch.Tensor:
    out = torch.full((q.shape[0], q.shape[1] // BLOCK_BYTES[fmt] * block_weights(fmt)), float("nan"))
    _C.ops.dequantize(out, q, fmt)
    return out


@pytest.mark.parametrize("fmt", QTYPES)
def test_block_bytes(fmt):
    assert _C.ops.weight_block_bytes(fmt) == BLOCK_BYTES[fmt] == gguf.GGML_QUANT_SIZES[QTYPES[fmt]][1]
    assert _C.ops.weight_block_weights(fmt) == block_weights(fmt) == gguf.GGML_QUANT_SIZES[QTYPES[fmt]][0]
    assert _C.ops.weight_block_bytes("dense") == 0


@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (64, 576), (33, 1536)])
@pytest.mark.parametrize("fmt", QTYPES)
def test_dequantize_is_bit_exact_against_gguf(isa, fmt, n, k):
    k = inputs(k, fmt)
    q = quantized(n, k, fmt, seed=n + k)
    expected = gguf.quants.dequantize(q.numpy(), QTYPES[fmt])
    assert np.array_equal(dequantized(q, fmt).numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", QTYPES)
def test_dequantize_to_16_bits_rounds_the_float32_weights(isa, fmt, dtype):
    """The weights torch's GEMM multiplies on a GPU, for batches too large for ``linear``."""
    q = quantized(33, 1536, fmt, seed=5)
    out = torch.empty(33, 1536, dtype=dtype)  # 1536 is whole super-blocks too
    _C.ops.dequantize(out, q, fmt)
    assert torch.equal(out.view(torch.int16), dequantized(q, fmt).to(dtype).view(torch.int16))


def test_dequantize_handles_every_quant_value(isa):
    """Every byte value in every quant position, with the scale and minimum set by hand."""
    for fmt in QUANTIZED_BY_GGUF:
        size = BLOCK_BYTES[fmt]
        blocks = np.zeros((256, size), dtype=np.uint8)
        set_halves(blocks, fmt, np.tile([0.37, -1.5], (256, 1)))
        blocks[:, size - (32 if fmt == "q8_0" else 16):] = np.arange(256, dtype=np.uint8)[:, None]
        if fmt in ("q5_0", "q5_1"):  # the fifth bits: every pattern of each byte of them
            blocks[:, HALVES[fmt][-1] + 2:HALVES[fmt][-1] + 6] = np.arange(256, dtype=np.uint8)[:, None]
        q = torch.from_numpy(blocks.reshape(16, 16 * size))
        expected = gguf.quants.dequantize(q.numpy(), QTYPES[fmt])
        assert np.array_equal(dequantized(q, fmt).numpy().view(np.uint32), expected.view(np.uint32)), fmt


@pytest.mark.parametrize("fmt", ["iq4_nl", *K_QUANTS])
def test_dequantize_handles_every_byte_value_of_every_field(isa, fmt):
    """256 blocks in which each byte position that is not a float16 takes every value once (the
    quants, the packed 6-bit scales and minimums, the int8 scales), each position's sequence
    shifted so that neighbouring fields meet in many combinations; float16 fields set by hand to
    values of either sign."""
    size = BLOCK_BYTES[fmt]
    values = (np.arange(256)[:, None] + 37 * np.arange(size)[None, :]) % 256
    blocks = values.astype(np.uint8)
    set_halves(blocks, fmt, np.tile([0.37, -1.5], (256, 1)) * np.linspace(-2, 2, 256)[:, None])
    q = torch.from_numpy(blocks.reshape(16, 16 * size))
    expected = gguf.quants.dequantize(q.numpy(), QTYPES[fmt])
    assert np.array_equal(dequantized(q, fmt).numpy().view(np.uint32), expected.view(np.uint32))
    if fmt in SCALE_BYTES:  # every value of the scale bytes alone, with the quants fixed
        blocks = np.full((256, size), 0x5A, dtype=np.uint8)
        blocks[:, list(SCALE_BYTES[fmt])] = values[:, list(SCALE_BYTES[fmt])]
        set_halves(blocks, fmt, np.tile([0.37, -1.5], (256, 1)))
        q = torch.from_numpy(blocks.reshape(16, 16 * size))
        expected = gguf.quants.dequantize(q.numpy(), QTYPES[fmt])
        assert np.array_equal(dequantized(q, fmt).numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 7, 64), (2, 33, 96), (3, 64, 576), (4, 9, 1536), (5, 130, 32),
                                   (17, 66, 576), (64, 40, 128)])
@pytest.mark.parametrize("fmt", QTYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_equals_the_dense_kernel_on_dequantized_weights(isa, dtype, fmt, m, n, k, bias):
    k = inputs(k, fmt)
    q = quantized(n, k, fmt, seed=m * n + k)
    w = dequantized(q, fmt)
    x = torch.randn(m, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    _C.ops.linear(out, x, q, b, weight_format=fmt)
    if dtype == torch.float32:  # the dense kernel needs its weight in the activations' dtype
        dense = torch.empty_like(out)
        _C.ops.linear(dense, x, w, b)
        assert torch.equal(out, dense)
    assert_close(out, x, w, b, dtype)


@pytest.mark.parametrize("fmt", QTYPES)
def test_linear_rows_do_not_depend_on_the_batch(fmt):
    # Alone, a row decodes weights in registers; from 8 rows the kernel decodes each weight tile
    # once to float32 first (same sums, same bits); from 16 rows the tiles are decoded into
    # transposed panels, which add in another order: rows are the same on each side of 16.
    k = inputs(576, fmt)
    q = quantized(40, k, fmt)
    x = torch.randn(250, k)
    batched = torch.empty(250, 40)
    _C.ops.linear(batched, x, q, None, weight_format=fmt)
    for i in (0, 1, 7, 8, 12, 111, 112, 249):
        rows = {}
        for size in (1, 9, 15, 16, 40):
            start = min(i, 250 - size)
            out = torch.empty(size, 40)
            _C.ops.linear(out, x[start:start + size], q, None, weight_format=fmt)
            rows[size] = out[i - start]
        assert torch.equal(rows[1], rows[9]) and torch.equal(rows[1], rows[15])
        assert torch.equal(rows[16], batched[i]) and torch.equal(rows[40], batched[i])


def test_linear_takes_strided_input_and_output():
    q = quantized(24, 64, "q4_1")
    x = torch.randn(6, 100)[:, 10:74]
    out = torch.zeros(6, 50)
    _C.ops.linear(out[:, 3:27], x, q, None, weight_format="q4_1")
    assert_close(out[:, 3:27], x, dequantized(q, "q4_1"), None, torch.float32)
    assert out[:, :3].abs().sum() == 0 and out[:, 27:].abs().sum() == 0


def test_bad_arguments_are_named():
    q = quantized(8, 64, "q8_0")
    out, x = torch.empty(2, 8), torch.randn(2, 64)
    with pytest.raises(ValueError, match="unknown weight format 'q2_k'"):
        _C.ops.linear(out, x, q, None, weight_format="q2_k")
    with pytest.raises(ValueError, match="divisible by 256, got 64"):
        _C.ops.linear(out, x, torch.zeros(8, 36, dtype=torch.uint8), None, weight_format="q4_k")
    with pytest.raises(ValueError, match="must be uint8, got float32"):
        _C.ops.linear(out, x, q.float(), None, weight_format="q8_0")  # blocks are uint8
    with pytest.raises(ValueError, match="divisible by 32"):
        _C.ops.linear(torch.empty(2, 8), torch.randn(2, 48), torch.zeros(8, 51, dtype=torch.uint8), None,
                      weight_format="q8_0")
    with pytest.raises(ValueError, match="weight"):  # 64 inputs in q4_0 are 36 bytes a row, not 68
        _C.ops.linear(out, x, q, None, weight_format="q4_0")
    with pytest.raises(ValueError, match="dense"):
        _C.ops.dequantize(torch.empty(8, 64), q, "dense")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        _C.ops.dequantize(torch.empty(8, 64, dtype=torch.int32), q, "q8_0")
