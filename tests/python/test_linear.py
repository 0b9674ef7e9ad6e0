"""The CPU ``linear`` kernel (out = input · weightᵀ + bias) against float64 on every compiled ISA,
its batch invariance, the torch/Octavo crossover in octavo.layers.linear, and its argument checks."""

import pytest
import torch
from octavo import _C
from octavo.layers.linear import TORCH_FROM_ROWS, linear

from test_elementwise_ops import DTYPE_IDS, DTYPES

# max |out - ref| / max |ref|, ref in float64 on the same (rounded) inputs: float32 accumulation
# error for float32; for 16-bit outputs the final rounding (2^-8 bf16, 2^-11 f16) dominates.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(7)


def reference(x, w, b):
    ref = x.double() @ w.double().T
    return ref if b is None else ref + b.double()


def assert_close(out, ref, dtype):
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} >= {TOLERANCE[dtype]:g} ({dtype})"


# K covers: below one vector, a vector tail (not a multiple of 16 or 32), exact multiples, and the
# default model's widths. N covers partial row tiles; M covers every accumulator-group size.
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 7, 5), (2, 33, 100), (3, 64, 576), (4, 9, 1536),
                                   (5, 130, 48), (17, 66, 576), (64, 40, 200)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_matches_float64(isa, dtype, m, n, k, bias):
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    _C.ops.linear(out, x, w, b)
    assert_close(out, reference(x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_large_enough_to_use_every_thread(dtype):
    x, w = torch.randn(3, 1000).to(dtype), torch.randn(3000, 1000).to(dtype)  # past the serial cutoff
    out = torch.empty(3, 3000, dtype=dtype)
    _C.ops.linear(out, x, w, None)
    assert_close(out, reference(x, w, None), dtype)


# Rows switch kernels at a threshold and are batch invariant on each side of it, not across:
# bfloat16 on the amx level takes AMX tiles from 8 rows (linear.cc's kAmxFromRows), float32 on every
# vector level takes transposed weight panels from 16 (linear_panels.h's kFromRows).
AMX_FROM_ROWS = 8
PANELS_FROM_ROWS = 16


def second_path_from_rows(isa, dtype):
    if isa == "amx" and dtype == torch.bfloat16:
        return AMX_FROM_ROWS
    if isa != "scalar" and dtype == torch.float32:
        return PANELS_FROM_ROWS
    return None


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_each_row_is_the_same_whatever_the_batch(isa, dtype):
    # 300 rows of 576 span two or three of the kernel's L2-sized row chunks.
    x, w = torch.randn(300, 576).to(dtype), torch.randn(700, 576).to(dtype)
    batch = torch.empty(300, 700, dtype=dtype)
    _C.ops.linear(batch, x, w, None)
    assert_close(batch, reference(x, w, None), dtype)
    threshold = second_path_from_rows(isa, dtype)
    sizes = (1, 5, 7) if threshold is None else (1, threshold - 1, threshold, threshold + 7)
    for i in (0, 5, 36, 111, 112, 299):
        rows = {}
        for size in sizes:  # the window of `size` rows that holds row i
            start = min(i, 300 - size)
            out = torch.empty(size, 700, dtype=dtype)
            _C.ops.linear(out, x[start:start + size], w, None)
            rows[size] = out[i - start]
        small = [rows[s] for s in sizes if threshold is None or s < threshold]
        large = [rows[s] for s in sizes if threshold is not None and s >= threshold] + [batch[i]]
        assert all(torch.equal(small[0], r) for r in small)
        assert all(torch.equal(large[0], r) for r in large)
        if threshold is None:
            assert torch.equal(small[0], batch[i])


# The float32 panel path's edges (and the same products on every other level): blocks of 6 (AVX2:
# 4) rows with a partial last one, 64-wide (24) panels with a partial one, K tails below a
# transpose block and K long enough for two slices, bias, row-strided input and output.
@pytest.mark.parametrize("m,n,k", [(16, 1, 1), (17, 63, 15), (19, 65, 17), (23, 24, 576), (30, 130, 1025),
                                   (64, 200, 2304), (257, 64, 96)])
def test_panels_match_float64(isa, m, n, k):
    x = torch.randn(m, k + 16)[:, 8:k + 8]
    w, b = torch.randn(n, k), torch.randn(n)
    out = torch.full((m, n + 8), float("nan"))
    _C.ops.linear(out[:, 8:], x, w, b)
    assert_close(out[:, 8:], reference(x, w, b), torch.float32)
    assert out[:, :8].isnan().all()  # nothing written outside the output's columns
    out = torch.full((m, n), float("nan"))
    _C.ops.linear(out, x, w, None)
    assert_close(out, reference(x, w, None), torch.float32)


# The AMX tile path's edges (and the same products on every other level): row blocks of 32 with
# a last partial one, 32-wide weight panels with a partial one, bias, row-strided input and
# output, and enough rows for several L2-sized row chunks.
@pytest.mark.parametrize("m,n,k", [(16, 32, 32), (17, 33, 64), (31, 1, 96), (32, 31, 576), (33, 700, 576),
                                   (100, 65, 1536), (2000, 40, 576)])
def test_tiles_match_float64(isa, m, n, k):
    dtype = torch.bfloat16
    x = torch.randn(m, k + 64).to(dtype)[:, 32:k + 32]
    w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    out = torch.full((m, n + 8), float("nan"), dtype=dtype)
    _C.ops.linear(out[:, 8:], x, w, b)
    assert_close(out[:, 8:], reference(x, w, b), dtype)
    assert out[:, :8].isnan().all()  # nothing written outside the output's columns
    out = torch.full((m, n), float("nan"), dtype=dtype)
    _C.ops.linear(out, x, w, None)
    assert_close(out, reference(x, w, None), dtype)


def test_row_strided_input_and_output():
    x = torch.randn(6, 80)[:, 8:72]  # rows of 64 with a stride of 80
    w = torch.randn(20, 64)
    out = torch.empty(6, 32)[:, :20]
    _C.ops.linear(out, x, w, None)
    assert_close(out, reference(x, w, None), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layer_picks_a_path_and_both_agree(dtype):
    w, b = torch.randn(48, 96).to(dtype), torch.randn(48).to(dtype)
    for m in (1, 31, 32, 40):
        x = torch.randn(m, 96).to(dtype)
        assert_close(linear(x, w, b), reference(x, w, b), dtype)
    assert TORCH_FROM_ROWS[torch.bfloat16] > 1  # decode rows always take the kernel


def test_bad_arguments_are_named():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        _C.ops.linear(torch.empty(2, 4), x, torch.randn(4, 9), None)
    with pytest.raises(ValueError, match="out"):
        _C.ops.linear(torch.empty(2, 5), x, w, None)
    with pytest.raises(ValueError, match="bias"):
        _C.ops.linear(torch.empty(2, 4), x, w, torch.randn(5))
    with pytest.raises(TypeError, match="weight"):
        _C.ops.linear(torch.empty(2, 4), x, w.double(), None)
    with pytest.raises(ValueError, match="weight"):
        _C.ops.linear(torch.empty(2, 4), x, torch.randn(8, 4).T, None)  # not contiguous
