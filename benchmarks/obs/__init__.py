"""Observability scripts: the deploy kit's dashboard queries against a real Prometheus (docs/observability.md)."""
