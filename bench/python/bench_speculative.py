"""Speculative decoding on the default model, by prompt lookup (ngram), by a draft model (the
default model's own weights quantized at load, --drafts int4 int8) and by EAGLE heads (--eagle
eagle3:DIR; a bare method makes a random head, whose drafts never pay: what its catch-up after
every step costs when the cost rule has stopped drafting): single-stream decode tok/s
with and without it, on prompts whose answer copies from the prompt (repeat a passage, edit
code) and on plain chat prompts; and offline throughput with concurrent requests.

    python bench/python/bench_speculative.py [--k 2 3 4 5] [--drafts int4] [--draft-k 3] [--eagle eagle3]
        [--repeats 3]

Every request is greedy, so the runs with and without speculation generate the same tokens
(asserted); tok/s = generated tokens / wall time of generate(). Runs alternate, best of
--repeats each.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from octavo import LLM, SamplingParams
from octavo.default_model import default_model_path

from machine import cpu_line

PASSAGE = ("The old lighthouse stood at the edge of the cliff for more than a century. Every night its keeper "
           "climbed the spiral stairs, trimmed the wick and wound the clockwork that turned the great lens, so that "
           "ships passing in the dark could find their way around the rocks and into the harbour.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def average_price(items):
    if not items:
        return 0
    return sum(item.price for item in items) / len(items)
'''
COPYING = [f"Repeat the following text exactly, word for word.\n\n{PASSAGE}",
           f"Rename the variable `subtotal` to `net` in this code and show the whole code.\n\n{CODE}",
           f"Correct the spelling in this text and return all of it:\n\n{PASSAGE.replace('the', 'teh')}"]
CHAT = ["Why is the sky blue? Answer in a paragraph.", "Give me three tips for learning a new language.",
        "Write a short story about a cat who wants to be a sailor."]


def messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def generate(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outs = llm.chat([messages(p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(len(t) for t in tokens) / elapsed, tokens


def best_of(llms: dict[str, LLM], prompts: list[str], max_tokens: int, repeats: int) -> dict[str, float]:
    """tok/s of each engine on these prompts (one after the other when single), best of repeats."""
    best = dict.fromkeys(llms, 0.0)
    expected = None
    for _ in range(repeats):
        for name, llm in llms.items():
            rate, tokens = generate(llm, prompts, max_tokens)
            expected = expected or tokens
            assert tokens == expected, f"{name} generated other tokens"
            best[name] = max(best[name], rate)
    return best


def acceptance(llm: LLM, before) -> str:
    after = llm.llm_engine.stats.spec_decoding
    tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    drafts = after.num_drafts - before.num_drafts
    return f"acceptance {accepted / max(tokens, 1):.2f}, mean accepted length {1 + accepted / max(drafts, 1):.2f}"


def random_head(method: str, directory: Path) -> str:
    """A random one-layer EAGLE head of the default model's shape, in EAGLE's layout."""
    from octavo.config import ModelConfig
    from octavo.loader import load_model
    from octavo.models.llama_eagle import EagleHead

    target = load_model(default_model_path(), "float32")
    hf = {**target.config.hf, "architectures": ["LlamaForCausalLMEagle3" if method == "eagle3" else
                                                "EagleLlamaForCausalLM"], "num_hidden_layers": 1}
    head = EagleHead(ModelConfig.from_dict(hf), torch.float32, target, method == "eagle3")
    tensors = {name: (torch.randn(rows, *dest.shape[1:]) * 0.02 if dest.dtype.is_floating_point else
                      torch.zeros(rows, dtype=dest.dtype))
               for name, (dest, _, rows) in head.weight_targets().items()}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, nargs="*", default=[2, 4, 6], help="ngram's num_speculative_tokens values")
    ap.add_argument("--drafts", nargs="*", default=[], choices=["int4", "q4_1", "int8", "w4a8", "w8a8", "none"],
                    help="draft models to run: the default model quantized so ('none': as it is)")
    ap.add_argument("--draft-k", type=int, default=3, help="the draft models' and heads' num_speculative_tokens")
    ap.add_argument("--eagle", nargs="*", default=[], help="EAGLE heads, METHOD:DIR (eagle or eagle3); a bare "
                    "METHOD makes a random head")
    ap.add_argument("--lookup-min", type=int, default=1, help="prompt_lookup_min")
    ap.add_argument("--lookup-max", type=int, default=3, help="prompt_lookup_max")
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[64], help="concurrent requests of the throughput runs")
    ap.add_argument("--skip-single", action="store_true", help="only the throughput runs")
    args = ap.parse_args()
    print(cpu_line())
    common = dict(max_model_len=1024, kv_cache_memory_bytes=1 << 30)
    llms = {"off": LLM(**common)}
    for k in args.k:
        config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.lookup_min,
                  "prompt_lookup_max": args.lookup_max, "disable_by_batch_size": args.disable_by_batch_size}
        llms[f"k={k}"] = LLM(speculative_config=config, **common)
    for quantization in args.drafts:
        config = {"method": "draft_model", "model": str(default_model_path()), "num_speculative_tokens": args.draft_k,
                  "quantization": None if quantization == "none" else quantization,
                  "disable_by_batch_size": args.disable_by_batch_size}
        llms[f"{quantization} draft k={args.draft_k}"] = LLM(speculative_config=config, **common)
    scratch = Path(tempfile.mkdtemp(prefix="octavo-eagle-"))
    for spec in args.eagle:
        method, _, directory = spec.partition(":")
        config = {"method": method, "model": directory or random_head(method, scratch / method),
                  "num_speculative_tokens": args.draft_k, "disable_by_batch_size": args.disable_by_batch_size}
        llms[f"{method}{'' if directory else ' (random)'} k={args.draft_k}"] = LLM(speculative_config=config, **common)
    print(f"single stream, greedy, {args.max_tokens} tokens at most, best of {args.repeats}")
    for workload, prompts in () if args.skip_single else (("copying", COPYING), ("chat", CHAT)):
        for prompt in prompts:
            before = {name: llm.llm_engine.stats.spec_decoding for name, llm in llms.items()}
            rates = best_of(llms, [prompt], args.max_tokens, args.repeats)
            cells = [f"off {rates['off']:.1f} tok/s"] + [
                f"{name} {rates[name]:.1f} ({rates[name] / rates['off']:.2f}x; {acceptance(llms[name], before[name])})"
                for name in llms if name != "off"]
            print(f"  {workload}: {prompt[:40]!r}...: " + " | ".join(cells))
    for batch in args.batches:
        for workload, texts in (("chat", CHAT), ("copying", COPYING)):
            prompts = [texts[i % len(texts)] + f" (request {i})" for i in range(batch)]
            rates = best_of(llms, prompts, args.max_tokens, args.repeats)
            print(f"throughput, {batch} concurrent {workload} requests: " + " | ".join(
                f"{name} {rate:.1f} tok/s ({rate / rates['off']:.2f}x)" for name, rate in rates.items()))


if __name__ == "__main__":
    main()
