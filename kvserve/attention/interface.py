"""The interface every attention backend implements (torch reference, Triton)."""

from __future__ import annotations

from typing import Protocol

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.kvstore import KVPart


class AttentionBackend(Protocol):
    """Stores a layer's new K/V for the step, then attends over the paged cache."""

    name: str
    # The model may write K/V into full-precision caches itself, in its fused rotary kernel
    # (kvserve/model/layers.py: rotary_and_store_kv), and then passes kv_stored=True.
    stores_kv_with_rotary: bool

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: KVPart,
                v_cache: KVPart, meta: AttentionMetadata, scale: float, kv_stored: bool = False) -> torch.Tensor:
        """query [T, heads, D], key/value [T, kv_heads, D] -> [T, heads, D]."""
        ...
