"""Benchmark scripts: cpu (see benchmarks/README.md)."""
