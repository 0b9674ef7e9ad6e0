"""test_elementwise_ops.py's kernel cases again, on the CUDA kernels (skipped without a GPU):
the same shapes, strides and float64 references, with the ops taking the CPU tests' tensors to
the GPU and back (ops_on_device.py)."""

import pytest
import test_elementwise_ops
from ops_on_device import rerun_on_cuda
from test_elementwise_ops import *  # noqa: F401,F403  (the tests themselves)

pytestmark, isa, _on_cuda = rerun_on_cuda(test_elementwise_ops)


# The CPU thread pool, and the op adapters' argument checks, which run on the host for any device
# (positions out of the cache, which the CUDA kernel skips instead, are tested in test_cuda_ops.py).
del test_results_do_not_depend_on_thread_count, test_bad_arguments_raise  # noqa: F821
# The RoPE cache builders: Python, no kernel.
del test_rope_inv_freq_matches_transformers, test_rope_cache_matches_hf_rotary_embedding  # noqa: F821
del test_rope_raw_config_dict, test_rope_gptj_style, test_rope_unsupported_type_names_it  # noqa: F821
del test_rope_per_layer_type_parameters, test_rope_partial_rotary_matches_transformers  # noqa: F821
