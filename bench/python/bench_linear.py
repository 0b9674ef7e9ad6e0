"""Octavo's `linear` kernel against torch's F.linear at the default model's projection shapes.

    python bench/python/bench_linear.py [--rows 1 4 16 32 64 512] [--dtypes float32 bfloat16 float16]
                                        [--formats q8_0 q4_0 q4_1 int8 int4 q4_k q6_k q4_k+a8 ...]
    python bench/python/bench_linear.py --levels avx512_bf16 amx [--repeats 15] [--rows ...] [--dtypes ...]

--levels compares Octavo's kernel levels (octavo.cpu_isa() names) and torch on the dense dtypes:
the best of --repeats calls of each, taken in turn (level 1, level 2, ..., torch, level 1, ...),
so that a machine whose speed drifts between minutes still gives comparable columns.

Per shape (N x K weight), row count M and dtype: microseconds per call and weight GB/s (weight
bytes ÷ time). The small matrices stay in the L3 cache when one is called in a loop, so their
GB/s can exceed DRAM bandwidth; the 49152x576 LM head does not fit and shows DRAM speed. The
crossover in octavo/layers/linear.py comes from this table.

Quantized formats (float32 activations): GGUF blocks as the gguf package writes them, and
Octavo's int8 / int4 (load-time round to nearest); GB/s counts the stored bytes (scales and
zero points included), and torch's column is F.linear on the float32 weights they stand for. The machine's read
bandwidth (torch sum over 512 MiB) is measured first, for the fraction the issue asks. A GGUF
format with "+a8" (q4_k+a8) multiplies the same blocks by int8-rounded inputs (quantization
"gguf_a8").
"""
import argparse
import time

import octavo  # noqa: F401  (before torch: OMP_WAIT_POLICY)
import torch
from octavo import _C
from octavo.benchmarks.memory import read_bandwidth
from octavo.layers.linear import QuantizedWeight
from octavo.layers.quantize import METHODS, quantize

SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, gate_up, down, LM head


def seconds_per_call(fn, min_seconds: float = 0.2) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 512])
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--formats", nargs="*", default=["q8_0", "q4_0", "q4_1", "int8", "int4"])
    parser.add_argument("--shapes", nargs="*", default=[f"{n}x{k}" for n, k in SHAPES],
                        help="N x K weight shapes (default: the default model's; Llama-3-8B's down projection "
                             "is 4096x14336)")
    parser.add_argument("--levels", nargs="*", default=None, help="kernel levels to compare, alternating")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    if args.levels:
        return levels_table(args, shapes)
    print(f"threads {octavo.get_num_threads()} (torch {torch.get_num_threads()}), cpu isa {octavo.cpu_isa()}, "
          f"torch {torch.__version__}; read bandwidth {read_bandwidth() / 1e9:.1f} GB/s")
    print(f"{'weights':>9} {'N x K':>11} {'M':>4} {'octavo us':>10} {'GB/s':>6} {'torch us':>9} {'GB/s':>6} {'speedup':>7}")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for n, k in shapes:
            w = torch.randn(n, k).to(dtype)
            rows(name, w, w, args.rows, lambda out, x: _C.ops.linear(out, x, w, None))
    for fmt in args.formats:
        for n, k in shapes:
            qw = quantized(torch.randn(n, k), fmt.removesuffix("+a8"))
            qw.int8_inputs = fmt.endswith("+a8")
            rows(fmt, qw, qw.dequantize(), args.rows, lambda out, x: _C.ops.linear(out, x, qw.qweight, None,
                                                                                   **qw.kernel_args()))


def levels_table(args, shapes) -> None:
    previous = _C.cpu_isa()
    try:
        levels_rows(args, shapes)
    finally:
        _C.set_cpu_isa(previous)


def levels_rows(args, shapes) -> None:
    print(f"threads {octavo.get_num_threads()}, torch {torch.__version__}; best of {args.repeats} alternating calls, "
          f"us: {', '.join(args.levels)}, torch")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for n, k in shapes:
            w = torch.randn(n, k).to(dtype)
            for m in args.rows:
                x, out = torch.randn(m, k).to(dtype), torch.empty(m, n, dtype=dtype)
                calls = [(level, lambda: _C.ops.linear(out, x, w, None)) for level in args.levels]
                calls.append(("torch", lambda: torch.nn.functional.linear(x, w)))
                best = dict.fromkeys([c for c, _ in calls], float("inf"))
                for _ in range(args.repeats):
                    for level, fn in calls:
                        if level != "torch":
                            _C.set_cpu_isa(level)
                        start = time.perf_counter()
                        fn()
                        best[level] = min(best[level], time.perf_counter() - start)
                cells = " ".join(f"{best[c] * 1e6:10.1f}" for c, _ in calls)
                print(f"{name:>9} {f'{n}x{k}':>11} {m:5d} {cells}", flush=True)


def quantized(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """w in fmt: Octavo's quantizer, else the gguf package's, else (the K-quants and IQ4_NL, which
    the package only dequantizes) random blocks with float16 scales of about w's size."""
    if fmt in METHODS:
        return quantize(w, fmt)
    import gguf  # only for the GGUF rows
    import numpy as np

    try:
        blocks = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, fmt.upper()))
    except NotImplementedError:
        weights, size = _C.ops.weight_block_weights(fmt), _C.ops.weight_block_bytes(fmt)
        rng = np.random.default_rng(0)
        blocks = rng.integers(0, 256, (w.numel() // weights, size), dtype=np.uint8)
        half = np.array([1e-3], dtype=np.float16).view(np.uint8)
        for at in range(0, size - 1, 2):  # every aligned pair a small float16: never inf or NaN
            blocks[:, at:at + 2] = half
        blocks = blocks.reshape(w.shape[0], -1)
    return QuantizedWeight(torch.from_numpy(blocks), fmt, w.shape[1])


def rows(name: str, stored, dense: torch.Tensor, row_counts, ours_fn) -> None:
    """One line per M: Octavo on the stored weight, torch on its dense (dequantized) form."""
    n, k = dense.shape
    tensors = [stored] if isinstance(stored, torch.Tensor) else list(stored.buffers())
    gb = sum(t.numel() * t.element_size() for t in tensors) / 1e9
    for m in row_counts:
        x, out = torch.randn(m, k).to(dense.dtype), torch.empty(m, n, dtype=dense.dtype)
        ours = seconds_per_call(lambda: ours_fn(out, x))
        theirs = seconds_per_call(lambda: torch.nn.functional.linear(x, dense))
        print(f"{name:>9} {f'{n}x{k}':>11} {m:4d} {ours * 1e6:10.1f} {gb / ours:6.1f} {theirs * 1e6:9.1f} "
              f"{gb / theirs:6.1f} {theirs / ours:7.2f}", flush=True)


if __name__ == "__main__":
    main()
