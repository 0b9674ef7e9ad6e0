"""One scheduler step driven from Python, as the engine's step loop will drive it.

Each step calls schedule(), fetches every array a model runner reads (zero-copy numpy views),
and feeds one sampled token per request back through update_from_output(). Compare with
bench/cpp/bench_scheduler (the same step without Python) to see the binding cost.

    python bench/python/bench_scheduler.py [--steps 3000]
"""
import argparse
import statistics
import time

import numpy as np

from octavo import _C

BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
PROMPT_LEN = 128


def prompt_for(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 32000 for i in range(length)]


def runner_step(sched: _C.Scheduler) -> int:
    out = sched.schedule()
    # What a model runner reads every step.
    arrays = (out.input_ids, out.positions, out.slot_mapping, out.query_start_loc,
              out.seq_lens, out.block_table, out.logits_indices)
    sampled = np.full(out.num_reqs, 42, dtype=np.int32)
    sched.update_from_output(sampled)
    return len(arrays[0])


def decode_bench(num_reqs: int, steps: int) -> float:
    config = _C.SchedulerConfig(num_blocks=num_reqs * (MAX_MODEL_LEN // BLOCK_SIZE) + 1,
                                block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                                max_num_seqs=num_reqs, max_num_batched_tokens=max(num_reqs, 8192))
    sched = _C.Scheduler(config)
    for i in range(num_reqs):
        sched.add_request(f"req-{i}", prompt_for(i, PROMPT_LEN), max_tokens=MAX_MODEL_LEN - PROMPT_LEN)
    while sched.num_waiting:
        runner_step(sched)
    runner_step(sched)
    return timed(lambda: runner_step(sched), steps)


def mixed_bench(steps: int) -> float:
    config = _C.SchedulerConfig(num_blocks=256 * (1024 // BLOCK_SIZE) + 1, block_size=BLOCK_SIZE,
                                max_model_len=MAX_MODEL_LEN, max_num_seqs=256, max_num_batched_tokens=2048)
    sched = _C.Scheduler(config)
    counter = iter(range(10**9))
    tail = prompt_for(0, 511)  # a distinct first token keeps prompts from sharing a prefix

    def top_up_and_step():
        while sched.num_running + sched.num_waiting < 272:
            n = next(counter)
            sched.add_request(f"req-{n}", [n % 32000 + 1] + tail, max_tokens=64)
        runner_step(sched)

    for _ in range(200):
        top_up_and_step()
    return timed(top_up_and_step, steps)


def timed(fn, steps: int) -> float:
    """Median over 5 rounds of the mean microseconds per call."""
    rounds = []
    per_round = max(1, steps // 5)
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(per_round):
            fn()
        rounds.append((time.perf_counter() - start) / per_round * 1e6)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="timed steps per case (< 3900)")
    args = parser.parse_args()
    print(f"{'case':<24}{'us/step':>10}")
    for n in (64, 256, 1024):
        print(f"{'decode ' + str(n):<24}{decode_bench(n, args.steps):>10.1f}")
    print(f"{'mixed 256 + prefill':<24}{mixed_bench(args.steps):>10.1f}")


if __name__ == "__main__":
    main()
