"""Octavo's CUDA kernels against the device's own limits (needs a GPU).

First the device: copy bandwidth (a large device-to-device copy, bytes read + written per second)
and bfloat16 matmul TFLOP/s (torch / cuBLAS, 8192^3). Then each kernel on large inputs, as a
fraction of them:
- rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding, reshape_and_cache: bytes each
  kernel must read and write, per second, against the copy bandwidth (goal >= 0.8);
- decode attention (one query token per sequence, batch >= 16, context >= 2k, GQA 4:1 and
  8:1, head size 128): KV bytes read per second against the copy bandwidth (goal >= 0.7);
- prefill attention (whole causal prompts): TFLOP/s against torch's
  scaled_dot_product_attention (flash backend) on the same data made contiguous (goal >= 1.0x);
- mixed batches (decodes of long contexts, then a prompt chunk, as a chunked prefill's step),
  in one kernel and with the decodes counted (num_decodes: they run in the decode kernels), against
  the same decodes and chunk run apart (goal: decodes counted <= 1.1x apart);
- linear at M = 1 on Llama-3-8B's projections, every weight format: weight bytes read per second
  against the copy bandwidth (dense also against torch's cuBLAS; quantized formats also on tensor
  cores, linear's tensor_cores=True); dense from M = 1 to 16 against
  cuBLAS with weights beyond L2, in the benchmark's dtype and float32 (where
  CUDA_DENSE_KERNEL_MAX_ROWS should sit); then,
  for int4 and Q4_0, the kernel and the tensor-core kernel against torch's GEMM on dequantized
  weights (layers/linear.py's other path) as M grows, which is where CUDA_KERNEL_MAX_ROWS and
  CUDA_TENSOR_CORE_MAX_ROWS should sit (goal of the tensor-core kernel, issue #29: M <= 16 within
  1.3x its M = 1 time);
- fp8 weights W8A8 (layers.linear.fp8_gemm: rows rounded to E4M3, torch._scaled_mm on FP8 tensor
  cores) from M = 16 to 8192 against cuBLAS bfloat16 on the same shapes and the weight-only path
  (dequantize + cuBLAS), which is where CUDA_FP8_GEMM_FROM_ROWS should sit (goal: >= 1.6x
  bfloat16 at M >= 512). bfloat16 only.

    python bench/python/bench_cuda.py [--dtype bfloat16] [--quick]

Times are CUDA-event medians over repeated launches after warm-up (short kernels in runs of
back-to-back launches, so that the host's launch cost stays out).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F
from octavo import _C


def _run_ms(fn, runs: int) -> float:
    """Device time of `runs` back-to-back fn() between one pair of events, in ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def cuda_ms(fn, repeats: int = 20) -> float:
    """Median device time of one fn() in ms. Short calls are timed in runs of back-to-back launches
    between one pair of events (about 200 us of work a run), so that the host's launch cost, which
    would leave the GPU idle between two events around a single short kernel, is not counted."""
    for _ in range(3):
        fn()
    runs = 1
    while runs < 64 and _run_ms(fn, runs) < 0.2:
        runs *= 2
    return statistics.median(_run_ms(fn, runs) / runs for _ in range(repeats))


def device_limits(dtype) -> tuple[float, float]:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, 20x the H100's L2
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / (cuda_ms(lambda: dst.copy_(src)) / 1e3)
    a = torch.randn(8192, 8192, dtype=dtype, device="cuda")
    flops = 2 * 8192 ** 3 / (cuda_ms(lambda: a @ a) / 1e3)
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {copy / 1e9:.0f} GB/s (read + write), "
          f"{dtype} matmul {flops / 1e12:.0f} TFLOP/s")
    return copy, flops


