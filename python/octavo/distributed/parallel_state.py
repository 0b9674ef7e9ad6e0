"""The tensor-parallel group of this process and its collectives (no-ops for one rank).

Workers join the group once at startup (``init_tensor_parallel``): gloo on the CPU, NCCL on
GPUs. The model calls ``all_reduce`` after each row-parallel projection (attention output,
MLP down) and after the vocabulary-parallel embedding lookup, and ``gather_vocab`` to join the
LM head's slices into whole logits.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

_world = 1
_comm_seconds = 0.0  # spent in collectives by this process (benchmarks read it)
# A rank that died leaves the others waiting in a collective; this bounds the wait (the executor
# notices the dead worker first and stops the group).
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def init_tensor_parallel(rank: int, world: int, init_method: str, device: torch.device) -> None:
    global _world
    _world = world
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)


def comm_seconds() -> float:
    return _comm_seconds


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``x``, in place."""
    global _comm_seconds
    if _world > 1:
        start = time.perf_counter()
        dist.all_reduce(x)
        _comm_seconds += time.perf_counter() - start
    return x


def gather_vocab(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """[R, sizes[rank]] on each rank -> [R, sum(sizes)] (the ranks' slices side by side), on every rank."""
    global _comm_seconds
    if _world == 1:
        return x
    widest = max(sizes)
    padded = torch.nn.functional.pad(x, (0, widest - x.shape[1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(_world)]
    start = time.perf_counter()
    dist.all_gather(parts, padded)
    _comm_seconds += time.perf_counter() - start
    return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)
