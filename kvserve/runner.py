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
from kvserve.engine.request import Request
from kvserve.engine.sampling import Sampler, SamplingRow, compute_prompt_logprobs
from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class StepResult:
    request: Request
    token_id: int
    logprobs: dict[int, float] | None


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers."""
    num_kv_heads, head_dim = model.kv_head_shape
    return 2 * model.num_kv_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, eos_token_ids: set[int]) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        num_kv_heads, head_dim = model.kv_head_shape
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(model.num_kv_layers)]
        self.backend = get_attention_backend(device)
        self.sampler = Sampler()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _slots(self, block_table: list[int], start: int, end: int) -> np.ndarray:
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
            token_ids.extend(request.all_token_ids[start:end])
            positions.append(np.arange(start, end))
            slots.append(self._slots(block_tables[request.request_id], start, end))
        meta = AttentionMetadata(slot_mapping=self._to_device(np.concatenate(slots)),
                                 num_decode_tokens=len(decodes))
        if decodes:
            context_lens = np.array([item.request.num_computed_tokens + 1 for item in decodes])
            max_context = int(context_lens.max())
            max_blocks = -(-max_context // self.block_size)
            tables = np.zeros((len(decodes), max_blocks), dtype=np.int64)
            for row, item in enumerate(decodes):
                table = block_tables[item.request.request_id][:max_blocks]
                tables[row, :len(table)] = table
            pos = np.arange(max_blocks * self.block_size)
            meta.decode_block_tables = self._to_device(tables)
            meta.decode_context_lens = self._to_device(context_lens.astype(np.int32))
            meta.decode_context_mask = self._to_device(pos[None, :] < context_lens[:, None])
        offset = len(decodes)
        for item in prefills:
            start = item.request.num_computed_tokens
            context_len = start + item.num_new_tokens
            context_slots = None
            if start > 0:
                context_slots = self._to_device(self._slots(block_tables[item.request.request_id], 0, context_len))
            meta.prefills.append(PrefillChunk(offset, item.num_new_tokens, context_len, context_slots))
            offset += item.num_new_tokens
        input_ids = self._to_device(np.asarray(token_ids, dtype=np.int64))
        positions_t = self._to_device(np.concatenate(positions).astype(np.int64))
        return ordered, input_ids, positions_t, meta

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput, block_tables: dict[str, list[int]]) -> list[StepResult]:
        ordered, input_ids, positions, meta = self.build_batch(sched_out.scheduled, block_tables)
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
        if not row_requests:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        rows = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, self._generator(r))
                for r in row_requests]
        result = self.sampler(logits, rows, self.eos_token_ids)
        return [StepResult(request, token, lp)
                for request, token, lp in zip(row_requests, result.token_ids, result.logprobs)]

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
