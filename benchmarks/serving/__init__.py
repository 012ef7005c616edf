"""Benchmark scripts: serving (see benchmarks/README.md)."""
