"""``linear`` and ``dequantize`` on GGUF Q8_0 / Q4_0 / Q4_1 blocks kept as the file stores them:
dequantization bit-exact against the gguf package, the quantized product bit-exact against the
dense kernel on the dequantized weights and close to float64, on every compiled ISA."""

import numpy as np
import pytest
import torch

from octavo import _C
from test_elementwise_ops import DTYPE_IDS, DTYPES
from test_linear import assert_close, reference

gguf = pytest.importorskip("gguf")
QTYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
          "q4_1": gguf.GGMLQuantizationType.Q4_1}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def quantized(n: int, k: int, fmt: str, seed: int = 0) -> torch.Tensor:
    """Real GGUF blocks of a random [n, k] matrix, quantized by the gguf package. Rows get scales
    from 1e-3 to 10 so the float16 block scales cover a wide range (subnormal ones included)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * np.logspace(-3, 1, n, dtype=np.float32)[:, None]
    return torch.from_numpy(gguf.quants.quantize(w, QTYPES[fmt]))


def dequantized(q: torch.Tensor, fmt: str) -> torch.Tensor:
    out = torch.full((q.shape[0], q.shape[1] // BLOCK_BYTES[fmt] * 32), float("nan"))
    _C.ops.dequantize(out, q, fmt)
    return out


@pytest.mark.parametrize("fmt", QTYPES)
def test_block_bytes(fmt):
    assert _C.ops.weight_block_bytes(fmt) == BLOCK_BYTES[fmt] == gguf.GGML_QUANT_SIZES[QTYPES[fmt]][1]
    assert _C.ops.weight_block_bytes("dense") == 0


@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (64, 576), (33, 1536)])
@pytest.mark.parametrize("fmt", QTYPES)
def test_dequantize_is_bit_exact_against_gguf(isa, fmt, n, k):
    q = quantized(n, k, fmt, seed=n + k)
    expected = gguf.quants.dequantize(q.numpy(), QTYPES[fmt])
    assert np.array_equal(dequantized(q, fmt).numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", QTYPES)
def test_dequantize_to_16_bits_rounds_the_float32_weights(isa, fmt, dtype):
    """The weights torch's GEMM multiplies on a GPU, for batches too large for ``linear``."""
    q = quantized(33, 1536, fmt, seed=5)
    out = torch.empty(33, 1536, dtype=dtype)
    _C.ops.dequantize(out, q, fmt)
    assert torch.equal(out.view(torch.int16), dequantized(q, fmt).to(dtype).view(torch.int16))


def test_dequantize_handles_every_quant_value(isa):
    """Every byte value in every quant position, with the scale and minimum set by hand."""
    for fmt in QTYPES:
        size = BLOCK_BYTES[fmt]
        blocks = np.zeros((256, size), dtype=np.uint8)
        blocks[:, :2] = np.frombuffer(np.float16(0.37).tobytes(), np.uint8)
        if fmt == "q4_1":
            blocks[:, 2:4] = np.frombuffer(np.float16(-1.5).tobytes(), np.uint8)
        blocks[:, size - (32 if fmt == "q8_0" else 16):] = np.arange(256, dtype=np.uint8)[:, None]
        q = torch.from_numpy(blocks.reshape(16, 16 * size))
        expected = gguf.quants.dequantize(q.numpy(), QTYPES[fmt])
        assert np.array_equal(dequantized(q, fmt).numpy().view(np.uint32), expected.view(np.uint32)), fmt


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 7, 64), (2, 33, 96), (3, 64, 576), (4, 9, 1536), (5, 130, 32),
                                   (17, 66, 576), (64, 40, 128)])
@pytest.mark.parametrize("fmt", QTYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_equals_the_dense_kernel_on_dequantized_weights(isa, dtype, fmt, m, n, k, bias):
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
    assert_close(out, reference(x, w, b), dtype)


@pytest.mark.parametrize("fmt", QTYPES)
def test_linear_rows_do_not_depend_on_the_batch(fmt):
    # Alone, a row decodes weights in registers; from 8 rows the kernel decodes each weight tile
    # once to float32 first (same sums, same bits); from 16 rows the tiles are decoded into
    # transposed panels, which add in another order: rows are the same on each side of 16.
    q = quantized(40, 576, fmt)
    x = torch.randn(250, 576)
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
    assert_close(out[:, 3:27], reference(x, dequantized(q, "q4_1"), None), torch.float32)
    assert out[:, :3].abs().sum() == 0 and out[:, 27:].abs().sum() == 0


def test_bad_arguments_are_named():
    q = quantized(8, 64, "q8_0")
    out, x = torch.empty(2, 8), torch.randn(2, 64)
    with pytest.raises(ValueError, match="unknown weight format 'q5_k'"):
        _C.ops.linear(out, x, q, None, weight_format="q5_k")
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
