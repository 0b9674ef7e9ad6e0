"""Single-request latency against the memory-bandwidth roofline; the same as `octavo bench latency`.

    python bench/python/bench_latency.py [--model DIR] [--dtype D]
"""
import argparse

from octavo.benchmarks import latency

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=latency.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    latency.add_arguments(parser)
    latency.run(parser.parse_args())
