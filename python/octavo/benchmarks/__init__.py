"""Benchmarks shipped with the package, so `octavo bench ...` runs them on any install; the scripts
in bench/python are thin wrappers. Results go to bench/RESULTS.md."""
