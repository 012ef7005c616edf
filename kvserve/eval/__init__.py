"""Measurement code of the library, above the engine: KV-format fidelity (`kv_fidelity`, behind
`kvserve eval-kv` and benchmarks/kv/kv_fidelity.py), the offline speed bench (`bench`, behind
`kvserve bench`), and what the benchmarks/ scripts measure with: one timing helper (`timing`), the
benchmark prompts (`prompts`), the offline-throughput workload (`offline`), the prefix-cache traces
and their replay with its offline yardsticks, Belady's MIN among them (`prefix_traces`,
`prefix_sim`), and compile-only kernel resource reports (`kernel_resources`). Scripts in benchmarks/,
the CLI and the tests call these; nothing below the engine imports them."""
