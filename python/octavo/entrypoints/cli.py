"""The ``octavo`` command line.

Each subcommand is one ``add_<name>(subparsers)`` function that registers its parser and sets
``func`` (taking the parsed namespace, returning an exit code); adding a subcommand means writing
one such function and listing it in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import sys

from .device_arg import add_device_argument


def _convert_gguf(args: argparse.Namespace) -> int:
    # Imported here so `octavo --help` stays fast and works without torch/transformers loaded.
    from octavo.default_model import convert_gguf

    print(convert_gguf(args.src, args.dst))
    return 0


def add_convert_gguf(subparsers) -> None:
    p = subparsers.add_parser(
        "convert-gguf",
        help="dequantize a GGUF file into a Hugging Face checkpoint directory",
        description="Dequantize a GGUF file into a Hugging Face checkpoint directory "
        "(config.json, model.safetensors, tokenizer files) and print its path.",
    )
    p.add_argument("src", help="the .gguf file")
    p.add_argument("dst", help="the directory to create (must not exist or be empty)")
    p.set_defaults(func=_convert_gguf)


def _generate(args: argparse.Namespace) -> int:
    from octavo import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory_bytes, device=args.device)
    tokenizer = llm.get_tokenizer()
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer.encode(args.prompt)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    engine = llm.llm_engine
    engine.add_request("cli", list(ids), params, prompt=args.prompt)
    shown = 0
    while engine.has_unfinished_requests():  # stream: print each step's new text as it comes
        for output in engine.step():
            text = output.outputs[0].text
            print(text[shown:], end="", flush=True)
            shown = len(text)
    print()
    return 0


def add_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt, streamed to the terminal",
                              description="Generate text from a prompt and stream it to the terminal.")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    add_device_argument(p)
    p.set_defaults(func=_generate)


def _bench(args: argparse.Namespace) -> int:
    from octavo.benchmarks import latency, serving, throughput

    {"latency": latency, "throughput": throughput, "serve": serving}[args.benchmark].run(args)
    return 0


def add_bench(subparsers) -> None:
    from octavo.benchmarks import latency, serving, throughput  # light: they import torch/octavo lazily

    p = subparsers.add_parser("bench", help="run a benchmark (results to compare with bench/RESULTS.md)",
                              description="Run one of Octavo's benchmarks.")
    benchmarks = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module in (("throughput", throughput), ("latency", latency), ("serve", serving)):
        b = benchmarks.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(b)
    p.set_defaults(func=_bench)


def _quantize(args: argparse.Namespace) -> int:
    from octavo.loader.quantized_checkpoint import write_quantized_checkpoint

    print(write_quantized_checkpoint(args.src, args.dst, args.method))
    return 0


def add_quantize(subparsers) -> None:
    p = subparsers.add_parser("quantize", help="write an int8 / int4 / q4_1 / w4a8 / w8a8 copy of a float checkpoint",
                              description="Quantize a Hugging Face checkpoint's projections (round to nearest; "
                              "the LM head in int8) and write a checkpoint that LLM(DST) loads as it is.")
    p.add_argument("src", help="the float checkpoint directory")
    p.add_argument("dst", help="the directory to create (must not exist or be empty)")
    p.add_argument("--method", "-q", required=True, choices=["int8", "int4", "q4_1", "w4a8", "w8a8", "fp8"])
    p.set_defaults(func=_quantize)


def _serve(args: argparse.Namespace) -> int:
    from octavo.entrypoints.openai import api_server

    api_server.run(args)
    return 0


def add_serve(subparsers) -> None:
    from octavo.entrypoints.openai import cli_args

    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve a model over an OpenAI-compatible HTTP API (vllm serve's routes "
                              "and options).")
    cli_args.add_arguments(p)
    p.set_defaults(func=_serve)


SUBCOMMANDS = [add_convert_gguf, add_generate, add_bench, add_serve, add_quantize]


def build_parser() -> argparse.ArgumentParser:
    """The ``octavo`` parser with every subcommand in ``SUBCOMMANDS`` registered."""
    parser = argparse.ArgumentParser(prog="octavo", description="Octavo LLM inference engine.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``octavo`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    Expected failures (bad files, missing packages) print one ``octavo: error:`` line, exit code 1.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"octavo {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
