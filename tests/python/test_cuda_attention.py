"""test_attention.py's kernel cases again, on the CUDA kernels (skipped without a GPU): the same
batches and float64 references, with the ops taking the CPU tests' tensors to the GPU and back
(ops_on_device.py)."""

import pytest
import test_attention
from ops_on_device import rerun_on_cuda
from test_attention import *  # noqa: F401,F403  (the tests themselves)

pytestmark, isa, _on_cuda = rerun_on_cuda(test_attention)


@pytest.mark.parametrize("head_size", [64, 128, 256])  # of the CPU test's sizes, those CUDA compiles
def test_every_head_size(head_size):
    test_attention.test_every_head_size(None, head_size)


@pytest.mark.parametrize("dtype", test_attention.DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("kv_scales", test_attention.FP8_SCALES)
def test_an_fp8_cache_serves_queries(dtype, head_size, kv_scales):
    test_attention.test_an_fp8_cache_serves_queries(None, dtype, head_size, kv_scales)


def test_a_cache_of_another_16_bit_dtype_is_refused():
    """On CUDA a cache holds the query's dtype, or fp8."""
    with pytest.raises(TypeError, match="key_cache"):
        test_attention.test_a_16_bit_cache_serves_bfloat16_queries(None)


def test_other_head_sizes_are_refused():
    with pytest.raises(ValueError, match="head_size 80"):
        test_attention.test_every_head_size(None, 80)


# The CPU thread pool; the op adapters' argument checks (host-side, tested once on the CPU); the
# plan, a host-side op whose CUDA use test_cuda_ops.py covers.
del test_result_does_not_depend_on_thread_count, test_bad_arguments_raise_clear_errors  # noqa: F821
del test_plan_lays_out_tiles_of_query_rows, test_plan_refuses_bad_arguments  # noqa: F821
# Caches of another 16-bit dtype than the query: the CPU kernels' alone.
del test_a_16_bit_cache_serves_float32_queries, test_a_16_bit_cache_serves_bfloat16_queries  # noqa: F821
del test_reshape_and_cache_rounds_into_a_16_bit_cache  # noqa: F821
