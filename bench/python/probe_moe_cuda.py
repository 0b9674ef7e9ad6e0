"""Where `fused_moe`'s time goes on a GPU: each call timed eagerly (to its end on the device, as
bench_moe.py times it, host launches included) and replayed from a CUDA graph (as the engine's
decode steps run it: device time alone), and the graph's kernels one by one (torch.profiler), with
the expert passes' weight bytes per second against the device's read bandwidth.

    python bench/python/probe_moe_cuda.py [--shapes mixtral qwen3] [--formats dense int4]
                                          [--tokens 1 4 16 64 512 2048]

Weights and routings as bench_moe.py makes them; the torch loop (eager, dense weights) is the
baseline of the speedup column.
"""
import argparse
import re
from collections import defaultdict

import octavo  # noqa: F401  (before torch: OMP_WAIT_POLICY)
import torch
from bench_moe import ROUTINGS, SHAPES, best_seconds, cpu_line, route, stack_args
from octavo import _C
from octavo.layers.moe import fused_moe_torch


def read_bandwidth() -> float:
    """Bytes/s of a sum over 2 GiB of bfloat16 (reads only)."""
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")
    return x.numel() * x.element_size() / best_seconds([lambda: x.sum()], 10, "cuda")[0]


def graph_of(calls) -> torch.cuda.CUDAGraph:
    """One graph replaying every call. Octavo's ops launch on the stream set_cuda_stream names, so
    the capture names its own (as worker/cuda_graphs.py does), and the default one after."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _C.set_cuda_stream(torch.cuda.current_stream().cuda_stream)
        for call in calls:
            call()
    _C.set_cuda_stream(torch.cuda.current_stream().cuda_stream)
    return graph


def kernel_times(graph: torch.cuda.CUDAGraph, calls: int) -> dict[str, float]:
    """Microseconds per call of each kernel (by short name) over one replay of the graph."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = re.split(r"[<(]", event.name.replace("(anonymous namespace)::", ""))[0].split("::")[-1]
            times[name] += event.device_time / calls
    return dict(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["mixtral", "qwen3"], choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=["dense", "int4"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 512, 2048])
    args = parser.parse_args()
    bandwidth = read_bandwidth()
    print(f"{torch.cuda.get_device_name()}; host {cpu_line()}; torch {torch.__version__}\n"
          f"read bandwidth (bf16 sum of 2 GiB) {bandwidth / 1e9:.0f} GB/s")
    for name in args.shapes:
        num, top_k, hidden, width = SHAPES[name]
        torch.manual_seed(0)
        w13 = (torch.randn(num, 2 * width, hidden, device="cuda") / hidden**0.5).bfloat16()
        w2 = (torch.randn(num, hidden, width, device="cuda") / width**0.5).bfloat16()
        for fmt in args.formats:
            a, a_bytes = stack_args(w13, fmt, "w13")
            b, b_bytes = stack_args(w2, fmt, "w2")
            for tokens in args.tokens:
                x = torch.randn(tokens, hidden, device="cuda").bfloat16()
                routes = [route(tokens, num, top_k, "cuda") for _ in range(ROUTINGS)]
                out = torch.empty_like(x)
                calls = [lambda w=w, i=i: _C.ops.fused_moe(out, x, topk_weights=w, topk_ids=i, **a, **b) for w, i in routes]
                loops = [lambda w=w, i=i: fused_moe_torch(x, w13, w2, w, i, num) for w, i in routes]
                eager, loop = best_seconds([calls[0], loops[0]], 5, "cuda")
                graph = graph_of(calls)
                replay = best_seconds([graph.replay], 5, "cuda")[0] / len(calls)
                kernels = kernel_times(graph, len(calls))
                active = sum(ids.unique().numel() for _, ids in routes) / len(routes) * (a_bytes + b_bytes)
                passes = max(sum(t for k, t in kernels.items() if k.startswith("expert_")) * 1e-6, 1e-9)
                print(f"{name} {fmt} T={tokens}: eager {eager * 1e3:.3f} ms, graph {replay * 1e3:.3f} ms, "
                      f"torch loop {loop * 1e3:.3f} ms (x{loop / replay:.2f} graph, x{loop / eager:.2f} eager); "
                      f"expert passes {active / passes / bandwidth:.2f} of read bw, whole graph call "
                      f"{active / replay / bandwidth:.2f}", flush=True)
                print("    " + ", ".join(f"{k} {t:.1f}us" for k, t in sorted(kernels.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
