"""ModelRunner: turns a SchedulerOutput into one flat batch, runs the model, samples.

Holds the device KV store (kvserve/kvstore/store.py: the paged cache every layer reads), issues the
step's block copies before its forward (kvserve/worker/kv_transfer.py), and builds the per-step
metadata. Metadata is built with
numpy on the host and moved to the device in one copy per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from kvserve.attention.metadata import AttentionMetadata, PrefillChunk, QueryObservation
from kvserve.kvstore import DEVICE_STORE, BlockCopy, KVCacheSpec, KVCacheStore
from kvserve.model.interfaces import CausalLM
from kvserve.sched.output import ScheduledRequest, SchedulerOutput
from kvserve.sched.request import PENDING_TOKEN, Request, RequestStatus
from kvserve.worker.cuda_graphs import DecodeGraphs
from kvserve.worker.forward_path import choose_forward
from kvserve.worker.kv_sizing import spec_from_config
from kvserve.worker.kv_transfer import KVTransfers
from kvserve.worker.sampler import GrammarBitmask, LogprobTensors, Sampler, SamplingRow, compute_prompt_logprobs

# Called once a step's forward is queued and before its sampling, with the requests of its sampled
# rows: the engine brings their grammars up to date (reading the previous step's tokens) and
# returns the bitmask of the constrained rows, on the host while the device runs the forward.
GrammarHook = Callable[[list[Request]], Optional[GrammarBitmask]]



@dataclass
class StepResult:
    request: Request
    token_id: int
    logprobs: dict[int, float] | None


@dataclass
class InflightStep:
    """A launched step whose sampled tokens are still on the device (or on their way to the host)."""
    requests: list[Request]            # one per sampled row
    row_of: dict[str, int]             # request id -> row
    token_ids: torch.Tensor            # [rows] on the device: the next step's inputs read from here
    host_token_ids: torch.Tensor       # host copy (pinned on CUDA), valid once `ready` has completed
    ready: "torch.cuda.Event | None"   # None where the device runs synchronously (CPU)
    rows: list[SamplingRow]            # what each row asked for
    host_logprobs: LogprobTensors | None = None   # host copies, valid with `ready`, when rows asked

    def results(self) -> list[StepResult]:
        if self.ready is not None:
            self.ready.synchronize()
        logprobs = (self.host_logprobs.entries(self.rows)[0] if self.host_logprobs is not None
                    else [None] * len(self.requests))
        return [StepResult(request, token, lp)
                for request, token, lp in zip(self.requests, self.host_token_ids.tolist(), logprobs)]


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, eos_token_ids: set[int],
                 attention_backend: str = "auto", kv_spec: KVCacheSpec | None = None,
                 max_num_seqs: int = 0) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        if kv_spec is None:
            kv_spec = spec_from_config(model, dtype, None)
        self.kv_spec = kv_spec
        # Quantized caches with a full-precision window or error feedback keep per-sequence state in
        # rows: one per request that may run at once (see kvserve/kvstore/quantized_part.py).
        self.num_kv_rows = max_num_seqs if kv_spec.needs_rows else 0
        if kv_spec.needs_rows and self.num_kv_rows < 1:
            raise ValueError("a KV format with a window, sinks or error feedback needs max_num_seqs >= 1")
        self.kv_store = KVCacheStore.allocate(kv_spec, num_blocks, block_size, device, self.num_kv_rows)
        # Stores block copies may name; a KV tier registers its own (register_store).
        self.kv_stores: dict[str, KVCacheStore] = {DEVICE_STORE: self.kv_store}
        self.transfers = KVTransfers(self.kv_stores, device)
        self._kv_row_of: dict[str, tuple[int, Request]] = {}
        self._free_kv_rows = list(range(self.num_kv_rows - 1, -1, -1))
        self.forward_path = choose_forward(device, attention_backend, model, dtype, self.kv_store)
        self.backend = self.forward_path.backend
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        self.observed: dict[str, list[torch.Tensor]] = {}     # the last step's recorded queries (see _forward)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _slots(self, block_table: list[int], start: int, end: int) -> np.ndarray:
        if end - start == 1:   # a decode token: plain arithmetic beats four numpy calls per request
            return np.array((block_table[start // self.block_size] * self.block_size + start % self.block_size,))
        positions = np.arange(start, end)
        table = np.asarray(block_table, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def build_batch(self, items: list[ScheduledRequest], block_tables: dict[str, list[int]],
                    observe: dict[str, int] | None = None):
        decodes = [item for item in items if item.num_new_tokens == 1]
        prefills = [item for item in items if item.num_new_tokens > 1]
        ordered = decodes + prefills
        token_ids, positions, slots = [], [], []
        for item in ordered:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            token_ids.extend(request.token_ids_between(start, end))
            positions.append(np.arange(start, end))
            # A pressed request's KV is shorter than its positions (kvserve/press): its new tokens go
            # after the KV it kept.
            kv_start = request.num_kv_tokens
            slots.append(self._slots(block_tables[request.request_id], kv_start, kv_start + item.num_new_tokens))
        meta = AttentionMetadata(slot_mapping=self._to_device(np.concatenate(slots)),
                                 num_decode_tokens=len(decodes))
        kv_rows = self.assign_kv_rows(ordered, block_tables) if self.num_kv_rows else None
        if kv_rows is not None:
            token_rows, window_slots = self.kv_row_tensors(ordered, kv_rows)
            meta.kv_rows = self._to_device(token_rows)
            meta.kv_window_slots = self._to_device(window_slots)
            meta.decode_kv_rows = self._to_device(np.asarray(kv_rows[:len(decodes)], dtype=np.int64))
        if decodes:
            context_lens = np.array([item.request.num_kv_tokens + 1 for item in decodes])
            max_context = int(context_lens.max())
            max_blocks = -(-max_context // self.block_size)
            # int32 on CUDA, as the decode CUDA graphs' tables are: a Triton kernel compiles one
            # variant per pointer dtype, and a second one would be built mid-serving.
            tables = np.zeros((len(decodes), max_blocks), dtype=np.int32 if self.device.type == "cuda" else np.int64)
            for row, item in enumerate(decodes):
                table = block_tables[item.request.request_id][:max_blocks]
                tables[row, :len(table)] = table
            meta.decode_block_tables = self._to_device(tables)
            meta.decode_context_lens = self._to_device(context_lens.astype(np.int32))
        offset = len(decodes)
        for item in prefills:
            start = item.request.num_kv_tokens
            context_len = start + item.num_new_tokens
            context_slots = None
            if start > 0:
                context_slots = self._to_device(self._slots(block_tables[item.request.request_id], 0, context_len))
            kv_row = kv_rows[len(decodes) + len(meta.prefills)] if kv_rows is not None else -1
            meta.prefills.append(PrefillChunk(offset, item.num_new_tokens, context_len, context_slots, kv_row))
            offset += item.num_new_tokens
        if observe:
            meta.observe = QueryObservation(self._to_device(self._observed_rows(ordered, observe)))
        input_ids = self._to_device(np.asarray(token_ids, dtype=np.int64))
        positions_t = self._to_device(np.concatenate(positions).astype(np.int64))
        return ordered, input_ids, positions_t, meta

    @staticmethod
    def _observed_rows(ordered: list[ScheduledRequest], observe: dict[str, int]) -> np.ndarray:
        """Flat rows of the last `observe[id]` tokens (at most the step's) of each observed request."""
        rows, offset = [], 0
        for item in ordered:
            count = observe.get(item.request.request_id, 0)
            if count:
                count = min(count, item.num_new_tokens)
                end = offset + item.num_new_tokens
                rows.append(np.arange(end - count, end))
            offset += item.num_new_tokens
        return np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, dtype=np.int64)

    def _split_observation(self, ordered: list[ScheduledRequest], observe: dict[str, int],
                           observation: QueryObservation) -> dict[str, list[torch.Tensor]]:
        """Each observed request's queries, per layer [W, heads, head_dim] (rows in `_observed_rows` order)."""
        out, start = {}, 0
        for item in ordered:
            count = min(observe.get(item.request.request_id, 0), item.num_new_tokens)
            if count:
                out[item.request.request_id] = [layer[start:start + count] for layer in observation.layers]
                start += count
        return out

    def _graph_observation(self, ordered: list[ScheduledRequest], observe: dict[str, int]
                           ) -> dict[str, list[torch.Tensor]]:
        """The decode queries a graph replay recorded, per observed request and layer [1, heads, head_dim]
        fp32 (copies: the next replay overwrites the buffer)."""
        rows = [row for row, item in enumerate(ordered) if observe.get(item.request.request_id, 0)]
        picked = self.graphs.queries[:, self._to_device(np.asarray(rows, dtype=np.int64))].float()  # [L, R, H, D]
        return {ordered[row].request.request_id: list(picked[:, index:index + 1].unbind(0))
                for index, row in enumerate(rows)}

    # --- per-sequence rows of quantized caches (window ring, error-feedback residual) -----------
    def assign_kv_rows(self, items: list[ScheduledRequest], block_tables: dict[str, list[int]]) -> list[int]:
        """Each item's row; rows of requests that finished or were preempted go back first. A
        request starting from position 0 (new, or recomputing after preemption) has its
        error-feedback residual cleared; one that gets a row with tokens already in its blocks (a
        prefix-cache hit, a load from a tier, a swap-in) has its window ring filled from them."""
        scheduled = {item.request.request_id for item in items}
        for request_id, (row, request) in list(self._kv_row_of.items()):
            if request_id not in scheduled and request.status != RequestStatus.RUNNING:
                del self._kv_row_of[request_id]
                self._free_kv_rows.append(row)
        rows, fresh = [], []
        for item in items:
            request = item.request
            entry = self._kv_row_of.get(request.request_id)
            if entry is None:
                if not self._free_kv_rows:
                    raise RuntimeError("more running requests than quantized-KV rows (max_num_seqs)")
                entry = (self._free_kv_rows.pop(), request)
                self._kv_row_of[request.request_id] = entry
                if request.num_computed_tokens:
                    self.kv_store.fill_window_rows(entry[0], block_tables[request.request_id],
                                                   request.num_computed_tokens)
            rows.append(entry[0])
            if request.num_computed_tokens == 0:
                fresh.append(entry[0])
        self.kv_store.clear_residuals(fresh)
        return rows

    def kv_row_tensors(self, items: list[ScheduledRequest], rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(state row per token [T], ring rows per token [T, 2]: window, sink). Within a step, only
        the last `window` tokens of a request go to the window ring (earlier ones would be
        overwritten by later ones in the same copy, in no defined order)."""
        spec = self.kv_spec
        ring_len, trash = spec.sinks + spec.window, self.num_kv_rows * (spec.sinks + spec.window)
        token_rows, window_slots = [], []
        for item, row in zip(items, rows):
            start = item.request.num_computed_tokens
            end = start + item.num_new_tokens
            positions = np.arange(start, end)
            token_rows.append(np.full(item.num_new_tokens, row, dtype=np.int64))
            slots = np.full((item.num_new_tokens, 2), trash, dtype=np.int64)
            if spec.window:
                keep = positions >= end - spec.window
                slots[keep, 0] = row * ring_len + spec.sinks + positions[keep] % spec.window
            if spec.sinks:
                keep = positions < spec.sinks
                slots[keep, 1] = row * ring_len + positions[keep]
            window_slots.append(slots)
        return np.concatenate(token_rows), np.concatenate(window_slots)

    def _forward(self, sched_out: SchedulerOutput, block_tables: dict[str, list[int]],
                 previous: InflightStep | None = None, observe: dict[str, int] | None = None):
        """(ordered items, hidden states, sampled row offsets, their requests). With `observe`
        (request id -> query rows to record), `self.observed` holds those queries afterwards. The
        step's block copies were issued before (`run_block_copies`, by the engine)."""
        self.observed = {}
        if not sched_out.scheduled:
            return [], None, [], []
        ordered = None
        if self.graphs is not None and (not observe or (self.graphs.queries is not None
                                                        and max(observe.values()) <= 1)):
            ordered, hidden = self.graphs.try_run(sched_out.scheduled, block_tables, previous)
            if ordered is not None and observe:
                self.observed = self._graph_observation(ordered, observe)
        if ordered is None:
            ordered, input_ids, positions, meta = self.build_batch(sched_out.scheduled, block_tables, observe)
            self.feed_pending_tokens(input_ids, ordered, previous)
            with self._sdpa_backends():
                hidden = self.forward_path.run(self.model, input_ids, positions, self.kv_store, meta)
            if meta.observe is not None:
                self.observed = self._split_observation(ordered, observe, meta.observe)
        sample_rows, row_requests, offset = [], [], 0
        for item in ordered:
            request = item.request
            if request.params.prompt_logprobs is not None:
                self._record_prompt_logprobs(item, hidden[offset:offset + item.num_new_tokens])
            if item.samples_token:
                sample_rows.append(offset + item.num_new_tokens - 1)
                row_requests.append(request)
            offset += item.num_new_tokens
        return ordered, hidden, sample_rows, row_requests

    # --- block copies between KV stores -------------------------------------------------------
    def register_store(self, name: str, store: KVCacheStore) -> None:
        """Makes `store` nameable in block copies (a KV tier's host or disk staging store)."""
        if name in self.kv_stores:
            raise ValueError(f"a KV store named {name!r} is already registered")
        self.kv_store.check_same_layout(store)
        self.kv_stores[name] = store

    def run_block_copies(self, copies: list[BlockCopy], beside_a_batch: bool = False) -> list[int]:
        """Issues a step's block copies; the caller runs it before the step's forward, which
        then reads what they bring (kvserve/worker/kv_transfer.py);
        returns the tickets of inline loads (BlockCopy.inline) that failed as they were issued."""
        return self.transfers.run(copies, beside_a_batch)

    def _sampled_logits(self, hidden: torch.Tensor, sample_rows: list[int]) -> torch.Tensor:
        if sample_rows[-1] - sample_rows[0] == len(sample_rows) - 1:
            # Rows in a run (every decode-only step): a view, no host->device index copy, which
            # would wait for the forward to finish before the logits GEMM could even be queued.
            sampled_hidden = hidden[sample_rows[0]:sample_rows[-1] + 1]
        else:
            sampled_hidden = hidden[torch.from_numpy(np.asarray(sample_rows)).to(self.device, non_blocking=True)]
        return self.model.compute_logits(sampled_hidden)

    def _sampling_rows(self, row_requests: list[Request]) -> list[SamplingRow]:
        return [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, self._generator(r),
                            None if r.forced_token_ids is None else self._forced_token(r))
                for r in row_requests]

    @staticmethod
    def _forced_token(request: Request) -> int:
        """The forced id of the output about to be sampled. Outputs still on the device count (their
        PENDING_TOKEN is in output_token_ids), so a launched-ahead step takes the right one."""
        index = len(request.output_token_ids)
        if index >= len(request.forced_token_ids):
            raise RuntimeError(f"request {request.request_id!r} samples output {index}, past its "
                               f"{len(request.forced_token_ids)} forced tokens")
        return request.forced_token_ids[index]

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput, block_tables: dict[str, list[int]],
                observe: dict[str, int] | None = None, grammar: GrammarHook | None = None) -> list[StepResult]:
        _, hidden, sample_rows, row_requests = self._forward(sched_out, block_tables, observe=observe)
        if not row_requests:
            return []
        logits = self._sampled_logits(hidden, sample_rows)
        bitmask = grammar(row_requests) if grammar is not None else None
        result = self.sampler(logits, self._sampling_rows(row_requests), self.eos_token_ids, bitmask)
        return [StepResult(request, token, lp)
                for request, token, lp in zip(row_requests, result.token_ids, result.logprobs)]

    @torch.inference_mode()
    def launch(self, sched_out: SchedulerOutput, block_tables: dict[str, list[int]],
               previous: InflightStep | None, grammar: GrammarHook | None = None) -> InflightStep | None:
        """Queues a step on the device without waiting for it: decodes whose input token is still
        pending read it from `previous` on the device, and the sampled tokens start their copy to
        the host. Only for steps whose sampling needs no host-side token history (see
        `can_launch_ahead`); a grammar's mask (`grammar`) is the exception: it is built on the host
        while this step's forward runs, after the previous step's tokens are read."""
        _, hidden, sample_rows, row_requests = self._forward(sched_out, block_tables, previous)
        if not row_requests:
            return None
        logits = self._sampled_logits(hidden, sample_rows)
        rows = self._sampling_rows(row_requests)
        bitmask = grammar(row_requests) if grammar is not None else None
        token_ids, logprobs = self.sampler.select(logits, rows, self.eos_token_ids, bitmask)
        host_logprobs = logprobs.to_host() if logprobs is not None else None
        ready = None
        if token_ids.is_cuda:
            host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            host.copy_(token_ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = token_ids
        return InflightStep(row_requests, {r.request_id: i for i, r in enumerate(row_requests)}, token_ids, host,
                            ready, rows, host_logprobs)

    def feed_pending_tokens(self, input_ids: torch.Tensor, items: list[ScheduledRequest],
                            previous: InflightStep | None) -> None:
        """input_ids[i] <- the token `previous` sampled for item i's request, for the decodes whose
        input token has not reached the host (PENDING_TOKEN there). Decodes come first in a batch,
        one token each, so item i's input is input_ids[i]."""
        if previous is None:
            return
        sources = np.full(len(items), -1, dtype=np.int64)
        for index, item in enumerate(items):
            if item.num_new_tokens != 1:
                break
            if item.request.last_token_id == PENDING_TOKEN:
                sources[index] = previous.row_of[item.request.request_id]
        if (sources < 0).all():
            return
        source = self._to_device(sources)
        head = input_ids[:len(items)]
        head.copy_(torch.where(source >= 0, previous.token_ids[source.clamp(min=0)], head))

    def can_launch_ahead(self, sched_out: SchedulerOutput) -> bool:
        """True when a step may be queued before the previous step's tokens reach the host: no
        scheduled request needs host-side token history to sample (penalties) or per-token host work
        on the prompt (prompt logprobs). Sampled-token logprobs come from the step's own logits: they
        travel to the host with its tokens."""
        for item in sched_out.scheduled:
            params = item.request.params
            if (params.prompt_logprobs is not None
                    or params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty):
                return False
        return True

    def capture_cuda_graphs(self, max_batch_size: int, max_model_len: int, query_heads: int = 0) -> None:
        """Captures decode steps for a ladder of batch sizes (see DecodeGraphs); with `query_heads`
        they record the decode queries too."""
        if self.device.type != "cuda" or self.forward_path.name != "triton":
            return
        if self.kv_spec.error_feedback:    # its store loops over tokens on the host: not capturable
            return
        self.graphs = DecodeGraphs(self, max_batch_size, max_model_len, query_heads)

    def _sdpa_backends(self):
        """Keeps SDPA off cuDNN: it builds a new plan for every new sequence length, which cost
        host time on every layer of every decode step (docs/architecture.md#attention)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def _generator(self, request: Request) -> torch.Generator | None:
        if request.params.seed is None:
            return None
        if request.generator is None:
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(request.params.seed)
        return request.generator

    def _record_prompt_logprobs(self, item: ScheduledRequest, hidden: torch.Tensor) -> None:
        """Logprob of each prompt token given its prefix (OpenAI `echo` + `logprobs`)."""
        request = item.request
        start = item.request.num_computed_tokens
        # The list holds None + one entry per earlier prompt position; anything else means this
        # chunk was recorded before a preemption, or lies past the prompt.
        if len(request.prompt_logprobs) != (start + 1 if start else 0) or start >= request.num_prompt_tokens:
            return
        if start == 0:
            request.prompt_logprobs.append(None)
        end = min(start + item.num_new_tokens, request.num_prompt_tokens - 1)
        if end <= start:
            return
        logits = self.model.compute_logits(hidden[: end - start])
        next_ids = torch.tensor(request.prompt_token_ids[start + 1:end + 1], device=logits.device)
        request.prompt_logprobs.extend(compute_prompt_logprobs(logits, next_ids, request.params.prompt_logprobs))

    def profile_forward(self, num_tokens: int, num_logit_rows: int) -> None:
        """Runs the worst-case step shape (one prefill of `num_tokens`) to measure peak activations."""
        meta = AttentionMetadata(slot_mapping=torch.arange(num_tokens, device=self.device))
        meta.prefills.append(PrefillChunk(0, num_tokens, num_tokens, None))
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        with torch.inference_mode(), self._sdpa_backends():
            hidden = self.forward_path.run(self.model, input_ids, positions, self.kv_store, meta)
            self.model.compute_logits(hidden[:num_logit_rows])
