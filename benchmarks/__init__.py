"""Benchmark scripts, by topic: kernels/, engine/, serving/, cpu/, kv/ (benchmarks/README.md lists
them). Each runs from the repository root as `python benchmarks/<topic>/<name>.py` or
`python -m benchmarks.<topic>.<name>`; what they measure with lives in kvserve.eval (timing, workloads,
simulations), and their results in benchmarks/results/."""
