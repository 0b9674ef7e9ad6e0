"""paged_attention on the CPU: decode against the machine's memory bandwidth, prefill against
torch's scaled_dot_product_attention on the same data laid out contiguously.

    python bench/python/bench_attention.py [--quick]
    python bench/python/bench_attention.py --levels avx512_bf16 amx [--repeats 9]
    python bench/python/bench_attention.py --cache-dtypes [--repeats 9]

Decode reads every cached key and value once, so its speed is bytes of KV read per second,
reported as a fraction of the bandwidth of a large copy measured in the same run (at its start,
and again right after each row, since this machine's bandwidth drifts). Prefill is
compute-bound: GFLOP/s of the causal attention (2 * 2 * T^2 / 2 * D * H flops) for both.

--levels compares Octavo's kernel levels (octavo.cpu_isa() names) on bfloat16 prefill of whole
prompts at the default model's attention shape (9 query / 3 KV heads, head size 64) and at
Llama-3-8B's (32 / 8, 128): the best of --repeats calls of each level, taken in turn.

--cache-dtypes compares decode of float32 queries over caches of each kv_cache_dtype (float32,
bfloat16, float16, fp8): what a 16-bit or fp8 cache saves a float32 model's attention.
"""
import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from octavo import _C
from octavo.kv_cache import empty_kv_cache

HEAD_SIZE = 128
BLOCK_SIZE = 16


def median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """GB/s of a 512 MiB copy: bytes read + bytes written per second."""
    src = torch.ones(128 * 2**20)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats=10)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def paged_cache(num_seqs: int, context: int, num_kv_heads: int, dtype, head_size: int = HEAD_SIZE):
    blocks = math.ceil(context / BLOCK_SIZE)
    shape = (num_seqs * blocks + 1, num_kv_heads, BLOCK_SIZE, head_size)
    key_cache, value_cache = empty_kv_cache(shape, dtype), empty_kv_cache(shape, dtype)  # as the engine does
    key_cache.copy_(torch.randn(shape))
    value_cache.copy_(torch.randn(shape))
    # Shuffled block ids: a real pool hands blocks out in no particular order.
    tables = (torch.randperm(num_seqs * blocks) + 1).to(torch.int32).view(num_seqs, blocks)
    return key_cache, value_cache, tables


def attention_inputs(num_seqs: int, context: int, num_heads: int, num_kv_heads: int, dtype,
                     head_size: int = HEAD_SIZE, prefill: bool = False, cache_dtype=None) -> dict:
    """paged_attention's arguments for num_seqs sequences of `context` cached tokens, each querying
    its last token (a decode) or, with prefill, every one of its tokens (a whole prompt). The cache
    holds cache_dtype (default: the query's)."""
    caches = paged_cache(num_seqs, context, num_kv_heads, cache_dtype or dtype, head_size)
    key_cache, value_cache, tables = caches
    new = context if prefill else 1
    query = torch.randn(num_seqs * new, num_heads, head_size).to(dtype)
    return dict(out=torch.empty_like(query), query=query, key_cache=key_cache, value_cache=value_cache,
                query_start_loc=(torch.arange(num_seqs + 1) * new).to(torch.int32),
                seq_lens=torch.full((num_seqs,), context, dtype=torch.int32), block_tables=tables,
                scale=head_size**-0.5)


def bench_decode(num_seqs: int, context: int, num_heads: int, num_kv_heads: int, dtype, repeats: int):
    args = attention_inputs(num_seqs, context, num_heads, num_kv_heads, dtype)
    seconds = median_seconds(lambda: _C.ops.paged_attention(**args), repeats)
    kv_bytes = 2 * num_seqs * context * num_kv_heads * HEAD_SIZE * args["key_cache"].element_size()
    return seconds, kv_bytes / seconds / 1e9


def bench_prefill(tokens: int, num_heads: int, num_kv_heads: int, dtype, repeats: int):
    args = attention_inputs(1, tokens, num_heads, num_kv_heads, dtype, prefill=True)
    ours = median_seconds(lambda: _C.ops.paged_attention(**args), repeats)
    query, key_cache, value_cache, tables = (args[k] for k in ("query", "key_cache", "value_cache", "block_tables"))
    # The same keys and values, gathered into contiguous [1, heads, tokens, head_size] tensors.
    pos = torch.arange(tokens)
    slots = tables[0, pos // BLOCK_SIZE].long()

    def contiguous(cache):
        return cache[slots, :, pos % BLOCK_SIZE].transpose(0, 1).unsqueeze(0).contiguous()

    k, v = contiguous(key_cache), contiguous(value_cache)
    q = query.transpose(0, 1).unsqueeze(0).contiguous()
    theirs = median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), repeats)
    flops = 2 * tokens * tokens * HEAD_SIZE * num_heads  # QK^T and PV over the causal half
    return ours, theirs, flops


def best_per_level(levels: list[str], args: dict, repeats: int) -> dict[str, float]:
    """Seconds of the best of `repeats` paged_attention calls on each level, the levels taken in turn."""
    best = dict.fromkeys(levels, math.inf)
    for _ in range(repeats):
        for level in levels:
            _C.set_cpu_isa(level)
            start = time.perf_counter()
            _C.ops.paged_attention(**args)
            best[level] = min(best[level], time.perf_counter() - start)
    return best


