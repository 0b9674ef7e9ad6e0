"""What structured output costs: decode step time with a JSON schema against the same batch
without one, on the default model, and the grammar compile times (first request, a new schema,
a cache hit).

    python bench/python/bench_structured_output.py [--batches 1 32 128] [--steps 64] [--repeats 3]

Both runs of a batch generate exactly --steps tokens per request: the constrained one follows a
schema that cannot end sooner (an array of at least 100 small objects: brackets, keys, numbers,
enums and strings, so the grammar changes its mask at every token), the plain one ignores EOS.
The two alternate, --repeats times each; the table gives the best of each. Step time = the
generate() call's wall time / steps (prompts are 30 tokens, the same in both).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import octavo
from octavo import LLM, SamplingParams, StructuredOutputsParams
from octavo.default_model import default_model_path
from octavo.structured_output import StructuredOutputManager

from machine import cpu_line

SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                     "name": {"type": "string", "maxLength": 12},
                                     "kind": {"enum": ["alpha", "beta", "gamma"]},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "kind", "ok"]}}


def compile_times(path: Path, vocab_size: int) -> None:
    """Through the engine core's manager: the first compile loads the tokenizer and builds the
    backend's vocabulary tables; later ones compile only the grammar."""
    manager = StructuredOutputManager(str(path), vocab_size)
    other = {**SCHEMA, "minItems": 3}
    for what, schema in (("first request (tokenizer + vocabulary + grammar)", SCHEMA),
                         ("a new schema", other), ("the same schema again (cache hit)", other)):
        start = time.perf_counter()
        manager.compile(StructuredOutputsParams(json=schema)).result()
        print(f"compile, {what}: {(time.perf_counter() - start) * 1e3:.1f} ms")
    manager.shutdown()


def step_ms(llm: LLM, prompts: list[str], params: SamplingParams, steps: int) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == steps for o in outs), "a request ended early"
    return elapsed / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = default_model_path()
    llm = LLM(model=str(path), device="cpu", max_model_len=512, max_num_seqs=max(args.batches),
              kv_cache_memory_bytes=2 << 30)
    print(cpu_line())
    print(f"threads {octavo.get_num_threads()}, cpu isa {octavo.cpu_isa()}; model {path.name}, "
          f"dtype {llm.llm_engine.info.model_dtype}")
    compile_times(path, llm.llm_engine.model_config.vocab_size)
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "List a hundred items as JSON objects."}],
                                           tokenize=False, add_generation_prompt=True)
    plain = SamplingParams(temperature=1.0, seed=0, max_tokens=args.steps, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, seed=0, max_tokens=args.steps,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    print("\n| batch | step, plain (ms) | step, JSON schema (ms) | overhead |")
    print("|---|---|---|---|")
    for batch in args.batches:
        prompts = [prompt] * batch
        step_ms(llm, prompts[:1], constrained, args.steps)  # warm: compiled, allocator sized
        best = {"plain": float("inf"), "schema": float("inf")}
        for _ in range(args.repeats):
            best["plain"] = min(best["plain"], step_ms(llm, prompts, plain, args.steps))
            best["schema"] = min(best["schema"], step_ms(llm, prompts, constrained, args.steps))
        print(f"| {batch} | {best['plain']:.2f} | {best['schema']:.2f} | "
              f"{(best['schema'] / best['plain'] - 1) * 100:+.1f}% |")


if __name__ == "__main__":
    main()
