"""Benchmark scripts: kv (see benchmarks/README.md)."""
