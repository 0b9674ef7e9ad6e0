"""Offline throughput of LLM.generate against transformers' ``generate`` on the same model,
prompts and dtype (issue #4's workload).

Requests: prompt lengths uniform in [32, 512], output lengths uniform in [32, 256] (or fixed
with --input-len / --output-len: issue #7's 512 / 256), random token ids, ignore_eos, sampling
with a fixed seed per request. --dummy-shape llama-3-8b benchmarks that shape with random
weights (no files needed; transformers then builds the same shape with its own random init).
Octavo runs all of them in one ``generate`` call. transformers runs, at each batch size b in --baseline-batch, the first
max(b, 16) of the same requests (it is slow; the rates are what is compared), left-padded, each
batch generating up to its longest requested output; only the requested tokens count as output.
Reported: output tok/s, total (prompt + output) tok/s, and the ratio to transformers' best.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ..entrypoints.device_arg import add_device_argument
from . import add_multiprocess_argument
from .shapes import SHAPES

BASELINE_MIN_REQUESTS = 16
# torch is imported inside the functions that use it, so that building the `octavo` CLI parser
# (which reads add_arguments below) stays fast.


def workload(num: int, vocab: int, seed: int = 0, input_len: int | None = None,
             output_len: int | None = None) -> list[tuple[list[int], int]]:
    """num (prompt token ids, output length) pairs; lengths uniform unless fixed."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.full(num, input_len) if input_len else rng.integers(32, 513, num)
    output_lens = np.full(num, output_len) if output_len else rng.integers(32, 257, num)
    return [(rng.integers(100, vocab - 100, int(p)).tolist(), int(o)) for p, o in zip(prompt_lens, output_lens)]


def rates(requests, seconds: float) -> tuple[float, float]:
    """-> (output tok/s, total tok/s)."""
    output = sum(o for _, o in requests)
    return output / seconds, (output + sum(len(p) for p, _ in requests)) / seconds


def run_octavo(llm, requests) -> float:
    from octavo import SamplingParams

    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=o, ignore_eos=True)
              for i, (_, o) in enumerate(requests)]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params, use_tqdm=True)
    seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [o for _, o in requests]
    return seconds


def run_transformers(model, requests, batch: int, pad_id: int) -> float:
    import torch

    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(requests), batch):
        chunk = requests[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(chunk):  # left padding, as decoder-only generation needs
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        new = max(o for _, o in chunk)
        with torch.no_grad():
            model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new,
                           min_new_tokens=new, do_sample=True, pad_token_id=pad_id)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def baseline_model(model_path, dtype, device, dummy_shape: str | None):
    """transformers' model of the same checkpoint, dtype and device (for a dummy shape: the same
    config with transformers' random init, built on the device)."""
    import torch
    import transformers

    if not dummy_shape:
        return transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device)
    config = transformers.AutoConfig.from_pretrained(str(model_path))
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def release_device_memory(device) -> None:
    """Frees what dropped objects held on ``device`` (their cycles included)."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> dict:
    import torch

    from octavo import LLM
    from octavo.device import resolve_device

    device = resolve_device(args.device)
    # The CPU default of issue #4's runs; on a GPU the engine sizes the cache from its memory.
    kv_bytes = args.kv_cache_memory_bytes or (4 << 30 if device.type == "cpu" else None)
    from .shapes import model_arguments

    llm = LLM(dtype=args.dtype, kv_cache_memory_bytes=kv_bytes, max_model_len=1024, max_num_seqs=args.max_num_seqs,
              device=device, multiprocess=args.multiprocess, quantization=args.quantization,
              **model_arguments(args.model, args.dummy_shape))
    engine = llm.llm_engine
    requests = workload(args.num_requests, engine.model_config.vocab_size, input_len=args.input_len,
                        output_len=args.output_len)
    dtype = engine.info.model_dtype
    seconds = run_octavo(llm, requests)
    ours = rates(requests, seconds)
    quantized = f", {args.quantization} weights" if args.quantization else ""
    print(f"octavo ({dtype}{quantized}): {len(requests)} requests, "
          f"{sum(len(p) for p, _ in requests)} prompt + {sum(o for _, o in requests)} output tokens in "
          f"{seconds:.1f} s: {ours[0]:.1f} output tok/s, {ours[1]:.1f} total tok/s")
    result = {"octavo_seconds": seconds, "octavo_output_tok_s": ours[0], "octavo_total_tok_s": ours[1]}
    if not args.baseline_batch:
        return result

    tokenizer, model_path = llm.get_tokenizer(), engine.model_path
    # Octavo's engine goes first: on a GPU its KV cache took most of the memory the baseline needs.
    del llm, engine
    release_device_memory(device)
    model = baseline_model(model_path, getattr(torch, dtype), device, args.dummy_shape).eval()
    pad = 0 if tokenizer is None else tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
        tokenizer.eos_token_id
    best = (0.0, 0.0, 0)
    for batch in args.baseline_batch:
        subset = requests[:max(batch, BASELINE_MIN_REQUESTS)]
        theirs = rates(subset, run_transformers(model, subset, batch, pad))
        print(f"transformers batch {batch} ({len(subset)} requests): {theirs[0]:.1f} output tok/s, "
              f"{theirs[1]:.1f} total tok/s", flush=True)
        result[f"transformers_batch_{batch}"] = theirs
        best = max(best, (*theirs, batch))
    result["ratio_output"] = ours[0] / best[0]
    result["ratio_total"] = ours[1] / best[1]
    print(f"octavo / transformers at its best batch size ({best[2]}): {result['ratio_output']:.2f}x output tok/s, "
          f"{result['ratio_total']:.2f}x total tok/s")
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the default model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "q4_1", "w4a8", "w8a8", "fp8", "gguf_a8"],
                   help="quantize Octavo's projections at load time (transformers keeps --dtype)")
    add_device_argument(p)
    p.add_argument("--dummy-shape", default=None, choices=list(SHAPES),
                   help="benchmark this model shape with random weights instead of --model")
    p.add_argument("--input-len", type=int, default=None, help="fixed prompt length (default: uniform 32-512)")
    p.add_argument("--output-len", type=int, default=None, help="fixed output length (default: uniform 32-256)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="default: 4 GiB on the CPU, sized from free memory on a GPU")
    p.add_argument("--baseline-batch", type=int, nargs="*", default=[1, 8, 32, 64],
                   help="transformers batch sizes to try (none: skip the baseline)")
    add_multiprocess_argument(p)
