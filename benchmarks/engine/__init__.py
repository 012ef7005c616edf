"""Benchmark scripts: engine (see benchmarks/README.md)."""
