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


# Argument checks belong to the op adapter, which these call with CPU tensors: tested once there.
del test_bad_arguments_raise_clear_errors  # noqa: F821
