"""The scheduler: which requests run each step and how many of their tokens (`scheduler`), the
requests' state (`request`), what a step hands on (`output`), and the latency targets it keeps
(`slo`, with the step-cost model in `step_cost`). Below the worker and the engine, which read its
output; it reads only the KV cache manager and the configuration."""
