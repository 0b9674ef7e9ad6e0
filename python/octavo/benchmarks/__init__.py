"""Benchmarks shipped with the package, so `octavo bench ...` runs them on any install; the scripts
in bench/python are thin wrappers. Results go to bench/RESULTS.md."""


def add_multiprocess_argument(parser) -> None:
    """--multiprocess: the engine core in a process of its own, as `octavo serve` runs it."""
    parser.add_argument("--multiprocess", action="store_true",
                        help="run the engine core in a process of its own (LLM(multiprocess=True)), as the server does")
