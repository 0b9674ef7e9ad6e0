"""A step's small host arrays moved to the device in one copy, and its small results back in one.

Each step hands the GPU a handful of small arrays (token ids, positions, slots, block tables,
sampling parameters). Copied one by one from pageable memory, each is a separate synchronous
driver call; here they are packed into one pinned buffer and sent with one asynchronous copy,
and the tensors handed back are views of one device buffer. On the CPU the arrays are copied
into tensors of their own. The sampler's outputs (token ids, and logprobs when asked) likewise
live in one device buffer (``PackedOutputs``) that comes back in one copy.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_ALIGN = 16  # bytes: every view starts aligned for any element type and for 16-byte loads


class Staging:
    """Packs arrays into one host-to-device copy; the views it returns stay valid until the next
    ``to_device`` call on this object (the buffers are reused)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host: torch.Tensor | None = None    # pinned uint8
        self._target: torch.Tensor | None = None  # device uint8
        self._copied: torch.cuda.Event | None = None

    def to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.array(a)) for a in arrays]
        offsets, total = _layout([a.nbytes for a in arrays])
        self._reserve(total)
        host = self._host.numpy()
        for a, at in zip(arrays, offsets):
            host[at:at + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        self._target[:total].copy_(self._host[:total], non_blocking=True)
        self._copied.record()
        return [self._target[at:at + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
                for a, at in zip(arrays, offsets)]

    def _reserve(self, nbytes: int) -> None:
        if self._copied is not None:
            # The last copy may still be reading the pinned buffer that is about to be rewritten.
            self._copied.synchronize()
        if self._host is not None and self._host.numel() >= nbytes:
            return
        size = max(nbytes, 2 * (self._host.numel() if self._host is not None else 4096))
        self._host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        # Kernels queued before may still read the old device buffer: it is freed by torch's
        # caching allocator in stream order, so dropping it here is safe.
        self._target = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._copied = torch.cuda.Event()


class PackedOutputs:
    """Empty tensors of the given shapes and dtypes on ``device``, views of one buffer, so that
    what a kernel writes into them comes back in one copy (``to_host``)."""

    def __init__(self, device: torch.device, **specs: tuple[tuple[int, ...], torch.dtype]):
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs.values()]
        self._offsets, total = _layout(sizes)
        self._buffer = torch.empty(total, dtype=torch.uint8, device=device)
        self.tensors = {name: self._buffer[at:at + size].view(dtype).view(shape)
                        for (name, (shape, dtype)), at, size in zip(specs.items(), self._offsets, sizes)}

    def to_host(self) -> dict[str, np.ndarray]:
        host = self._buffer.cpu()  # one device-to-host copy (none on the CPU)
        return {name: host[at:at + t.nbytes].view(t.dtype).view(t.shape).numpy()
                for (name, t), at in zip(self.tensors.items(), self._offsets)}


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of consecutive parts, each _ALIGN-aligned, and the total."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    return offsets, total


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
