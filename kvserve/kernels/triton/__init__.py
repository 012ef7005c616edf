"""Triton kernels for the GPU fast path: paged KV store, paged decode/prefill attention, fused
RMSNorm(+residual) and SiLU*mul.

Each kernel has a torch reference: `kvserve.kernels.reference` for the attention and KV-store
kernels, `kvserve.kernels.triton.references` for the fused norm/activation (pure torch, no triton).
Importing this package does not import triton; the names below load their module on first use, so
`from kvserve.kernels.triton import references` works on a machine without triton.

Set TRITON_INTERPRET=1 before the first import of triton to run the kernels on CPU tensors with
Triton's interpreter (slow; small shapes only).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "store_kv": "kv_store",
    "paged_decode_attention": "decode_attention",
    "choose_num_splits": "decode_attention",
    "decode_workspace": "decode_attention",
    "decode_num_splits": "decode_attention",
    "DecodeConfig": "decode_attention",
    "paged_prefill_attention": "prefill_attention",
    "plan_prefill": "prefill_attention",
    "PrefillPlan": "prefill_attention",
    "PrefillConfig": "prefill_attention",
    "rms_norm": "fused_ops",
    "silu_and_mul": "fused_ops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module_name}"), name)
    globals()[name] = value
    return value
