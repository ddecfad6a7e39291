"""Benchmark suites run by benchmarks/run.py; each module has NAME, ``run(opts) -> [Table]``."""
