"""Structured output: what a request constrains its output to (params.py, a leaf the sampling
parameters hold) and the grammar engine that turns it into per-token masks (grammar.py, xgrammar)."""
