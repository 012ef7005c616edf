"""ModelRunner: turns a SchedulerOutput into one flat batch, runs the model, samples.

Owns the device tensors of the KV cache (one K and one V tensor per layer, NHD layout:
[num_blocks, block_size, num_kv_heads, head_dim]) and the per-step metadata build. Metadata is
built with numpy on the host and moved to the device in one copy per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.backend import get_attention_backend
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk
from kvserve.sched.request import PENDING_TOKEN, Request, RequestStatus
from kvserve.worker.sampler import Sampler, SamplingRow, compute_prompt_logprobs
from kvserve.sched.output import ScheduledRequest, SchedulerOutput
from kvserve.kvcache.quant import KVCacheSpec, spec_from_config
from kvserve.model.cpu_linear import can_pack, pack_linears


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

    def results(self) -> list[StepResult]:
        if self.ready is not None:
            self.ready.synchronize()
        return [StepResult(request, token, None) for request, token in zip(self.requests, self.host_token_ids.tolist())]


def prepare_model_for_backend(model: torch.nn.Module, backend, dtype: torch.dtype, device: torch.device) -> None:
    """Packs the linears for the CPU path that runs them: the native kernels' panels, or oneDNN's
    blocked layout for the torch path in fp32 (kvserve/model/cpu_linear.py). Idempotent."""
    prepare = getattr(backend, "prepare", None)
    if prepare is not None:
        prepare(model, dtype)
    elif can_pack(dtype, device):
        pack_linears(model)


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype, kv_spec: KVCacheSpec | None = None) -> int:
    """Bytes of K and V one token occupies across all layers: the model dtype's, or the paged-cache
    bytes (payload + scales) of a KV format spec."""
    if kv_spec is not None:
        return kv_spec.bytes_per_token
    num_kv_heads, head_dim = model.kv_head_shape
    return 2 * model.num_kv_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
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
        # rows: one per request that may run at once (see kvcache/quant.py).
        self.num_kv_rows = max_num_seqs if kv_spec.needs_rows else 0
        if kv_spec.needs_rows and self.num_kv_rows < 1:
            raise ValueError("a KV format with a window, sinks or error feedback needs max_num_seqs >= 1")
        self.kv_caches = kv_spec.allocate(num_blocks, block_size, device, self.num_kv_rows)
        self._kv_row_of: dict[str, tuple[int, Request]] = {}
        self._free_kv_rows = list(range(self.num_kv_rows - 1, -1, -1))
        self.backend = get_attention_backend(device, attention_backend, model, dtype, self.kv_caches)
        prepare_model_for_backend(model, self.backend, dtype, device)
        self.sampler = Sampler()
        self.graphs: "DecodeGraphs | None" = None

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _slots(self, block_table: list[int], start: int, end: int) -> np.ndarray:
        if end - start == 1:   # a decode token: plain arithmetic beats four numpy calls per request
            return np.array((block_table[start // self.block_size] * self.block_size + start % self.block_size,))
        positions = np.arange(start, end)
        table = np.asarray(block_table, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def build_batch(self, items: list[ScheduledRequest], block_tables: dict[str, list[int]]):
        decodes = [item for item in items if item.num_new_tokens == 1]
        prefills = [item for item in items if item.num_new_tokens > 1]
        ordered = decodes + prefills
        token_ids, positions, slots = [], [], []
        for item in ordered:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            token_ids.extend(request.token_ids_between(start, end))
            positions.append(np.arange(start, end))
            slots.append(self._slots(block_tables[request.request_id], start, end))
        meta = AttentionMetadata(slot_mapping=self._to_device(np.concatenate(slots)),
                                 num_decode_tokens=len(decodes))
        kv_rows = self._assign_kv_rows(ordered) if self.num_kv_rows else None
        if kv_rows is not None:
            token_rows, window_slots = self._kv_row_tensors(ordered, kv_rows)
            meta.kv_rows = self._to_device(token_rows)
            meta.kv_window_slots = self._to_device(window_slots)
            meta.decode_kv_rows = self._to_device(np.asarray(kv_rows[:len(decodes)], dtype=np.int64))
        if decodes:
            context_lens = np.array([item.request.num_computed_tokens + 1 for item in decodes])
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
            start = item.request.num_computed_tokens
            context_len = start + item.num_new_tokens
            context_slots = None
            if start > 0:
                context_slots = self._to_device(self._slots(block_tables[item.request.request_id], 0, context_len))
            kv_row = kv_rows[len(decodes) + len(meta.prefills)] if kv_rows is not None else -1
            meta.prefills.append(PrefillChunk(offset, item.num_new_tokens, context_len, context_slots, kv_row))
            offset += item.num_new_tokens
        input_ids = self._to_device(np.asarray(token_ids, dtype=np.int64))
        positions_t = self._to_device(np.concatenate(positions).astype(np.int64))
        return ordered, input_ids, positions_t, meta

    # --- per-sequence rows of quantized caches (window ring, error-feedback residual) -----------
    def _assign_kv_rows(self, items: list[ScheduledRequest]) -> list[int]:
        """Each item's row; rows of requests that finished or were preempted go back first. A
        request starting from position 0 (new, or recomputing after preemption) has its
        error-feedback residual cleared."""
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
            rows.append(entry[0])
            if request.num_computed_tokens == 0:
                fresh.append(entry[0])
        if fresh and self.kv_spec.error_feedback:
            index = torch.tensor(fresh, device=self.device)
            for pair in self.kv_caches:
                for part in pair:
                    if getattr(part, "residual", None) is not None:
                        part.residual.index_fill_(0, index, 0.0)
        return rows

    def _kv_row_tensors(self, items: list[ScheduledRequest], rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
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
                 previous: InflightStep | None = None):
        """(ordered items, hidden states, sampled row offsets, their requests)."""
        ordered = None
        if self.graphs is not None:
            ordered, hidden = self.graphs.try_run(sched_out.scheduled, block_tables, previous)
        if ordered is None:
            ordered, input_ids, positions, meta = self.build_batch(sched_out.scheduled, block_tables)
            self.feed_pending_tokens(input_ids, ordered, previous)
            with self._sdpa_backends():
                hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
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

    def _sampled_logits(self, hidden: torch.Tensor, sample_rows: list[int]) -> torch.Tensor:
        if sample_rows[-1] - sample_rows[0] == len(sample_rows) - 1:
            # Rows in a run (every decode-only step): a view, no host->device index copy, which
            # would wait for the forward to finish before the logits GEMM could even be queued.
            sampled_hidden = hidden[sample_rows[0]:sample_rows[-1] + 1]
        else:
            sampled_hidden = hidden[torch.from_numpy(np.asarray(sample_rows)).to(self.device, non_blocking=True)]
        return self.model.compute_logits(sampled_hidden)

    def _sampling_rows(self, row_requests: list[Request]) -> list[SamplingRow]:
        return [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, self._generator(r))
                for r in row_requests]

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput, block_tables: dict[str, list[int]]) -> list[StepResult]:
        _, hidden, sample_rows, row_requests = self._forward(sched_out, block_tables)
        if not row_requests:
            return []
        logits = self._sampled_logits(hidden, sample_rows)
        result = self.sampler(logits, self._sampling_rows(row_requests), self.eos_token_ids)
        return [StepResult(request, token, lp)
                for request, token, lp in zip(row_requests, result.token_ids, result.logprobs)]

    @torch.inference_mode()
    def launch(self, sched_out: SchedulerOutput, block_tables: dict[str, list[int]],
               previous: InflightStep | None) -> InflightStep | None:
        """Queues a step on the device without waiting for it: decodes whose input token is still
        pending read it from `previous` on the device, and the sampled tokens start their copy to
        the host. Only for steps whose sampling needs no host-side token history (see
        `can_launch_ahead`)."""
        _, hidden, sample_rows, row_requests = self._forward(sched_out, block_tables, previous)
        if not row_requests:
            return None
        logits = self._sampled_logits(hidden, sample_rows)
        token_ids = self.sampler.select(logits, self._sampling_rows(row_requests), self.eos_token_ids)
        ready = None
        if token_ids.is_cuda:
            host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            host.copy_(token_ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = token_ids
        return InflightStep(row_requests, {r.request_id: i for i, r in enumerate(row_requests)}, token_ids, host, ready)

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
        scheduled request needs host-side token history or per-token host work to sample
        (penalties, logprobs, prompt logprobs)."""
        for item in sched_out.scheduled:
            params = item.request.params
            if (params.logprobs is not None or params.prompt_logprobs is not None
                    or params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty):
                return False
        return True

    def capture_cuda_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """Captures decode steps for a ladder of batch sizes (see DecodeGraphs)."""
        if self.device.type != "cuda" or getattr(self.backend, "name", "") != "triton":
            return
        if self.kv_spec.error_feedback:    # its store loops over tokens on the host: not capturable
            return
        self.graphs = DecodeGraphs(self, max_batch_size, max_model_len)

    def _sdpa_backends(self):
        """Keeps SDPA off cuDNN: it builds a new plan for every new sequence length, which cost
        1.5 ms of host time per layer per decode step on an H200 (measured with torch.profiler)."""
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
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
            self.model.compute_logits(hidden[:num_logit_rows])



