"""Measurement code of the library, above the engine: KV-format fidelity (`kv_fidelity`, behind
`kvserve eval-kv` and benchmarks/kv_fidelity.py) and the offline speed bench (`bench`, behind
`kvserve bench`). Scripts in benchmarks/ and the CLI call these; nothing below the engine imports them."""
