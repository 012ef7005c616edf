"""Observability: Prometheus metrics (metrics.py)."""
