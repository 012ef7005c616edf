"""What the worker and engine may ask of a model: the `CausalLM` every model implements, and small
capabilities some have (their own KV layout, MoE layers). Checked with isinstance, so a model states
a capability by having the methods, and the caller never probes for attributes one by one."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Protocol, runtime_checkable

import torch

from kvserve.attention.interface import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kvstore import KVCacheSpec, KVCacheStore


@runtime_checkable
class CausalLM(Protocol):
    @property
    def num_kv_layers(self) -> int: ...

    @property
    def kv_head_shape(self) -> tuple[int, int]:
        """(KV heads, head_dim) of the standard K/V layout."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_store: KVCacheStore,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's flat token batch."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


@runtime_checkable
class OwnKVLayout(Protocol):
    """A model whose cache is not K and V per KV head (MLA: a latent and a RoPE key)."""

    def build_kv_cache_spec(self, model_dtype: torch.dtype, options: dict[str, Any]) -> KVCacheSpec: ...


@runtime_checkable
class MoEModel(Protocol):
    """A model with mixture-of-experts layers (kvserve/model/moe.py)."""

    def set_moe_implementation(self, name: str) -> None: ...

    def expert_load(self) -> Optional[Any]:
        """ExpertLoadStats since the last reset."""
        ...

    def reset_expert_load(self) -> None: ...
