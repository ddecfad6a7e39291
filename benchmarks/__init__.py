"""Benchmarks of dispatch-amp against native PyTorch; run them with ``python -m benchmarks``."""
