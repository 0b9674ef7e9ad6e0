"""The engine's process layouts on this machine, on the same offline requests through
LLM.generate (engines alternating over --rounds): the engine core in the caller's process (LLM's
default), in a process of its own (the server's default), tensor parallel over 2 worker
processes, pipeline parallel over 2 stages, and 2 data-parallel engine cores. Output tokens per second, and per step the time
the last rank spent in collectives (TP: the all-reduce after the attention output and MLP down
projections and the embedding, the LM head's all-gather; PP: waiting for the first stage's
activations).

python bench/python/bench_engine_layouts.py [--layouts in-process core-process tp2 pp2 dp2] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from octavo import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu_peers import machine  # noqa: E402


LAYOUTS = {"in-process": {}, "core-process": {"multiprocess": True}, "tp2": {"tensor_parallel_size": 2},
           "pp2": {"pipeline_parallel_size": 2}, "dp2": {"data_parallel_size": 2}}


def counters(worker) -> tuple[float, int]:
    from octavo.distributed.parallel_state import comm_seconds

    return comm_seconds(), worker.num_steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face directory (default: the default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"machine: {machine()}")
    rng = np.random.default_rng(0)
    engines = {name: LLM(model=args.model, dtype=args.dtype, max_model_len=1024, kv_cache_memory_bytes=1 << 30,
                         device="cpu", **LAYOUTS[name]) for name in args.layouts}
    vocab = next(iter(engines.values())).llm_engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rates = {name: [] for name in args.layouts}
    comm = {name: [] for name in args.layouts}
    for _ in range(args.rounds):
        prompts = [rng.integers(100, vocab - 100, args.input_len).tolist() for _ in range(args.num_requests)]
        for name, llm in engines.items():  # fresh prompts each round: no prefix-cache hits
            before = llm.collective_rpc(counters)[-1]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            after = llm.collective_rpc(counters)[-1]
            rates[name].append(args.num_requests * args.output_len / seconds)
            comm[name].append(((after[0] - before[0]) / max(1, after[1] - before[1]), after[1] - before[1], seconds))
    print(f"{args.num_requests} requests x ({args.input_len} prompt + {args.output_len} output tokens), "
          f"{args.dtype}, median of {args.rounds} rounds")
    for name in args.layouts:
        per_step, steps, seconds = (statistics.median(x) for x in zip(*comm[name]))
        print(f"{name}: {statistics.median(rates[name]):.1f} output tok/s; {steps:.0f} steps of "
              f"{seconds / steps * 1e3:.1f} ms, {per_step * 1e3:.2f} ms of them in collectives on the last rank")
    for llm in engines.values():
        llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
