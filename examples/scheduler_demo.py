"""Drive Octavo's native scheduler through a small serving workload and print each step.

Twelve chat-style requests share a 64-token system prompt and arrive over time; the KV pool is
small enough that decoding forces preemptions. The "model" is a stand-in that returns a
deterministic token per request (the engine proper arrives with the model runner). Watch chunked
prefill, decodes and prefills sharing one token budget, prefix-cache hits on the shared prompt,
and preempted requests resuming.
"""
import numpy as np

from octavo import _C

SYSTEM_PROMPT = list(range(1000, 1064))


def make_prompt(i: int) -> list[int]:
    return SYSTEM_PROMPT + [2000 + 37 * i + k for k in range(8 + 5 * (i % 4))]


def main() -> None:
    config = _C.SchedulerConfig(num_blocks=22, block_size=16, max_model_len=512, max_num_seqs=8,
                                max_num_batched_tokens=96)
    sched = _C.Scheduler(config)
    rng = np.random.default_rng(0)
    print(f"pool: {config.num_blocks - 1} blocks x {config.block_size} tokens, "
          f"budget {config.max_num_batched_tokens} tokens/step, up to {config.max_num_seqs} requests")
    print(f"{'step':>4} {'run':>4} {'wait':>4} {'prefill':>8} {'decode':>7} {'kv use':>7}  events")
    arrivals = {step: i for i, step in enumerate(range(0, 24, 2))}
    outputs: dict[int, list[int]] = {}
    step = 0
    while step in arrivals or sched.has_unfinished_requests() or step <= max(arrivals):
        if step in arrivals:
            i = arrivals[step]
            sched.add_request(f"chat-{i}", make_prompt(i), max_tokens=40 + 8 * (i % 3), eos_token_id=0)
        out = sched.schedule()
        decode = int(np.sum((out.num_scheduled_tokens == 1) & (out.is_new == 0)))
        prefill = out.total_num_scheduled_tokens - decode
        events = [f"preempted {out.preempted_handles.tolist()}"] if len(out.preempted_handles) else []
        new_hits = [int(c) for c, n in zip(out.num_computed_tokens, out.is_new) if n and c]
        if new_hits:
            events.append(f"prefix hits {new_hits} tokens")
        usage = sched.block_pool.usage
        sampled = rng.integers(1, 30000, size=out.num_reqs, dtype=np.int32)
        update = sched.update_from_output(sampled)
        for k, handle in enumerate(update.req_handles):
            lo, hi = update.new_token_offsets[k], update.new_token_offsets[k + 1]
            outputs.setdefault(int(handle), []).extend(update.new_token_ids[lo:hi].tolist())
        finished = [int(h) for h, r in zip(update.req_handles, update.finish_reasons) if r]
        if finished:
            events.append(f"finished {finished}")
        print(f"{step:>4} {sched.num_running:>4} {sched.num_waiting:>4} {prefill:>8} {decode:>7} {usage:>6.0%}  "
              + "; ".join(events))
        step += 1
    stats = sched.prefix_cache_stats
    print(f"\n{len(outputs)} requests, {sum(map(len, outputs.values()))} tokens generated in {step} steps; "
          f"{sched.num_preemptions} preemptions; prefix cache hit rate "
          f"{stats['hits'] / max(stats['queries'], 1):.0%} of {stats['queries']} prompt tokens looked up")
    print(f"KV blocks in use after the run: {sched.block_pool.num_used_blocks}")


if __name__ == "__main__":
    main()