def elementwise(dtype, copy_bw: float, tokens: int) -> None:
    hidden, heads, kv_heads, d, inter = 4096, 32, 8, 128, 14336  # Llama-3-8B
    size = torch.empty((), dtype=dtype).element_size()
    x = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
    w = torch.rand(hidden, dtype=dtype, device="cuda") + 0.5
    out, residual = torch.empty_like(x), torch.randn_like(x)
    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device="cuda")
    act = torch.empty(tokens, inter, dtype=dtype, device="cuda")
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype, device="cuda")
    q, k = qkv[:, :heads * d], qkv[:, heads * d:(heads + kv_heads) * d]
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    angles = torch.outer(torch.arange(8192, device="cuda").float(), inv_freq)
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    blocks = tokens // 16 + 1
    key_cache = torch.empty(blocks, kv_heads, 16, d, dtype=dtype, device="cuda")
    value_cache = torch.empty_like(key_cache)
    kv = qkv[:, heads * d:].view(tokens, 2, kv_heads, d)
    slots = torch.randperm(blocks * 16, device="cuda")[:tokens]
    cases = [
        ("rms_norm", lambda: _C.ops.rms_norm(out, x, w, 1e-5), 2 * x.numel() * size),
        ("fused_add_rms_norm", lambda: _C.ops.fused_add_rms_norm(x, residual, w, 1e-5), 4 * x.numel() * size),
        ("silu_and_mul", lambda: _C.ops.silu_and_mul(act, gate_up), (gate_up.numel() + act.numel()) * size),
        ("gelu_and_mul", lambda: _C.ops.gelu_and_mul(act, gate_up, "tanh"), (gate_up.numel() + act.numel()) * size),
        ("rotary_embedding", lambda: _C.ops.rotary_embedding(positions, q, k, d, cos_sin, True),
         2 * (q.numel() + k.numel()) * size),
        ("reshape_and_cache", lambda: _C.ops.reshape_and_cache(kv[:, 0], kv[:, 1], key_cache, value_cache, slots),
         4 * kv_heads * d * tokens * size),
    ]
    _C.set_cuda_stream(torch.cuda.current_stream().cuda_stream)
    for name, fn, nbytes in cases:
        ms = cuda_ms(fn)
        bw = nbytes / (ms / 1e3)
        print(f"  {name:>20} {tokens:6d} tokens: {ms * 1e3:8.1f} us {bw / 1e9:7.0f} GB/s = {bw / copy_bw:.2f} of copy")


def paged_batch(batch: int, context: int, heads: int, kv_heads: int, d: int, query_len: int, dtype):
    block = 16
    per_seq = math.ceil(context / block)
    key_cache = torch.randn(batch * per_seq + 1, kv_heads, block, d, dtype=dtype, device="cuda")
    value_cache = torch.randn_like(key_cache)
    tables = (torch.randperm(batch * per_seq, device="cuda") + 1).view(batch, per_seq).int()
    query = torch.randn(batch * query_len, heads, d, dtype=dtype, device="cuda")
    query_start_loc = torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return query, key_cache, value_cache, query_start_loc, seq_lens, tables


def decode_attention(dtype, copy_bw: float, quick: bool) -> None:
    """Both decode kernels on each shape: the tensor-core one (what GQA groups of 4 and more get)
    and the split-KV one on CUDA cores, reached through a query whose rows are not 16-byte
    aligned (the tensor-core kernel reads them in 16-byte packs; the split-KV kernel does not);
    then the tensor-core one over an fp8 cache (kv_cache_dtype="fp8": half the bytes)."""
    d, heads = 128, 32
    size = torch.empty((), dtype=dtype).element_size()
    for kv_heads in (8, 4):
        for batch in ((16, 64) if quick else (16, 32, 64, 128)):
            for context in ((2048, 8192) if quick else (2048, 4096, 8192)):
                query, kc, vc, qsl, lens, tables = paged_batch(batch, context, heads, kv_heads, d, 1, dtype)
                unaligned = torch.empty(batch, heads * d + 1, dtype=dtype, device="cuda")[:, 1:].view(batch, heads, d)
                unaligned.copy_(query)
                nbytes = 2 * batch * context * kv_heads * d * size
                fp8 = (kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn))
                for kernel, q, caches in (("tensor cores", query, (kc, vc)), ("split-KV", unaligned, (kc, vc)),
                                          ("fp8 cache", query, fp8)):
                    out = torch.empty_like(query)
                    ms = cuda_ms(lambda: _C.ops.paged_attention(out, q, *caches, qsl, lens, tables, d ** -0.5))
                    bw = nbytes * caches[0].element_size() / size / (ms / 1e3)
                    print(f"  decode GQA {heads // kv_heads}:1 batch {batch:3d} context {context:5d} {kernel:>12}: "
                          f"{ms * 1e3:8.1f} us {bw / 1e9:6.0f} GB/s = {bw / copy_bw:.2f} of copy")


