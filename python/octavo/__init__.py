"""Octavo: an LLM inference engine with a native C++/CUDA core.

The scheduler, KV cache manager and kernels live in the extension module ``octavo._C``; this
package holds the Python side and the installed C++ package (see :func:`cmake_dir`).
"""

import os
from pathlib import Path

# torch's OpenMP workers spin for a while after each parallel torch op (GNU OpenMP's default wait
# policy). With few cores they then hold the core that Octavo's kernel threads need next: on the
# 2-core development machine single-stream bfloat16 decode of the default model ran at 52 tok/s
# with the default and 102 tok/s with PASSIVE. libgomp reads this when torch loads it, so it only
# takes effect when octavo is imported before torch; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from . import _C  # noqa: E402
from ._C import __version__  # noqa: E402

from ._C import BlockPool, Scheduler, SchedulerConfig, SchedulerOutput, UpdateOutput
# Kernels (octavo.ops.rms_norm, .paged_attention, ...) and the CPU thread / ISA controls.
from ._C import cpu_isa, get_num_threads, ops, set_num_threads

# UpdateOutput.finish_reasons holds indices into this tuple (vLLM's finish_reason strings).
FINISH_REASONS = (None, "stop", "length", "abort")  # the scheduler's; the engine adds "error"

# vLLM's offline API: code written for vLLM runs by changing the import.
from .llm import LLM  # noqa: E402  (the engine reads FINISH_REASONS from this module)
from .outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from .sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["BeamSearchParams", "BlockPool", "CompletionOutput", "FINISH_REASONS", "LLM", "Logprob", "RequestOutput", "SamplingParams",
           "Scheduler", "SchedulerConfig", "SchedulerOutput", "StructuredOutputsParams", "UpdateOutput", "__version__",
           "cmake_dir", "cpu_isa", "get_num_threads", "ops", "set_num_threads"]


def cmake_dir() -> str:
    """Directory holding ``octavoConfig.cmake``, for ``-Doctavo_DIR=...`` in a C++ project."""
    path = Path(__file__).resolve().parent / "lib" / "cmake" / "octavo"
    if not (path / "octavoConfig.cmake").is_file():
        raise FileNotFoundError(
            f"octavoConfig.cmake is not in {path}: this octavo install carries no CMake package. "
            "Reinstall from a wheel built by `pip install .` (not an in-tree or editable build)."
        )
    return str(path)
