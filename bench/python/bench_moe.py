"""Octavo's `fused_moe` against the torch loop over experts (per expert: index_select of its
tokens, two F.linear, silu, weighted index_add: what transformers does) on one MoE layer.

    python bench/python/bench_moe.py [--shapes mixtral qwen3] [--tokens 1 4 16 64 512 2048 4096]
                                     [--dtype bfloat16] [--formats dense int8 int4] [--repeats 5]
                                     [--device cpu|cuda]

Shapes: Mixtral-8x7B-like (8 experts, top-2, hidden 4096, expert width 14336) and
Qwen3-30B-A3B-like (128 experts, top-8, hidden 2048, expert width 768); random weights, routing
by topk_softmax of random router logits. Per row: milliseconds per call of each (best of
--repeats, taken in turn), the speedup, and at decode sizes the active experts' weight bytes read
per second as a fraction of the machine's read bandwidth (measured first). Quantized formats
(load-time int8 / int4 of the same weights) run only Octavo's op; their torch column is the
loop on the dense weights. On CUDA the bandwidth is a device-to-device copy's (read + write) and
each call is timed to its end on the device.
"""
import argparse
import time

import octavo  # noqa: F401  (before torch: OMP_WAIT_POLICY)
import torch
from octavo import _C
from octavo.benchmarks.memory import read_bandwidth
from octavo.layers.moe import fused_moe_torch
from octavo.layers.quantize import quantize

from machine import cpu_line

SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3": (128, 8, 2048, 768),  # experts, top-k, hidden, width
          "olmoe": (64, 8, 2048, 1024)}
DECODE_TOKENS = 64  # up to here a row reports bandwidth
# Calls cycle through this many routings, so that successive calls read different experts (as
# successive layers of a model do) instead of finding the last call's experts in the cache.
ROUTINGS = 8


def route(tokens: int, num: int, top_k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.empty(tokens, top_k, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    _C.ops.topk_softmax(weights, ids, torch.randn(tokens, num, device=device), True)
    return weights, ids


class Cycle:
    """fn(weights, ids) over the routings in turn, one per call."""

    def __init__(self, routes, fn):
        self.routes, self.fn, self.calls = routes, fn, 0

    def __call__(self):
        self.calls += 1
        return self.fn(*self.routes[self.calls % len(self.routes)])


def device_line(device: str) -> tuple[str, float]:
    """What runs the benchmark, and its memory bandwidth in bytes/s."""
    if device == "cpu":
        bandwidth = read_bandwidth()
        return (f"{cpu_line()}\nthreads {octavo.get_num_threads()} (torch {torch.get_num_threads()}), cpu isa "
                f"{octavo.cpu_isa()}; read bandwidth {bandwidth / 1e9:.1f} GB/s"), bandwidth
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, far past the L2
    dst = torch.empty_like(src)
    copy = best_seconds([lambda: dst.copy_(src)], 10, "cuda")[0]
    bandwidth = 2 * src.numel() / copy
    return (f"{torch.cuda.get_device_name()}; host {cpu_line()}\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s "
            f"(read + write)"), bandwidth


def best_seconds(fns, repeats: int, device: str = "cpu") -> list[float]:
    """Best time of each of fns over `repeats` rounds, the fns taken in turn each round (on CUDA,
    to the end of its work on the device)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()  # warm: page faults, thread start, workspaces
    sync()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            sync()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def stack_args(w: torch.Tensor, fmt: str, prefix: str) -> tuple[dict, int]:
    """The op's arguments for the [E, N, K] stack in `fmt` (on w's device), and its bytes per expert."""
    if fmt == "dense":
        return {prefix: w}, w[0].numel() * w.element_size()
    e, n, k = w.shape
    q = quantize(w.reshape(e * n, k), fmt)
    stacked = {prefix: q.qweight.view(e, n, -1), f"{prefix}_format": q.weight_format, f"{prefix}_group_size": q.group_size,
               f"{prefix}_scales": q.scales.view(e, n, *q.scales.shape[1:])}
    if q.zeros is not None:
        stacked[f"{prefix}_zeros"] = q.zeros.view(e, n, *q.zeros.shape[1:])
    per_expert = sum(t.numel() * t.element_size() for t in (q.qweight, q.scales, q.zeros) if t is not None) // e
    return stacked, per_expert


def time_align(tokens: int, num: int, top_k: int, block: int, device: str, repeats: int) -> float:
    """Seconds of one moe_align of `tokens` random routings over `num` experts."""
    _, ids = route(tokens, num, top_k, device)
    pairs = ids.numel()
    capacity = pairs + num * (block - 1)
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block, dtype=torch.int32, device=device)
    padded = torch.empty(1, dtype=torch.int32, device=device)
    return best_seconds([lambda: _C.ops.moe_align(ids, num, block, sorted_ids, expert_ids, padded)], repeats, device)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 512, 2048, 4096])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--formats", nargs="+", default=["dense", "int8", "int4"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--align-tokens", type=int, nargs="*", default=[],
                        help="first time moe_align alone at these token counts (each shape's experts, block 64)")
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), args.device
    line, bandwidth = device_line(device)
    print(f"{line}\ntorch {torch.__version__}, activations {args.dtype}")
    for name in args.shapes if args.align_tokens else []:
        num, top_k = SHAPES[name][:2]
        for tokens in args.align_tokens:
            seconds = time_align(tokens, num, top_k, 64, device, args.repeats)
            print(f"moe_align {name}: {tokens} tokens, {tokens * top_k} pairs: {seconds * 1e6:.1f} us", flush=True)
    print(f"{'shape':>8} {'format':>6} {'T':>5} {'octavo ms':>10} {'torch ms':>9} {'speedup':>7} {'active GB/s':>11} "
          f"{'of bw':>6}")
    for name in args.shapes:
        num, top_k, hidden, width = SHAPES[name]
        torch.manual_seed(0)
        w13 = (torch.randn(num, 2 * width, hidden, device=device) / hidden**0.5).to(dtype)
        w2 = (torch.randn(num, hidden, width, device=device) / width**0.5).to(dtype)
        for fmt in args.formats:
            a, a_bytes = stack_args(w13, fmt, "w13")
            b, b_bytes = stack_args(w2, fmt, "w2")
            for tokens in args.tokens:
                x = torch.randn(tokens, hidden).to(dtype).to(device)
                routes = [route(tokens, num, top_k, device) for _ in range(ROUTINGS)]
                out = torch.empty_like(x)
                ours = Cycle(routes, lambda w, i: _C.ops.fused_moe(out, x, topk_weights=w, topk_ids=i, **a, **b))
                loop = Cycle(routes, lambda w, i: fused_moe_torch(x, w13, w2, w, i, num))
                repeats = args.repeats if tokens <= 512 else max(1, args.repeats // 3)
                mine, theirs = best_seconds([ours, loop], repeats, device)
                active = min(ids.unique().numel() for _, ids in routes) * (a_bytes + b_bytes)
                gbs = f"{active / mine / 1e9:11.1f} {active / mine / bandwidth:6.2f}" if tokens <= DECODE_TOKENS else ""
                print(f"{name:>8} {fmt:>6} {tokens:5d} {mine * 1e3:10.2f} {theirs * 1e3:9.2f} "
                      f"{theirs / mine:7.2f} {gbs}", flush=True)


if __name__ == "__main__":
    main()
