"""Octavo's elementwise kernels against the eager torch code Hugging Face models run.

Each op runs on the same data with the same thread count (torch.set_num_threads follows
octavo._C.get_num_threads()); times are medians of repeated calls after warm-up, taken through
the Python bindings, so they include the per-call cost a model pays. GB/s counts the bytes
Octavo's kernel reads and writes once each.

    python bench/python/bench_elementwise.py [--tokens 1 64 2048] [--hidden 4096 576] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from octavo import _C

EPS = 1e-6
# hidden size -> (query heads, KV heads, head size, MLP intermediate size):
# Llama-3-8B and SmolLM2-135M.
MODELS = {4096: (32, 8, 128, 14336), 576: (9, 3, 64, 1536)}


def median_us(fn, min_seconds: float = 0.2, max_calls: int = 2000) -> float:
    """Median wall time of fn() in microseconds, after warm-up."""
    # Let the other library's idle workers stop spinning first: on a machine with few cores
    # they would otherwise take cores from the threads being timed.
    time.sleep(0.05)
    for _ in range(3):
        fn()
    times = []
    deadline = time.perf_counter() + min_seconds
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < max_calls):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


# ----------------------------------------------------------------------------- torch baselines (as HF)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward. x: [T, hidden]; weight: [hidden]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def torch_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    residual = x + residual
    return torch_rms_norm(residual, weight), residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def torch_rope(positions, q, k, cos_table, sin_table, head_size):
    """apply_rotary_pos_emb with cos/sin gathered by position. q: [T, H*D]; k: [T, Hkv*D];
    cos_table, sin_table: [max_position, D] in the activation dtype."""
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]
    q, k = q.view(q.shape[0], -1, head_size), k.view(k.shape[0], -1, head_size)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# ----------------------------------------------------------------------------- cases


def case_rms_norm(tokens, hidden, dtype):
    x, w = torch.randn(tokens, hidden, dtype=dtype), torch.rand(hidden, dtype=dtype) + 0.5
    out = torch.empty_like(x)
    _C.ops.rms_norm(out, x, w, EPS)
    torch.testing.assert_close(out, torch_rms_norm(x, w), rtol=2e-2, atol=2e-2)
    nbytes = 2 * x.nbytes + w.nbytes
    return f"{tokens}x{hidden}", lambda: _C.ops.rms_norm(out, x, w, EPS), lambda: torch_rms_norm(x, w), nbytes


def case_fused_add_rms_norm(tokens, hidden, dtype):
    x, w = torch.randn(tokens, hidden, dtype=dtype), torch.rand(hidden, dtype=dtype) + 0.5
    residual = torch.randn(tokens, hidden, dtype=dtype)
    expected, expected_residual = torch_fused_add_rms_norm(x, residual, w)
    _C.ops.fused_add_rms_norm(x, residual, w, EPS)
    torch.testing.assert_close(x, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(residual, expected_residual)
    nbytes = 4 * x.nbytes + w.nbytes
    return (f"{tokens}x{hidden}", lambda: _C.ops.fused_add_rms_norm(x, residual, w, EPS),
            lambda: torch_fused_add_rms_norm(x, residual, w), nbytes)


def case_rotary_embedding(tokens, hidden, dtype):
    heads, kv_heads, head_size, _ = MODELS[hidden]
    max_position = 4096
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).float()  # Octavo's [max_position, D]
    cos_table = torch.cat([angles, angles], dim=-1).cos().to(dtype)  # HF's [max_position, D]
    sin_table = torch.cat([angles, angles], dim=-1).sin().to(dtype)
    positions = torch.randint(0, max_position, (tokens,))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, dtype=dtype)
    q, k = qkv[:, : heads * head_size], qkv[:, heads * head_size : (heads + kv_heads) * head_size]
    q_ref, k_ref = torch_rope(positions, q, k, cos_table, sin_table, head_size)
    _C.ops.rotary_embedding(positions, q, k, head_size, cache, True)
    torch.testing.assert_close(q.view_as(q_ref), q_ref, rtol=2e-2, atol=2e-2)
    nbytes = 2 * (q.nbytes + k.nbytes) + positions.nbytes + tokens * head_size * 4
    return (f"{tokens}x{heads}+{kv_heads}x{head_size}",
            lambda: _C.ops.rotary_embedding(positions, q, k, head_size, cache, True),
            lambda: torch_rope(positions, q, k, cos_table, sin_table, head_size), nbytes)


def case_silu_and_mul(tokens, hidden, dtype):
    d = MODELS[hidden][3]
    x = torch.randn(tokens, 2 * d, dtype=dtype)
    out = torch.empty(tokens, d, dtype=dtype)
    _C.ops.silu_and_mul(out, x)
    torch.testing.assert_close(out, torch_silu_and_mul(x), rtol=2e-2, atol=2e-2)
    return f"{tokens}x2*{d}", lambda: _C.ops.silu_and_mul(out, x), lambda: torch_silu_and_mul(x), x.nbytes + out.nbytes


CASES = {
    "rms_norm": case_rms_norm,
    "fused_add_rms_norm": case_fused_add_rms_norm,
    "rotary_embedding": case_rotary_embedding,
    "silu_and_mul": case_silu_and_mul,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 2048])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 576], choices=sorted(MODELS))
    parser.add_argument("--ops", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--threads", type=int, help="threads for both libraries (default: Octavo's default)")
    return parser.parse_args()


def print_setup() -> None:
    threads = _C.get_num_threads()
    print(f"octavo ISA {_C.cpu_isa()}, {threads} threads; torch {torch.__version__}, {torch.get_num_threads()} threads")
    tiny_in, tiny_out = torch.zeros(1, 2), torch.zeros(1, 1)
    floor_us = median_us(lambda: _C.ops.silu_and_mul(tiny_out, tiny_in))
    print(f"per-call floor of the bindings (silu_and_mul on one element): {floor_us:.1f} us")


def run_case(op: str, tokens: int, hidden: int, dtype_name: str) -> float:
    """Times one case, prints its row and returns torch time / octavo time."""
    shape, octavo_fn, torch_fn, nbytes = CASES[op](tokens, hidden, DTYPES[dtype_name])
    octavo_us, torch_us = median_us(octavo_fn), median_us(torch_fn)
    print(f"{op:<20} {shape:<18} {dtype_name:<9} {octavo_us:>10.1f} {torch_us:>10.1f} "
          f"{torch_us / octavo_us:>6.2f}x {nbytes / octavo_us / 1e3:>7.1f}")
    return torch_us / octavo_us


def main():
    args = parse_args()
    torch.manual_seed(0)
    if args.threads:
        _C.set_num_threads(args.threads)
    torch.set_num_threads(_C.get_num_threads())
    print_setup()
    header = f"{'op':<20} {'shape':<18} {'dtype':<9} {'octavo us':>10} {'torch us':>10} {'ratio':>7} {'GB/s':>7}"
    print(header)
    print("-" * len(header))
    ratios = [
        run_case(op, tokens, hidden, dtype_name)
        for op in args.ops
        for dtype_name in DTYPES
        for hidden in args.hidden
        for tokens in args.tokens
    ]
    print(f"geometric mean ratio {statistics.geometric_mean(ratios):.2f}x, min {min(ratios):.2f}x")


if __name__ == "__main__":
    main()
