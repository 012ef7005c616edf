"""What the attention layers need to know about one engine step's flat token batch.

The runner builds one AttentionMetadata per step; every layer reuses it. The model never sees
requests. Tokens are laid out decodes first (one query token each), then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class PrefillChunk:
    query_start: int          # offset of the chunk's first token in the flat batch
    query_len: int
    context_len: int          # tokens of the request in the cache after this step (prefix + chunk)
    context_slots: torch.Tensor | None   # [context_len] slots; None when the chunk is the whole context
    kv_row: int = -1          # the request's row in quantized caches' per-sequence state (window ring)


class QueryRecorder(Protocol):
    """What an attention layer hands its queries (RoPE applied) to, once per layer in layer order."""

    def record(self, query: torch.Tensor) -> None: ...


@dataclass
class QueryObservation:
    """Rows of the flat batch whose queries every attention layer records, in layer order: what a
    press that scores tokens by attention reads (kvserve/press). An eager step that observes runs,
    on a CPU, through the model's own forward; a decode graph records into its own buffer
    (worker/cuda_graphs.py, GraphQueries)."""
    rows: torch.Tensor                                             # [R] int64
    layers: list[torch.Tensor] = field(default_factory=list)       # per layer [R, heads, head_dim] fp32

    def record(self, query: torch.Tensor) -> None:
        self.layers.append(query.index_select(0, self.rows).float())


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                 # [num_tokens] cache slot of each new token
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None    # [num_decodes, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor | None = None    # [num_decodes] int32
    decode_context_mask: torch.Tensor | None = None    # [num_decodes, max_blocks * block_size] bool
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Quantized caches with a full-precision window or error feedback (kvserve.kvstore): each
    # token's ring rows [num_tokens, 2] (window row, sink row; a trash row where the ring drops it),
    # its sequence's state row [num_tokens], and each decode's state row [num_decodes].
    kv_window_slots: torch.Tensor | None = None
    kv_rows: torch.Tensor | None = None
    decode_kv_rows: torch.Tensor | None = None
    observe: QueryRecorder | None = None
