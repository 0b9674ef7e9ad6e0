"""The model-parallel groups of this process and their collectives (no-ops for one rank).

Workers join once at startup (``init_model_parallel``): gloo on the CPU, NCCL on GPUs. Global
rank = pipeline stage * tensor_parallel_size + tensor-parallel rank. Within a stage the model
calls ``all_reduce`` after each row-parallel projection (attention output, MLP down) and after
the vocabulary-parallel embedding lookup, and ``gather_vocab`` to join the LM head's slices into
whole logits. CPU ranks on one machine all-reduce through shared memory (shm_all_reduce.py)
where they are given a place for it, gloo otherwise. Between stages each rank sends its
activations to the rank of the same tensor-parallel index in the next stage
(``send_to_next_stage`` / ``recv_from_previous_stage``).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from . import shm_all_reduce

_rank, _tp, _pp = 0, 1, 1
_tp_group = None  # None: the default group (one stage)
_shm: shm_all_reduce.ShmAllReduce | None = None
_device = torch.device("cpu")
_last_send: tuple[list, list] = ([], [])  # its work handles, and its tensors (alive until it completes)
_comm_seconds = 0.0  # spent in collectives and waiting on the previous stage (benchmarks read it)
# A rank that died leaves the others waiting in a collective; this bounds the wait (the executor
# notices the dead worker first and stops the group).
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


class UpstreamStageFailed(RuntimeError):
    """An earlier pipeline stage failed this step's forward pass: this stage cannot run it."""


def init_model_parallel(rank: int, tp: int, pp: int, init_method: str | None, device: torch.device,
                        shared_memory: str | None = None) -> None:
    """shared_memory: a path prefix on this machine that every rank can open (every rank of the
    group runs here), for the CPU all-reduce; None: gloo's."""
    global _rank, _tp, _pp, _tp_group, _device, _shm
    _rank, _tp, _pp, _device = rank, tp, pp, device
    if tp * pp == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp * pp,
                            timeout=COLLECTIVE_TIMEOUT)
    if pp > 1 and tp > 1:  # every rank creates every stage's group, in the same order
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        _tp_group = groups[rank // tp]
    if tp > 1 and shared_memory and device.type == "cpu" and shm_all_reduce.usable():
        path = f"{shared_memory}-stage{rank // tp}"
        if rank % tp == 0:  # the stage's first rank creates the file before the others open it
            _shm = shm_all_reduce.ShmAllReduce(path, 0, tp, COLLECTIVE_TIMEOUT.total_seconds())
        dist.barrier()
        if rank % tp:
            _shm = shm_all_reduce.ShmAllReduce(path, rank % tp, tp, COLLECTIVE_TIMEOUT.total_seconds())
        dist.barrier()  # every rank has mapped the file: its name can go, the memory stays
        if rank % tp == 0:
            os.unlink(path)


@contextmanager
def alone():
    """Work of this rank that no other rank joins (the driver's draft model, whole on it): its
    collectives are no-ops. The rank runs it between steps, on the thread that runs its steps."""
    global _tp
    saved, _tp = _tp, 1
    try:
        yield
    finally:
        _tp = saved


def comm_seconds() -> float:
    return _comm_seconds


def _timed(run):
    global _comm_seconds
    start = time.perf_counter()
    result = run()
    _comm_seconds += time.perf_counter() - start
    return result


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every tensor-parallel rank's ``x``, in place."""
    if _tp == 1:
        return x
    if _shm is not None and _shm.fits(x):
        return _timed(lambda: _shm.all_reduce(x))
    _timed(lambda: dist.all_reduce(x, group=_tp_group))
    return x


def gather_vocab(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """[R, sizes[rank]] on each rank -> [R, sum(sizes)] (the ranks' slices side by side), on every
    rank of the stage."""
    if _tp == 1:
        return x
    widest = max(sizes)
    padded = torch.nn.functional.pad(x, (0, widest - x.shape[1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(_tp)]
    _timed(lambda: dist.all_gather(parts, padded, group=_tp_group))
    return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)


def send_to_next_stage(x: torch.Tensor | None) -> None:
    """Sends this stage's activations for the step, or None when its forward pass failed (the
    next stage then raises UpstreamStageFailed instead of waiting). Returns once the previous
    send has completed, not this one: the stage goes on with its next step meanwhile."""
    global _last_send
    for work in _last_send[0]:
        work.wait()
    ok = torch.tensor([x is not None], dtype=torch.int64, device=_device)
    tensors = [ok] if x is None else [ok, x.contiguous()]
    _last_send = ([dist.isend(t, _rank + _tp) for t in tensors], tensors)


def recv_from_previous_stage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The previous stage's activations for this step (waits for them)."""
    ok = torch.empty(1, dtype=torch.int64, device=_device)
    _timed(lambda: dist.recv(ok, _rank - _tp))
    if not ok.item():
        raise UpstreamStageFailed("an earlier pipeline stage failed this step's forward pass")
    x = torch.empty(shape, dtype=dtype, device=_device)
    _timed(lambda: dist.recv(x, _rank - _tp))
    return x
