"""Offline throughput against transformers; the same as `octavo bench throughput` (see
octavo/benchmarks/throughput.py for the workload).

    python bench/python/bench_throughput.py [--model DIR] [--dtype D] [--num-requests 256]
"""
import argparse

from octavo.benchmarks import throughput

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=throughput.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    throughput.add_arguments(parser)
    throughput.run(parser.parse_args())
