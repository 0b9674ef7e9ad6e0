"""Single-request latency: time to first token and decode tok/s for a 128-token prompt, against
the memory-bandwidth roofline (weight bytes per token ÷ measured read bandwidth)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ..entrypoints.device_arg import add_device_argument
from . import add_multiprocess_argument
from .shapes import SHAPES


def time_one_request(engine, prompt: list[int], max_tokens: int, request_id: str) -> tuple[float, list[float]]:
    """-> (time to first token, the times at which each later token arrived), in seconds."""
    from octavo import SamplingParams

    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        # In-process a step brings one token (several with speculative decoding); from a core
        # in its own process, as many as it made since the last call (none or several).
        for output in engine.step():
            now = time.perf_counter()
            stamps += [now] * (len(output.outputs[0].token_ids) - len(stamps))
    return stamps[0] - start, stamps


def run(args: argparse.Namespace) -> dict:
    from octavo import LLM

    from .memory import decode_weight_bytes, read_bandwidth  # torch: imported only when run

    from .shapes import model_arguments

    llm = LLM(dtype=args.dtype, kv_cache_memory_bytes=256 << 20, max_model_len=1024, quantization=args.quantization,
              device=args.device, multiprocess=args.multiprocess, speculative_config=args.speculative_config,
              **model_arguments(args.model, args.dummy_shape))
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab - 100, args.prompt_len).tolist() for _ in range(args.repeats + 1)]
    time_one_request(engine, prompts[0], 8, "warmup")  # first-call costs (allocations, page faults)
    spec_before = engine.stats.spec_decoding
    ttfts, rates = [], []
    device = engine.device
    nbytes = 4 << 30 if device.type == "cuda" else 1 << 29
    bandwidths = [read_bandwidth(nbytes, device=device)]
    for i, prompt in enumerate(prompts[1:]):  # distinct prompts: no prefix-cache hits
        ttft, stamps = time_one_request(engine, prompt, args.max_tokens, f"r{i}")
        ttfts.append(ttft)
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        bandwidths.append(read_bandwidth(nbytes, device=device))
    weight_bytes = engine.apply_model(decode_weight_bytes)[0]
    bandwidth = statistics.mean(bandwidths)
    roofline = bandwidth / weight_bytes
    result = {"dtype": engine.info.model_dtype, "ttft_ms": 1e3 * statistics.median(ttfts),
              "decode_tok_s": statistics.median(rates), "weight_mb": weight_bytes / 1e6,
              "read_gb_s": bandwidth / 1e9, "read_gb_s_range": (min(bandwidths) / 1e9, max(bandwidths) / 1e9),
              "roofline_tok_s": roofline}
    result["of_roofline"] = result["decode_tok_s"] / roofline
    if spec_before is not None:
        result.update(acceptance(spec_before, engine.stats.spec_decoding))
    where = f"{device}, engine core in its own process" if args.multiprocess else f"{device}"
    print(f"latency on {where}, {args.prompt_len}-token prompt, {args.max_tokens} new tokens, {result['dtype']}, "
          f"median of {args.repeats}")
    print(f"  time to first token {result['ttft_ms']:.1f} ms; decode {result['decode_tok_s']:.1f} tok/s "
          f"(runs: {', '.join(f'{r:.1f}' for r in rates)})")
    print(f"  weights read per token {result['weight_mb']:.0f} MB; read bandwidth {result['read_gb_s']:.1f} GB/s "
          f"(measured {len(bandwidths)}x: {result['read_gb_s_range'][0]:.1f}-{result['read_gb_s_range'][1]:.1f})")
    print(f"  roofline {roofline:.1f} tok/s; decode reaches {result['of_roofline']:.2f} of it")
    if spec_before is not None:
        print(f"  speculative decoding: {result['num_draft_tokens']} draft tokens, acceptance rate "
              f"{result['acceptance_rate']:.2f}, mean accepted length {result['mean_accepted_length']:.2f}")
    return result


def acceptance(before, after) -> dict:
    """Speculative decoding between two SpecDecodingCounts: the drafts' acceptance rate (accepted
    / draft tokens) and the mean accepted length (tokens per verifying step: 1 + accepted /
    drafts), as vLLM reports them."""
    drafts = after.num_drafts - before.num_drafts
    tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {"num_draft_tokens": tokens, "acceptance_rate": accepted / tokens if tokens else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the default model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "q4_1", "w4a8", "w8a8", "fp8", "gguf_a8"],
                   help="quantize the projections at load time (round to nearest)")
    add_device_argument(p)
    p.add_argument("--dummy-shape", default=None, choices=list(SHAPES),
                   help="benchmark this model shape with random weights instead of --model")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}: reports the acceptance too')
    add_multiprocess_argument(p)