def compare_levels(levels: list[str], repeats: int) -> None:
    print(f"threads {_C.get_num_threads()}; prefill of whole prompts, bfloat16, block {BLOCK_SIZE}; "
          f"best of {repeats} alternating calls, ms (GFLOP/s)")
    previous = _C.cpu_isa()
    for heads, kv_heads, head_size in ((9, 3, 64), (32, 8, 128)):
        for tokens in (64, 256, 1024):
            args = attention_inputs(1, tokens, heads, kv_heads, torch.bfloat16, head_size, prefill=True)
            best = best_per_level(levels, args, repeats)
            flops = 2 * tokens * tokens * head_size * heads
            cells = "  ".join(f"{level} {best[level] * 1e3:8.2f} ({flops / best[level] / 1e9:6.1f})" for level in levels)
            print(f"{heads}:{kv_heads} d{head_size} tokens {tokens:>5}  {cells}", flush=True)
    print(f"decode, bfloat16: best of {repeats} alternating calls, ms (KV GB/s)")
    for num_seqs, context, heads, kv_heads, head_size in ((64, 256, 9, 3, 64), (16, 2048, 32, 8, 128)):
        args = attention_inputs(num_seqs, context, heads, kv_heads, torch.bfloat16, head_size)
        best = best_per_level(levels, args, repeats)
        kv_bytes = 2 * num_seqs * context * kv_heads * head_size * 2
        cells = "  ".join(f"{level} {best[level] * 1e3:8.2f} ({kv_bytes / best[level] / 1e9:6.1f})" for level in levels)
        print(f"{heads}:{kv_heads} d{head_size} batch {num_seqs} context {context}  {cells}", flush=True)
    _C.set_cpu_isa(previous)


def compare_cache_dtypes(repeats: int) -> None:
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    print(f"threads {_C.get_num_threads()}, cpu isa {_C.cpu_isa()}; decode of float32 queries over each cache "
          f"dtype, block {BLOCK_SIZE}: median of {repeats} calls, ms (KV GB/s)")
    for num_seqs, context, heads, kv_heads, head_size in ((1, 2048, 9, 3, 64), (64, 256, 9, 3, 64),
                                                          (64, 1024, 9, 3, 64), (16, 2048, 32, 8, 128)):
        cells = []
        for cache_dtype in dtypes:
            args = attention_inputs(num_seqs, context, heads, kv_heads, torch.float32, head_size,
                                    cache_dtype=cache_dtype)
            seconds = median_seconds(lambda: _C.ops.paged_attention(**args), repeats)
            kv_bytes = 2 * num_seqs * context * kv_heads * head_size * args["key_cache"].element_size()
            name = str(cache_dtype).removeprefix("torch.")
            cells.append(f"{name} {seconds * 1e3:7.2f} ({kv_bytes / seconds / 1e9:5.1f})")
        shape = f"{heads}:{kv_heads} d{head_size} batch {num_seqs:>2} context {context:>4}"
        print(f"{shape}  {'  '.join(cells)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--levels", nargs="+", help="compare these kernel levels on prefill instead")
    parser.add_argument("--cache-dtypes", action="store_true", help="compare KV cache dtypes on decode instead")
    parser.add_argument("--repeats", type=int, default=9, help="with --levels or --cache-dtypes")
    args = parser.parse_args()
    torch.set_num_threads(_C.get_num_threads())
    if args.levels:
        return compare_levels(args.levels, args.repeats)
    if args.cache_dtypes:
        return compare_cache_dtypes(args.repeats)
    repeats = 3 if args.quick else 7
    print(f"threads {_C.get_num_threads()}, cpu isa {_C.cpu_isa()}, torch {torch.__version__}")
    bandwidth = copy_bandwidth()
    print(f"memory bandwidth (512 MiB copy, read + write): {bandwidth:.1f} GB/s\n")

    print("decode, bfloat16 KV, head_size 128, block 16")
    # This machine's bandwidth drifts (other tenants): each row also measures the copy right after
    # its decode, and reports the fraction of both that and the run's first measurement.
    print(f"{'batch':>5} {'context':>7} {'heads':>6} {'us':>9} {'KV GB/s':>8} {'of bw':>6} {'row bw':>7} {'of row':>6}")
    batches = (1, 8) if args.quick else (1, 8, 32)
    contexts = (512, 8192) if args.quick else (512, 2048, 8192)
    for num_seqs in batches:
        for context in contexts:
            for heads in ((24, 8), (32, 8)):
                seconds, gbs = bench_decode(num_seqs, context, *heads, torch.bfloat16, repeats)
                row_bandwidth = copy_bandwidth()
                print(f"{num_seqs:>5} {context:>7} {heads[0]:>3}:{heads[1]:<2} {seconds * 1e6:>9.0f} {gbs:>8.1f} "
                      f"{gbs / bandwidth:>6.2f} {row_bandwidth:>7.1f} {gbs / row_bandwidth:>6.2f}")

    print("\nprefill, one causal sequence, 32 query / 8 KV heads, head_size 128")
    print(f"{'tokens':>6} {'dtype':>9} {'octavo ms':>9} {'sdpa ms':>8} {'octavo GF/s':>11} {'sdpa GF/s':>9} {'ratio':>6}")
    for tokens in (512, 2048):
        for dtype in (torch.float32, torch.bfloat16):
            ours, theirs, flops = bench_prefill(tokens, 32, 8, dtype, max(3, repeats // 2))
            print(f"{tokens:>6} {str(dtype).removeprefix('torch.'):>9} {ours * 1e3:>9.1f} {theirs * 1e3:>8.1f} "
                  f"{flops / ours / 1e9:>11.1f} {flops / theirs / 1e9:>9.1f} {theirs / ours:>6.2f}")


if __name__ == "__main__":
    main()
