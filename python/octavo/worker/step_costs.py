"""What steps cost on this machine, measured once at startup for speculative decoding's cost rule
(speculative.py): a target step's fixed cost in rows (a / b, a step taking about a + b * rows)
and a drafter's time for one and for several drafting requests, in rows (units of b)."""

from __future__ import annotations

import time

import torch

from .model_runner import dummy_batch

REPEATS = 5
TARGET_ROWS = {"cpu": 64, "cuda": 1024}  # the larger step timed: where b shows above the noise
MAX_DRAFTING = 16  # the most drafting requests timed (the rule extrapolates linearly)


def fastest(run) -> float:
    """The fewest of the seconds ``run`` reports over REPEATS calls, after an uncounted one
    (allocations, caches)."""
    return min([run() for _ in range(REPEATS + 1)][1:])


def step_seconds(runner, num_reqs: int) -> float:
    """One target step of ``num_reqs`` one-token requests, to the end of its kernels."""
    step = dummy_batch(num_reqs, 1, runner.block_size, 1)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    started = time.perf_counter()
    runner.execute(step)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - started


def row_costs(runner, max_rows: int) -> tuple[float, float] | None:
    """(a / b, b seconds) from steps of 1 and of up to ``max_rows`` one-token requests over blocks
    1.. (unused at startup); None when fewer than 2 rows fit. a / b is capped at 1000 rows: on a
    tiny model b vanishes in the noise, and rows are then all but free."""
    rows = min(TARGET_ROWS.get(runner.device.type, TARGET_ROWS["cpu"]), max_rows, runner.num_blocks - 1)
    if rows < 2:
        return None
    one, many = (fastest(lambda n=n: step_seconds(runner, n)) for n in (1, rows))
    b = max((many - one) / (rows - 1), one / 1000)
    return max(one - b, 0.0) / b, b


def drafting_sizes(max_num_seqs: int, num_blocks: int, blocks_each: int) -> list[int]:
    """The numbers of drafting requests to time: 1 and the most that fit, up to MAX_DRAFTING
    (none where one request's blocks do not fit)."""
    most = min(max_num_seqs, MAX_DRAFTING, (num_blocks - 1) // blocks_each)
    return sorted({1, most}) if most >= 1 else []


def drafting_rows(drafter, max_num_seqs: int, row_seconds: float) -> list[tuple[int, float]]:
    """[(n, the drafter's time for n requests in rows)] (drafter: DraftModel or EagleDrafter,
    each with ``time_step(n)``, the seconds of its drafting for n requests over blocks 1.., and
    ``blocks_each``, the blocks one of them spans)."""
    sizes = drafting_sizes(max_num_seqs, drafter.runner.num_blocks, drafter.blocks_each)
    return [(n, fastest(lambda n=n: drafter.time_step(n)) / row_seconds) for n in sizes]

