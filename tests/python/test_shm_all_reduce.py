"""The shared-memory all-reduce of CPU tensor-parallel ranks: three ranks (this process is rank
0, two more are spawned) reduce many calls in a row, alternating slot sets; every rank must get
the same sum, exact for integer-valued floats, in every dtype the model runs in."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from octavo.distributed.shm_all_reduce import SLOT_BYTES, ShmAllReduce, usable

pytestmark = pytest.mark.skipif(not usable(), reason="x86-64 only")

CALLS = 50
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def contribution(rank: int, call: int, dtype: torch.dtype) -> torch.Tensor:
    """What rank ``rank`` reduces at call ``call``: small integers (exact in every dtype), of a
    shape that changes from call to call."""
    rows = 1 + (call * 7) % 13
    return ((torch.arange(rows * 5).view(rows, 5) + 3 * rank + call) % 17).to(dtype)


def run_rank(path: str, rank: int, world: int, results: str) -> None:
    shm = ShmAllReduce(path, rank, world, timeout=60.0)
    sums = [shm.all_reduce(contribution(rank, call, dtype)).float() for call in range(CALLS) for dtype in DTYPES]
    torch.save(sums, results)


def test_every_rank_gets_the_same_exact_sum(tmp_path):
    world, path = 3, str(tmp_path / "all-reduce")
    shm = ShmAllReduce(path, 0, world, timeout=60.0)  # rank 0 creates the file first
    ctx = multiprocessing.get_context("spawn")
    others = [ctx.Process(target=run_rank, args=(path, rank, world, str(tmp_path / f"{rank}.pt"))) for rank in (1, 2)]
    for p in others:
        p.start()
    mine = [shm.all_reduce(contribution(0, call, dtype)).float() for call in range(CALLS) for dtype in DTYPES]
    for p in others:
        p.join(timeout=60)
        assert p.exitcode == 0
    results = {rank: torch.load(tmp_path / f"{rank}.pt") for rank in (1, 2)}
    expected = [sum(contribution(r, call, dtype).float() for r in range(world)) for call in range(CALLS)
                for dtype in DTYPES]
    for got in (mine, results[1], results[2]):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_missing_rank_ends_the_wait_and_large_tensors_go_elsewhere(tmp_path):
    shm = ShmAllReduce(str(tmp_path / "all-reduce"), 0, 2, timeout=0.2)
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not join"):
        shm.all_reduce(torch.ones(4))
    assert shm.fits(torch.empty(SLOT_BYTES // 4)) and not shm.fits(torch.empty(SLOT_BYTES // 4 + 1))