def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to the limit: padding wastes at most 15 rows."""
    sizes = [size for size in (1, 2, 4, 8) if size <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 16))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


class DecodeGraphs:
    """CUDA graphs of pure-decode steps, one per batch size on a ladder; a step pads to the next.

    Decode steps are launch-bound at small batch (hundreds of small kernels per step), so replaying
    a captured graph removes the host from the loop. The graphs read static buffers: token ids,
    positions, slots (-1 = padding row, skipped by the store kernel), block tables at the full
    width max_model_len / block_size (only the columns a step needs are refreshed: the kernel never
    reads past a sequence's own blocks) and context lengths (0 = padding row). Steps with prefill
    chunks, prompt logprobs or a batch over the largest size run eagerly.
    """

    def __init__(self, runner: ModelRunner, max_batch_size: int, max_model_len: int) -> None:
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        # Largest first, so smaller graphs reuse the largest one's memory pool.
        for size in reversed(self.sizes):
            meta = self._meta(size)
            with torch.inference_mode():
                for _ in range(2):   # warm-up: triton compiles/autotunes outside the capture
                    runner.model(self.input_ids[:size], self.positions[:size], runner.kv_caches, meta, runner.backend)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = runner.model(self.input_ids[:size], self.positions[:size],
                                                      runner.kv_caches, meta, runner.backend)
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
        return meta

    def try_run(self, items: list[ScheduledRequest], block_tables: dict[str, list[int]],
                previous: InflightStep | None = None):
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
        slots = np.full(size, -1, dtype=np.int64)
        slots[:count] = table_array[np.arange(count), positions // block_size].astype(np.int64) * block_size \
            + positions % block_size
        context_lens = np.zeros(size, dtype=np.int32)
        context_lens[:count] = positions + 1
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
            rows = self.runner._assign_kv_rows(items)
            token_rows, window_slots = self.runner._kv_row_tensors(items, rows)
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
