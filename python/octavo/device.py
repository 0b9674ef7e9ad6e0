"""The device an engine runs on. "auto" takes the GPU when both torch and this build of Octavo
can use one, and the CPU otherwise."""

from __future__ import annotations

import torch

from . import _C


def cuda_unusable_reason() -> str | None:
    """Why CUDA cannot be used here, or None when it can."""
    if not _C.cuda_compiled():
        return "this build of Octavo has no CUDA kernels (it was built without nvcc)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """"auto" (or None), "cpu", "cuda" or "cuda:N" -> a torch.device; ValueError, with the
    reason, for a CUDA device that cannot be used."""
    if device is None or device == "auto":
        return torch.device("cpu") if cuda_unusable_reason() else torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda":
        reason = cuda_unusable_reason()
        if reason:
            raise ValueError(f"device {str(device)!r} cannot be used: {reason}")
        return torch.device("cuda", device.index or 0)
    if device.type != "cpu":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {str(device)!r}")
    return device
