"""bfloat16 `linear` on dense weights against the same weights packed into AMX tiles
("bf16_tiles", octavo/layers/bf16_tiles.py), as a decode step meets them: every projection of
every layer and the LM head in turn, with the caches flushed between sweeps by writing a buffer as
large as the L3, so that each sweep reads its weights from DRAM as an engine step does.

    python bench/python/bench_bf16_tiles.py [--shape smollm2-135m] [--rows 1 4 8 16 32 64] [--repeats 4]

Per row count: the best sweep of --repeats, dense and packed taken in turn (this VM's speed drifts
over minutes), in ms and weight GB/s (weight bytes / time). Random weights of the model's shapes.
"""

from __future__ import annotations

import argparse
import time

import octavo  # noqa: F401  (before torch: OMP_WAIT_POLICY)
import torch
from octavo import _C
from octavo.layers import bf16_tiles

from bench_cpu_peers import machine

# (layers, [(N, K) of each projection], LM head (N, K))
SHAPES = {"smollm2-135m": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576))}


def model_weights(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers, per_layer, head = SHAPES[name]
    out = []
    for shape in [s for _ in range(layers) for s in per_layer] + [head]:
        w = torch.randn(shape).bfloat16()
        out.append((w, bf16_tiles.pack(w).qweight))
    return out


def sweep(weights, xs: dict, outs: dict, packed: bool) -> float:
    start = time.perf_counter()
    for w, q in weights:
        n, k = w.shape
        if packed:
            _C.ops.linear(outs[n], xs[k], q, None, bf16_tiles.FORMAT)
        else:
            _C.ops.linear(outs[n], xs[k], w, None)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--flush-mib", type=int, default=320, help="bytes written between sweeps (≥ the L3)")
    args = parser.parse_args()
    print(f"{machine()}; kernel level {_C.cpu_isa()}, threads {_C.get_num_threads()}")
    torch.manual_seed(0)
    weights = model_weights(args.shape)
    nbytes = sum(w.numel() * 2 for w, _ in weights)
    flush = torch.empty(args.flush_mib << 20, dtype=torch.uint8)
    print(f"{args.shape}: {len(weights)} weights, {nbytes / 1e6:.0f} MB; best of {args.repeats} sweeps")
    for m in args.rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in {w.shape[1] for w, _ in weights}}
        outs = {n: torch.empty(m, n, dtype=torch.bfloat16) for n in {w.shape[0] for w, _ in weights}}
        best = {False: float("inf"), True: float("inf")}
        for r in range(args.repeats):
            for packed in (False, True):
                flush.fill_(r)
                best[packed] = min(best[packed], sweep(weights, xs, outs, packed))
        dense, tiles = best[False], best[True]
        print(f"M={m:4d}  dense {dense * 1e3:7.1f} ms ({nbytes / dense / 1e9:5.1f} GB/s)  "
              f"bf16_tiles {tiles * 1e3:7.1f} ms ({nbytes / tiles / 1e9:5.1f} GB/s)  dense/tiles {dense / tiles:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
