"""Where a decode step's time goes, for issue #7's GPU sessions: torch.profiler over a few
engine steps of a decoding batch, kernels ranked by total device time, and the wall time per
step beside the kernels' time (the difference is host work the GPU waits for).

    python bench/python/profile_step.py [--device cuda] [--dummy-shape llama-3-8b | --model DIR]
                                        [--batch 1 64] [--steps 8] [--graphs]

Eager by default, so that every kernel shows by name; --graphs profiles the captured decode
graphs instead (the wall time per step is then the one that counts). On the CPU only torch's
own ops show, not Octavo's kernels: there it checks the script, little more.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from octavo import LLM, SamplingParams


def build(args: argparse.Namespace):
    from octavo.benchmarks.shapes import model_arguments

    llm = LLM(dtype=args.dtype, device=args.device, max_model_len=1024, kv_cache_memory_bytes=4 << 30,
              max_num_seqs=max(args.batch), enforce_eager=not args.graphs,
              **model_arguments(args.model, None if args.model else args.dummy_shape))
    return llm.llm_engine


def decoding_batch(engine, batch: int, steps: int, rng) -> None:
    """Adds `batch` requests and steps until all of them are decoding (prompts done)."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", rng.integers(100, vocab - 100, 128).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:  # prompts take several steps when they exceed the step budget
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(2):
        engine.step()


def profile(engine, batch: int, steps: int, device: torch.device, rng) -> None:
    decoding_batch(engine, batch, steps, rng)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = (time.perf_counter() - start) / steps
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    busy = sum(getattr(e, key) for e in events) / steps / 1e3  # ms per step
    print(f"\nbatch {batch}: {wall * 1e3:.2f} ms per step wall, {busy:.2f} ms per step in "
          f"{'kernels' if device.type == 'cuda' else 'ops'} ({steps} steps)")
    print(events.table(sort_by=key, row_limit=18, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dummy-shape", default="llama-3-8b")
    parser.add_argument("--model", default=None, help="a Hugging Face model directory instead of a dummy shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--graphs", action="store_true", help="replay the captured decode graphs (not eager)")
    args = parser.parse_args()
    engine = build(args)
    rng = np.random.default_rng(0)
    for batch in args.batch:
        profile(engine, batch, args.steps, engine.device, rng)


if __name__ == "__main__":
    main()
