"""Online serving benchmark against any OpenAI-compatible server (default: starts octavo serve on
the default model); the same as `octavo bench serve` (see octavo/benchmarks/serving.py).

    python bench/python/serving.py [--url http://host:port] [--request-rate 1 2 4 inf]
"""
import argparse

from octavo.benchmarks import serving

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=serving.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving.add_arguments(parser)
    serving.run(parser.parse_args())
