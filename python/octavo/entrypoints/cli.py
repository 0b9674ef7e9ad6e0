"""The ``octavo`` command line.

Each subcommand is one ``add_<name>(subparsers)`` function that registers its parser and sets
``func`` (taking the parsed namespace, returning an exit code); adding a subcommand means writing
one such function and listing it in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import sys


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


SUBCOMMANDS = [add_convert_gguf]


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