def prefill_attention(dtype, matmul_flops: float, quick: bool) -> None:
    d, heads, kv_heads = 128, 32, 8
    for batch, length in ((4, 1024), (2, 4096)) if quick else ((8, 512), (4, 1024), (2, 2048), (1, 4096)):
        query, kc, vc, qsl, lens, tables = paged_batch(batch, length, heads, kv_heads, d, length, dtype)
        out = torch.empty_like(query)
        ms = cuda_ms(lambda: _C.ops.paged_attention(out, query, kc, vc, qsl, lens, tables, d ** -0.5), repeats=5)
        # The same data made contiguous for SDPA: [batch, heads, length, d].
        k = kc[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, d)[:, :, :length]
        v = vc[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, d)[:, :, :length]
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        q = query.view(batch, length, heads, d).transpose(1, 2)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            sdpa = cuda_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats=5)
        kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)  # kv_cache_dtype="fp8"
        fp8 = cuda_ms(lambda: _C.ops.paged_attention(out, query, kc8, vc8, qsl, lens, tables, d ** -0.5), repeats=2)
        flops = 4 * batch * heads * d * length * length / 2  # causal: half the score matrix
        ours = flops / (ms / 1e3)
        print(f"  prefill batch {batch} x {length:5d}: octavo {ours / 1e12:6.1f} TFLOP/s "
              f"= {ours / matmul_flops:.2f} of matmul, SDPA flash {flops / (sdpa / 1e3) / 1e12:6.1f} TFLOP/s: "
              f"{sdpa / ms:.2f}x; over an fp8 cache {flops / (fp8 / 1e3) / 1e12:6.1f} TFLOP/s")


