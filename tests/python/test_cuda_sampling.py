"""test_sampling.py's tests again, on the CUDA sampling kernel (skipped without a GPU). The
draws use the CPU kernel's random numbers, so the same statistical bounds apply."""

import pytest
import test_sampling
from octavo import _C
from test_sampling import *  # noqa: F401,F403  (the tests themselves)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not _C.cuda_compiled(), reason="this build of Octavo has no CUDA kernels")]


@pytest.fixture(autouse=True)
def _on_cuda(monkeypatch):
    monkeypatch.setattr(test_sampling, "DEVICE", "cuda")


# The CUDA kernel keeps every token tied exactly at a top_k / top_p threshold (cuda/sampling.cu);
# the CPU kernel keeps the lowest ids among them, which this test checks.
del test_top_k_ties_keep_lower_ids  # noqa: F821
# Argument checks belong to the op adapter, which these call with CPU tensors: tested once there.
del test_bad_arguments_raise_clear_errors  # noqa: F821
