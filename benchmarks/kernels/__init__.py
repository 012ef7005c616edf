"""Benchmark scripts: kernels (see benchmarks/README.md)."""