def random_weight(fmt: str, n: int, k: int, dtype):
    """A weight in `fmt` with random quants and small scales, made on the GPU."""
    from octavo.layers.linear import QuantizedWeight

    if fmt == "dense":
        return torch.randn(n, k, dtype=dtype, device="cuda") * 0.02
    if fmt in ("int8", "int4"):
        groups = 1 if fmt == "int8" else k // 128
        data = torch.randint(0, 256, (n, k if fmt == "int8" else k // 2), dtype=torch.uint8, device="cuda")
        scales = torch.rand(n, groups, device="cuda") * 0.01
        zeros = torch.randint(0, 16, (n, groups), dtype=torch.uint8, device="cuda") if fmt == "int4" else None
        return QuantizedWeight(data.view(torch.int8) if fmt == "int8" else data, fmt, k,
                               scales=scales.view(n) if fmt == "int8" else scales, zeros=zeros,
                               group_size=0 if fmt == "int8" else 128)
    if fmt == "fp8":  # codes of magnitude below 0x78 (no NaN), one scale per row
        data = torch.randint(0, 0x78, (n, k), dtype=torch.uint8, device="cuda")
        return QuantizedWeight(data.view(torch.float8_e4m3fn), fmt, k, scales=torch.rand(n, 1, device="cuda") * 0.01,
                               group_size=k)
    block = _C.ops.weight_block_bytes(fmt)
    data = torch.randint(0, 256, (n, k // 32, block), dtype=torch.uint8, device="cuda")
    halves = 2 if fmt == "q4_1" else 1
    data[:, :, :2 * halves] = (torch.rand(n, k // 32, halves, device="cuda") * 0.01).half().view(torch.uint8)
    return QuantizedWeight(data.view(n, -1), fmt, k)


def weight_bytes(weight) -> int:
    tensors = [weight] if isinstance(weight, torch.Tensor) else [weight.qweight, weight.scales, weight.zeros]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def varied_batch(seqs: list[tuple[int, int]], heads: int, kv_heads: int, d: int, dtype):
    """paged_attention's arguments for sequences of (query tokens, context) each."""
    block = 16
    widths = [math.ceil(context / block) for _, context in seqs]
    key_cache = torch.randn(sum(widths) + 1, kv_heads, block, d, dtype=dtype, device="cuda")
    tables = torch.zeros(len(seqs), max(widths), dtype=torch.int32)
    ids = (torch.randperm(sum(widths)) + 1).int()
    for i, width in enumerate(widths):
        tables[i, :width], ids = ids[:width], ids[width:]
    starts = torch.tensor([0] + [q for q, _ in seqs], dtype=torch.int32).cumsum(0).int()
    query = torch.randn(int(starts[-1]), heads, d, dtype=dtype, device="cuda")
    lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    return query, key_cache, torch.randn_like(key_cache), starts.cuda(), lens.cuda(), tables.cuda()


def mixed_attention(dtype, quick: bool) -> None:
    """A chunked prefill's step: decodes of long contexts, then one prompt chunk. In one kernel
    (the prefill kernel's, one block per decode and KV head, no split) and with the decodes
    counted (num_decodes: the decode kernels, with their splits, then the prefill kernel on the
    chunk), against the decodes and the chunk run apart."""
    d, heads, kv_heads = 128, 32, 8
    for chunk in (512, 2048):
        for decodes in ((4, 32) if quick else (1, 4, 16, 64)):
            for context in ((8192, 32768) if quick else (2048, 8192, 32768)):
                times = {}
                for name, seqs, counted in (("one kernel", [(1, context)] * decodes + [(chunk, chunk)], 0),
                                            ("counted", [(1, context)] * decodes + [(chunk, chunk)], decodes),
                                            ("chunk", [(chunk, chunk)], 0), ("decodes", [(1, context)] * decodes, 0)):
                    query, kc, vc, qsl, lens, tables = varied_batch(seqs, heads, kv_heads, d, dtype)
                    out = torch.empty_like(query)
                    times[name] = cuda_ms(lambda: _C.ops.paged_attention(out, query, kc, vc, qsl, lens, tables,
                                                                         d ** -0.5, num_decodes=counted), repeats=10)
                apart = times["chunk"] + times["decodes"]
                print(f"  mixed {decodes:2d} decodes at {context:5d} + chunk {chunk:4d}: apart "
                      f"{times['decodes'] * 1e3:.1f} + {times['chunk'] * 1e3:.1f} = {apart * 1e3:8.1f} us; "
                      f"one kernel {times['one kernel'] * 1e3:8.1f} us ({times['one kernel'] / apart:.2f}x); "
                      f"decodes counted {times['counted'] * 1e3:8.1f} us ({times['counted'] / apart:.2f}x)")


def dense_crossover(dtype, quick: bool) -> None:
    """Dense linear from M = 1 up: Octavo's kernel against cuBLAS on Llama-3-8B's projections. Each
    launch takes the next of enough weight copies to pass 256 MiB, so that no launch finds its
    weight in L2 (a model's layers never do)."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    size = torch.empty((), dtype=dtype).element_size()
    for name, (n, k) in shapes.items():
        copies = (256 << 20) // (n * k * size) + 2
        weights = [torch.randn(n, k, dtype=dtype, device="cuda") * 0.02 for _ in range(copies)]
        cells = []
        for m in ((1, 2, 4, 8) if quick else (1, 2, 3, 4, 6, 8, 12, 16)):
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            out = torch.empty(m, n, dtype=dtype, device="cuda")
            turn = iter(range(1 << 30))
            ours = cuda_ms(lambda: _C.ops.linear(out, x, weights[next(turn) % copies], None), repeats=40)
            cublas = cuda_ms(lambda: F.linear(x, weights[next(turn) % copies]), repeats=40)
            cells.append(f"M={m} {ours * 1e3:.1f}/{cublas * 1e3:.1f}")
        print(f"  dense {str(dtype).removeprefix('torch.')} {name:>7} kernel/cuBLAS us: {', '.join(cells)}")


def linear_weights(dtype, copy_bw: float, quick: bool) -> None:
    from octavo.layers import linear as layer

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    x = torch.randn(1, 14336, dtype=dtype, device="cuda")
    for fmt in ("dense", "int8", "fp8", "int4", "q8_0", "q4_0", "q4_1"):
        for name, (n, k) in shapes.items():
            w = random_weight(fmt, n, k, dtype)
            args = {} if fmt == "dense" else w.kernel_args()
            data = w if fmt == "dense" else w.qweight
            out = torch.empty(1, n, dtype=dtype, device="cuda")
            ms = cuda_ms(lambda: _C.ops.linear(out, x[:, :k], data, None, **args), repeats=50)
            bw = weight_bytes(w) / (ms / 1e3)
            line = f"  linear M=1 {fmt:>5} {name:>7} {n}x{k}: {ms * 1e3:7.1f} us {bw / 1e9:6.0f} GB/s = " \
                   f"{bw / copy_bw:.2f} of copy"
            if fmt == "dense":
                line += f"; cuBLAS {cuda_ms(lambda: F.linear(x[:, :k], w), repeats=50) * 1e3:7.1f} us"
            else:
                mma = cuda_ms(lambda: _C.ops.linear(out, x[:, :k], data, None, **args, tensor_cores=True), repeats=50)
                line += f"; tensor cores {mma * 1e3:7.1f} us = {weight_bytes(w) / (mma / 1e3) / copy_bw:.2f} of copy"
            print(line)
    n, k = shapes["gate_up"]
    for fmt in ("int4", "q4_0"):
        w = random_weight(fmt, n, k, dtype)
        for m in ((1, 16, 32) if quick else (1, 2, 4, 8, 16, 24, 32, 64, 128)):
            xm = torch.randn(m, k, dtype=dtype, device="cuda")
            out = torch.empty(m, n, dtype=dtype, device="cuda")
            kernel = cuda_ms(lambda: _C.ops.linear(out, xm, w.qweight, None, **w.kernel_args()), repeats=20)
            mma = cuda_ms(lambda: _C.ops.linear(out, xm, w.qweight, None, **w.kernel_args(), tensor_cores=True),
                          repeats=20)
            gemm = cuda_ms(lambda: layer._gemm_on_dequantized(xm, w, None), repeats=20)
            print(f"  linear {fmt} gate_up M={m:3d}: kernel {kernel * 1e3:7.1f} us, tensor cores {mma * 1e3:7.1f} us, "
                  f"dequantize + cuBLAS {gemm * 1e3:7.1f} us (CUDA_KERNEL_MAX_ROWS = {layer.CUDA_KERNEL_MAX_ROWS}, "
                  f"CUDA_TENSOR_CORE_MAX_ROWS = {layer.CUDA_TENSOR_CORE_MAX_ROWS})")


def fp8_gemm_rows(quick: bool) -> None:
    """W8A8 on Llama-3-8B's projections as M grows: fp8_gemm whole (the rows' rounding included)
    and its _scaled_mm alone, against bfloat16 cuBLAS and the weight-only fp8 path."""
    from octavo.layers import linear as layer

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for name, (n, k) in shapes.items():
        w = random_weight("fp8", n, k, torch.bfloat16)
        dense = w.dequantize(torch.bfloat16)
        for m in ((512, 4096) if quick else (16, 64, 256, 512, 1024, 2048, 4096, 8192)):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            q, scale = x.to(torch.float8_e4m3fn), torch.ones(m, 1, device="cuda")
            w8a8 = cuda_ms(lambda: layer.fp8_gemm(x, w, None), repeats=10)
            mm = cuda_ms(lambda: torch._scaled_mm(q, w.qweight.t(), scale_a=scale, scale_b=w.scales.reshape(1, -1),
                                                  out_dtype=torch.bfloat16), repeats=10)
            bf16 = cuda_ms(lambda: F.linear(x, dense), repeats=10)
            weight_only = cuda_ms(lambda: layer._gemm_on_dequantized(x, w, None), repeats=10)
            tflops = 2 * m * n * k / 1e12
            print(f"  fp8 W8A8 {name:>7} M={m:5d}: fp8_gemm {w8a8 * 1e3:8.1f} us "
                  f"({tflops / (w8a8 / 1e3):5.0f} TFLOP/s, {bf16 / w8a8:.2f}x bf16), "
                  f"_scaled_mm {mm * 1e3:8.1f} us ({bf16 / mm:.2f}x), cuBLAS bf16 {bf16 * 1e3:8.1f} us, "
                  f"weight-only {weight_only * 1e3:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    copy_bw, matmul_flops = device_limits(dtype)
    for tokens in (4096, 16384):
        elementwise(dtype, copy_bw, tokens)
    decode_attention(dtype, copy_bw, args.quick)
    prefill_attention(dtype, matmul_flops, args.quick)
    mixed_attention(dtype, args.quick)
    for dense_dtype in (dtype, torch.float32):
        dense_crossover(dense_dtype, args.quick)
    linear_weights(dtype, copy_bw, args.quick)
    fp8_gemm_rows(args.quick)


if __name__ == "__main__":
    main()
