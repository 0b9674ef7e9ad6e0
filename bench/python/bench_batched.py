"""Offline batched throughput in llama.cpp's batched-bench shape: 64 sequences of 128 random prompt
tokens and 128 generated tokens (greedy, ignore_eos), all submitted at once, prefill included in
the time. Issue #6 compares it with llama.cpp's figures on the same machine (176 tok/s F32, 208
F16, 110 Q4_1).

    python bench/python/bench_batched.py [--model DIR_OR_GGUF] [--dtype D] [--quantization int8|int4]
                                         [--max-num-batched-tokens N]
"""
import argparse
import time

from octavo import LLM, SamplingParams
from octavo.benchmarks.serving import make_prompts
from octavo.engine.core import DEFAULT_MAX_NUM_BATCHED_TOKENS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="step budget (default: the engine's)")
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=1024,
              max_num_batched_tokens=args.max_num_batched_tokens)
    warm_up = make_prompts(2, args.prompt_len, (100, 20000), seed=99)
    llm.generate(warm_up, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    prompts = make_prompts(args.sequences, args.prompt_len, (100, 20000), seed=1)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = generated + args.sequences * args.prompt_len
    budget = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    print(f"{args.model or 'default model'} dtype={args.dtype} quantization={args.quantization} budget={budget}: "
          f"{args.sequences} x ({args.prompt_len} + {args.new_tokens}) tokens in {seconds:.1f} s: "
          f"{generated / seconds:.1f} generated tok/s, {total / seconds:.1f} total tok/s")


if __name__ == "__main__":
    main()
