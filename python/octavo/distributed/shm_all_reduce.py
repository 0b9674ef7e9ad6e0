"""All-reduce through shared memory for tensor-parallel ranks on one machine's CPUs.

gloo's all-reduce goes through loopback TCP: about 1.9 ms for a [64, 576] float32 tensor on the
2-core development machine, 62 of them a step for the default model. Ranks on one host can
instead meet in one shared file (/dev/shm): each writes its tensor into its own slot, raises its
flag, waits for every other flag, and sums the slots in rank order (so every rank gets the same
bits, as from gloo). Two sets of slots alternate between calls: a rank can only start call s + 2
after every rank has raised its flag for s + 1, which each does after it finished reading call
s's slots, so a slot is never rewritten while read.

The flags are plain stores and loads in shared memory: their order with the slot data holds on
x86-64 (stores are not reordered with stores, nor loads with loads), the only CPU this runs on
(``usable`` says so). Larger tensors than a slot holds go through gloo.
"""

from __future__ import annotations

import glob
import mmap
import os
import platform
import time

import numpy as np
import torch

SLOT_BYTES = 8 << 20  # one rank's tensor, at most (a 2048-token chunk of a 1024-wide float32 model)
_FLAGS_BYTES = 4096   # a page of flags before the slots


def usable() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def remove_shared_files(prefix: str) -> None:
    """Removes the files of the groups given ``prefix`` (one per pipeline stage), once their
    ranks are gone."""
    for path in glob.glob(f"{prefix}-*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class ShmAllReduce:
    """Rank ``rank`` of ``world`` ranks sharing the file ``path`` (rank 0 creates it before the
    others open it: the caller orders that with a barrier; whoever started the ranks removes
    it)."""

    def __init__(self, path: str, rank: int, world: int, timeout: float):
        self.rank, self.world, self.timeout = rank, world, timeout
        size = _FLAGS_BYTES + 2 * world * SLOT_BYTES
        if rank == 0:
            with open(path, "wb") as f:
                f.truncate(size)  # sparse: pages are taken only as slots fill
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), size)
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=world)
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=_FLAGS_BYTES).view(2, world, SLOT_BYTES)
        self._seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place (``fits(x)`` must hold)."""
        self._seq += 1
        nbytes = x.numel() * x.element_size()
        slots = self._slots[self._seq % 2, :, :nbytes].view(x.dtype).view(self.world, *x.shape)
        slots[self.rank].copy_(x)
        self._flags[self.rank] = self._seq
        self._wait_for_all()
        torch.add(slots[0], slots[1], out=x)
        for r in range(2, self.world):  # in rank order on every rank: the same sum everywhere
            x.add_(slots[r])
        return x

    def _wait_for_all(self) -> None:
        """Spins until every rank has written this call's slot, yielding the core each turn (ranks
        may share cores); a rank that never comes (it died) ends the wait after ``timeout``."""
        deadline = None
        while self._flags.min() < self._seq:
            os.sched_yield()
            if deadline is None:
                deadline = time.monotonic() + self.timeout
            elif time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel rank(s) {np.flatnonzero(self._flags < self._seq).tolist()} "
                                   f"did not join all-reduce {self._seq} within {self.timeout:.0f} s")
