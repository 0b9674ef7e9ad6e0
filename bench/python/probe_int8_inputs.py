"""`linear` on the formats whose CPU kernels take bfloat16 inputs as they are (int8 on bfloat16 tiles,
and the int8-activation formats w4a8 and w8a8) against torch's bfloat16 GEMM, on Mixtral's and
OLMoE's projection shapes by row count.

    python bench/python/probe_int8_inputs.py

One weight per shape, best of 7 calls: the weight stays in the last-level cache between calls
where it fits, so these are cache-warm figures (bench_moe.py measures experts that do not fit).
"""
import time

import octavo  # noqa: I001  (before torch: OMP_WAIT_POLICY)
import torch
from bench_moe import cpu_line
from octavo.layers.linear import linear
from octavo.layers.quantize import quantize

SHAPES = ((14336, 4096), (4096, 14336), (1536, 2048))  # [N, K]
ROWS = (1, 16, 64, 512, 2048)
METHODS = ("int8", "w4a8", "w8a8")


def best_ms(fn, repeats: int = 7) -> float:
    fn()  # warm: page faults, thread start, scratch buffers
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    print(f"{cpu_line()}\nthreads {octavo.get_num_threads()}, cpu isa {octavo.cpu_isa()}; torch {torch.__version__}")
    print(f"{'N x K':>12} {'rows':>5} " + " ".join(f"{m + ' ms':>10}" for m in METHODS) + f" {'torch ms':>9}")
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        weights = [quantize(w, m) for m in METHODS]
        dense = w.bfloat16()
        for rows in ROWS:
            if n * k > 1 << 25 and rows > 512:  # the large shapes' prefill figures stop at 512 rows
                continue
            x = torch.randn(rows, k).bfloat16()
            times = [best_ms(lambda: linear(x, q)) for q in weights]
            baseline = best_ms(lambda: torch.nn.functional.linear(x, dense))
            print(f"{n:>6}x{k:<5} {rows:>5} " + " ".join(f"{t:>10.2f}" for t in times) + f" {baseline:>9.2f}")


if __name__ == "__main__":
    main()
