"""CUDA graphs of the worker's pure-decode steps (see DecodeGraphs)."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator, Protocol

import numpy as np
import torch

from kvserve.attention.interface import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kvstore import KVCacheSpec, KVCacheStore
from kvserve.model.interfaces import CausalLM
from kvserve.sched.output import ScheduledRequest


class GraphRunner(Protocol):
    """What the graphs read and call on the model runner that owns them."""

    model: CausalLM
    device: torch.device
    block_size: int
    kv_spec: KVCacheSpec
    kv_store: KVCacheStore
    backend: AttentionBackend
    num_kv_rows: int

    def assign_kv_rows(self, items: list[ScheduledRequest], block_tables: dict[str, list[int]]) -> list[int]: ...

    def kv_row_tensors(self, items: list[ScheduledRequest], rows: list[int]) -> tuple[np.ndarray, np.ndarray]: ...

    def feed_pending_tokens(self, input_ids: torch.Tensor, items: list[ScheduledRequest], previous) -> None: ...


class GraphQueries:
    """A decode graph's query recorder: every attention layer copies its queries into one static
    buffer [layers, rows, heads, head_dim] (the tiering press mode ranks KV blocks on them), so a
    step whose queries are wanted still replays its graph. The layer counter wraps, so each
    forward (warm-ups, the capture) starts again at layer 0."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self._layer = 0

    def record(self, query: torch.Tensor) -> None:
        self.buffer[self._layer].copy_(query)
        self._layer = (self._layer + 1) % self.buffer.shape[0]


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to the limit: padding wastes at most 15 rows."""
    sizes = [size for size in (1, 2, 4, 8) if size <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 16))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class DecodeGraphs:
    """CUDA graphs of pure-decode steps, one per batch size on a ladder; a step pads to the next.

    Decode steps are launch-bound at small batch (hundreds of small kernels per step), so replaying
    a captured graph removes the host from the loop. The graphs read static buffers: token ids,
    positions, slots (-1 = padding row, skipped by the store kernel), block tables at the full
    width max_model_len / block_size (only the columns a step needs are refreshed: the kernel never
    reads past a sequence's own blocks) and context lengths (0 = padding row). Steps with prefill
    chunks, prompt logprobs or a batch over the largest size run eagerly. With `query_heads` (the
    model's query heads; 0: none) the graphs also copy every layer's decode queries into `queries`
    (GraphQueries).
    """

    def __init__(self, runner: GraphRunner, max_batch_size: int, max_model_len: int,
                 query_heads: int = 0) -> None:
        self.runner = runner
        device = runner.device
        self.sizes = graph_batch_sizes(max_batch_size)
        largest = self.sizes[-1]
        self.max_blocks = -(-max_model_len // runner.block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(largest, self.max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.kv_window_slots = self.kv_rows = self.decode_kv_rows = None
        if runner.num_kv_rows:
            # Padding rows write to the rings' and residuals' trash rows and read nothing.
            spec = runner.kv_spec
            trash = runner.num_kv_rows * (spec.sinks + spec.window)
            self.kv_window_slots = torch.full((largest, 2), trash, dtype=torch.long, device=device)
            self.kv_rows = torch.full((largest,), runner.num_kv_rows, dtype=torch.long, device=device)
            self.decode_kv_rows = torch.zeros(largest, dtype=torch.long, device=device)
        self.queries = None
        if query_heads:
            self.queries = torch.zeros(runner.model.num_kv_layers, largest, query_heads, runner.kv_spec.head_dim,
                                       dtype=runner.kv_spec.model_dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        # Largest first, so smaller graphs reuse the largest one's memory pool.
        for size in reversed(self.sizes):
            meta = self._meta(size)
            with torch.inference_mode():
                for _ in range(2):   # warm-up: triton compiles/autotunes outside the capture
                    runner.model(self.input_ids[:size], self.positions[:size], runner.kv_store, meta, runner.backend)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                # No collection during the capture: a finalizer it runs (another engine's pinned
                # buffers, say) may make a CUDA call that is illegal while a stream captures, and
                # other threads' CUDA work (a second engine in the process) must not void it either.
                with _no_gc(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self.outputs[size] = runner.model(self.input_ids[:size], self.positions[:size],
                                                      runner.kv_store, meta, runner.backend)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    def _meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decode_tokens=size,
                                 decode_block_tables=self.block_tables[:size],
                                 decode_context_lens=self.context_lens[:size])
        if self.kv_rows is not None:
            meta.kv_window_slots = self.kv_window_slots[:size]
            meta.kv_rows = self.kv_rows[:size]
            meta.decode_kv_rows = self.decode_kv_rows[:size]
        if self.queries is not None:
            meta.observe = GraphQueries(self.queries[:, :size])
        return meta

    def try_run(self, items: list[ScheduledRequest], block_tables: dict[str, list[int]],
                previous=None):
        """(ordered items, hidden [n, H]) from a graph replay, or (None, None) if the step does not fit."""
        count = len(items)
        if count > self.sizes[-1] or any(item.num_new_tokens != 1 or item.request.params.prompt_logprobs is not None
                                         for item in items):
            return None, None
        size = next(s for s in self.sizes if s >= count)
        block_size = self.runner.block_size
        positions = np.fromiter((item.request.num_computed_tokens for item in items), dtype=np.int64, count=count)
        token_ids = np.fromiter((item.request.last_token_id for item in items), dtype=np.int64, count=count)
        tables = [block_tables[item.request.request_id] for item in items]
        width = max(len(t) for t in tables)
        table_array = np.zeros((size, width), dtype=np.int32)
        for row, table in enumerate(tables):
            table_array[row, :len(table)] = table
        # The KV index differs from the position once a press pruned the request (kvserve/press).
        kv_index = np.fromiter((item.request.num_kv_tokens for item in items), dtype=np.int64, count=count)
        slots = np.full(size, -1, dtype=np.int64)
        slots[:count] = table_array[np.arange(count), kv_index // block_size].astype(np.int64) * block_size \
            + kv_index % block_size
        context_lens = np.zeros(size, dtype=np.int32)
        context_lens[:count] = kv_index + 1
        padded_ids = np.zeros(size, dtype=np.int64)
        padded_ids[:count] = token_ids
        padded_pos = np.zeros(size, dtype=np.int64)
        padded_pos[:count] = positions
        self.input_ids[:size].copy_(torch.from_numpy(padded_ids), non_blocking=True)
        self.runner.feed_pending_tokens(self.input_ids, items, previous)
        self.positions[:size].copy_(torch.from_numpy(padded_pos), non_blocking=True)
        self.slot_mapping[:size].copy_(torch.from_numpy(slots), non_blocking=True)
        self.context_lens[:size].copy_(torch.from_numpy(context_lens), non_blocking=True)
        self.block_tables[:size, :width].copy_(torch.from_numpy(table_array), non_blocking=True)
        if self.kv_rows is not None:
            # Whole `size` rows: a padding row must not keep a real row's ring slot from an earlier step.
            rows = self.runner.assign_kv_rows(items, block_tables)
            token_rows, window_slots = self.runner.kv_row_tensors(items, rows)
            spec, num_rows = self.runner.kv_spec, self.runner.num_kv_rows
            padded_rows = np.full(size, num_rows, dtype=np.int64)
            padded_rows[:count] = token_rows
            padded_slots = np.full((size, 2), num_rows * (spec.sinks + spec.window), dtype=np.int64)
            padded_slots[:count] = window_slots
            decode_rows = np.zeros(size, dtype=np.int64)
            decode_rows[:count] = token_rows
            self.kv_rows[:size].copy_(torch.from_numpy(padded_rows), non_blocking=True)
            self.decode_kv_rows[:size].copy_(torch.from_numpy(decode_rows), non_blocking=True)
            self.kv_window_slots[:size].copy_(torch.from_numpy(padded_slots), non_blocking=True)
        self.graphs[size].replay()
        return items, self.outputs[size][:count]
