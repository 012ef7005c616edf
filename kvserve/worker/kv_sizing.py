"""The KV cache a model gets: its spec from the cache options, and how many blocks a budget buys."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.kvstore import KV_SPEC_OPTIONS, KVCacheSpec, build_kv_cache_spec
from kvserve.model.interfaces import CausalLM, OwnKVLayout

logger = logging.getLogger("kvserve")


def spec_from_config(model: CausalLM, model_dtype: torch.dtype, cache_config=None) -> KVCacheSpec:
    """The spec of `model`'s cache from a CacheConfig's kv_* fields (the model dtype's K/V for None)."""
    options = {name: getattr(cache_config, name) for name in KV_SPEC_OPTIONS} if cache_config is not None else {}
    if isinstance(model, OwnKVLayout):
        # A model with its own cache layout (MLA's latent + RoPE key: kvserve/model/mla_cache.py).
        return model.build_kv_cache_spec(model_dtype, options)
    num_kv_heads, head_dim = model.kv_head_shape
    return build_kv_cache_spec(model.num_kv_layers, num_kv_heads, head_dim, model_dtype, **options)


# The KV budget on a CPU when kv_cache_memory is not given.
DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class KVSizing:
    """How many blocks the budget buys, and how many requests may run at once beside them."""

    num_blocks: int
    max_num_seqs: int


def size_kv_cache(spec: KVCacheSpec, budget: int, block_size: int, max_num_seqs: int) -> KVSizing:
    """Blocks from `budget` bytes after the format's per-sequence state (full-precision window rings,
    residuals: one row per running request). When max_num_seqs rows would take over a quarter of
    the budget, fewer requests run at once (max_num_seqs is lowered, with a warning)."""
    fixed = spec.fixed_bytes(max_num_seqs)
    if fixed > budget // 4 and spec.needs_rows:
        per_row = max(1, spec.fixed_bytes(2) - spec.fixed_bytes(1))
        rows = max(1, (budget // 4) // per_row)
        logger.warning("the KV window of %d rows needs %d bytes; max_num_seqs lowered from %d to %d",
                       max_num_seqs, fixed, max_num_seqs, rows)
        max_num_seqs, fixed = rows, spec.fixed_bytes(rows)
    num_blocks = (budget - fixed) // (spec.bytes_per_token * block_size)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory of {budget - fixed} bytes holds no block of {block_size} "
                         f"tokens at {spec.bytes_per_token} bytes/token")
    return KVSizing(int(num_blocks), max_num_seqs)
