"""Octavo's CPU sampling kernel against the same pipeline written with torch ops.

One step samples a batch of requests that mixes greedy and random requests (temperature, top-k,
top-p, min-p, repetition / frequency penalties) and returns each request's sampled logprob, rank
and top-5 logprobs. Both sides use the same number of threads; times are medians after warm-up.

    python bench/python/bench_sampling.py [--dist peaked|flat] [--batches 1 8 64 256] [--threads N]

--dist peaked (default): logits N(0, 2^2) with a few tokens raised far above the rest, as from a
confident language model; flat: plain N(0, 2^2) logits, where top-p keeps thousands of tokens.
"""
import argparse
import statistics
import time

import torch

from octavo import _C

VOCABS = {"SmolLM2": 49152, "Qwen": 151936}
NUM_TOP = 5
PROMPT_LEN, OUTPUT_LEN = 64, 32


def make_step(batch: int, vocab: int, dist: str, seed: int = 0) -> dict:
    """Logits and per-request parameters; requests cycle through four kinds."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g) * 2
    if dist == "peaked":
        peaks = torch.randint(0, vocab, (batch, 16), generator=g)
        logits.scatter_add_(1, peaks, 8 + 6 * torch.rand(batch, 16, generator=g))
    # 0 greedy, 1 top-p, 2 top-k, 3 everything with penalties; a lone request is of kind 3
    kind = (torch.arange(batch) + 3) % 4
    step = dict(
        logits=logits,
        temperature=torch.tensor([0.0, 0.8, 1.0, 0.7])[kind],
        top_k=torch.tensor([0, 0, 50, 40], dtype=torch.int32)[kind],
        top_p=torch.tensor([1.0, 0.9, 1.0, 0.95])[kind],
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.05])[kind],
        repetition_penalty=torch.tensor([1.0, 1.0, 1.0, 1.1])[kind],
        frequency_penalty=torch.tensor([0.0, 0.0, 0.0, 0.2])[kind],
        presence_penalty=torch.tensor([0.0, 0.0, 0.0, 0.1])[kind],
        seeds=torch.arange(batch, dtype=torch.int64),
        counters=torch.full((batch,), 7, dtype=torch.int64),
    )
    for name, length in (("prompt", PROMPT_LEN), ("output", OUTPUT_LEN)):
        step[f"{name}_offsets"] = (torch.arange(batch + 1) * length).to(torch.int32)
        step[f"{name}_token_ids"] = torch.randint(0, vocab, (batch * length,), generator=g, dtype=torch.int32)
    return step


def octavo_sampler(step: dict):
    b = step["logits"].shape[0]
    out = dict(sampled=torch.empty(b, dtype=torch.int32), sampled_logprobs=torch.empty(b),
               sampled_ranks=torch.empty(b, dtype=torch.int32),
               top_token_ids=torch.empty(b, NUM_TOP, dtype=torch.int32), top_logprobs=torch.empty(b, NUM_TOP))
    args = {k: v for k, v in step.items() if k not in ("logits", "temperature", "seeds", "counters")}

    def run():
        _C.ops.sample(step["logits"], step["temperature"], step["seeds"], step["counters"], out["sampled"],
                      **args, sampled_logprobs=out["sampled_logprobs"], sampled_ranks=out["sampled_ranks"],
                      top_token_ids=out["top_token_ids"], top_logprobs=out["top_logprobs"])
        return out

    return run


def csr_rows(offsets: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets.diff().long())


def torch_penalties(x: torch.Tensor, s: dict) -> torch.Tensor:
    """Penalties by gather / scatter at the listed (row, token) positions only."""
    vocab = x.shape[1]
    x = x.clone()
    flat = x.view(-1)
    prompt = csr_rows(s["prompt_offsets"]) * vocab + s["prompt_token_ids"].long()
    output = csr_rows(s["output_offsets"]) * vocab + s["output_token_ids"].long()
    seen = torch.unique(torch.cat([prompt, output]))
    r, v = s["repetition_penalty"][seen // vocab], flat[seen]
    flat[seen] = torch.where(v > 0, v / r, v * r)
    flat.index_add_(0, output, -s["frequency_penalty"][output // vocab])  # once per occurrence
    once = torch.unique(output)
    flat.index_add_(0, once, -s["presence_penalty"][once // vocab])
    return x


def torch_filter(probs: torch.Tensor, s: dict) -> torch.Tensor:
    """min_p, then top-k (topk), then top-p (sort + cumsum), on the rows that ask for them."""
    probs = probs.masked_fill(probs < s["min_p"][:, None] * probs.amax(1, keepdim=True), 0)
    vocab = probs.shape[1]
    k = s["top_k"].long()
    rows = ((k > 0) & (k < vocab)).nonzero()[:, 0]
    if rows.numel():
        top = probs[rows].topk(int(k[rows].max()), dim=1).values
        kth = top.gather(1, k[rows][:, None] - 1)
        probs[rows] = probs[rows].masked_fill(probs[rows] < kth, 0)  # ties at the k-th value stay
    rows = (s["top_p"] < 1).nonzero()[:, 0]
    if rows.numel():
        sub = probs[rows]
        sorted_p, order = sub.sort(dim=1, descending=True)
        before = sorted_p.cumsum(1) - sorted_p
        drop = before >= s["top_p"][rows][:, None] * sorted_p.sum(1, keepdim=True)
        probs[rows] = sub.scatter(1, order, sorted_p.masked_fill(drop, 0))
    return probs


def torch_sampler(step: dict):
    def run():
        s = step
        logprobs = torch.log_softmax(s["logits"], dim=1)
        x = torch_penalties(s["logits"], s)
        sampled = x.argmax(1)
        rows = (s["temperature"] >= 1e-5).nonzero()[:, 0]  # the random requests
        if rows.numel():
            sub = {k: s[k][rows] for k in ("temperature", "top_k", "top_p", "min_p")}
            probs = torch_filter(torch.softmax(x[rows] / sub["temperature"][:, None], dim=1), sub)
            sampled[rows] = torch.multinomial(probs, 1)[:, 0]
        chosen = logprobs.gather(1, sampled[:, None])
        ranks = (logprobs >= chosen).sum(1)
        top = logprobs.topk(NUM_TOP, dim=1)
        return sampled, chosen, ranks, top

    return run


def median_ms(fn, min_seconds: float = 0.4) -> float:
    for _ in range(2):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_seconds and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", choices=["peaked", "flat"], default="peaked")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--threads", type=int, default=_C.get_num_threads(), help="for both (default: Octavo's)")
    args = parser.parse_args()
    _C.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    print(f"threads {_C.get_num_threads()}, cpu isa {_C.cpu_isa()}, logits {args.dist}, torch {torch.__version__}")
    print(f"{'batch':>6} {'vocab':>7} {'octavo ms':>10} {'torch ms':>10} {'torch/octavo':>13}")
    for vocab in VOCABS.values():
        for batch in args.batches:
            step = make_step(batch, vocab, args.dist)
            ours = median_ms(octavo_sampler(step))
            theirs = median_ms(torch_sampler(step))
            print(f"{batch:>6} {vocab:>7} {ours:>10.3f} {theirs:>10.3f} {theirs / ours:>12.1f}x", flush=True)


if __name__ == "__main__":
    main()
