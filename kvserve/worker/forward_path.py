"""How the worker runs a step's forward: the model's own forward over an attention backend, or, on a
CPU, the whole Llama/Qwen2 model in the native kernels (kvserve/model/cpu_native.py).

`--attention-backend` names the choice: auto (Triton on CUDA when it imports; on a CPU the native
forward when model, dtype and KV format allow it, else the torch reference), torch, triton, native.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.attention.backend import TorchAttentionBackend, get_attention_backend
from kvserve.attention.interface import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kvstore import KVCacheStore
from kvserve.model import cpu_native
from kvserve.model.cpu_linear import can_pack, pack_linears
from kvserve.model.interfaces import CausalLM

logger = logging.getLogger(__name__)


@dataclass
class ForwardPath:
    """The chosen forward: `native` runs the whole model where set; `backend` serves the model's
    own per-layer forward otherwise (and any per-layer hook, such as KV calibration)."""

    backend: AttentionBackend
    native: cpu_native.NativeCpuForward | None = None

    @property
    def name(self) -> str:
        return "native" if self.native is not None else self.backend.name

    def run(self, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, kv_store: KVCacheStore,
            meta: AttentionMetadata) -> torch.Tensor:
        if self.native is not None and meta.observe is None:    # the native forward records no queries
            return self.native.run(model, input_ids, positions, kv_store, meta)
        return model(input_ids, positions, kv_store, meta, self.backend)


def choose_forward(device: torch.device, name: str, model: CausalLM, dtype: torch.dtype,
                   kv_store: KVCacheStore) -> ForwardPath:
    """The forward path for `--attention-backend name`, with the model's linears packed for the CPU
    path that runs them (the native kernels' panels, or oneDNN's blocked layout for the torch path in
    fp32: kvserve/model/cpu_linear.py)."""
    if device.type == "cpu" and name in ("auto", "native"):
        reason = cpu_native.unsupported_reason(model, dtype, kv_store)
        if reason is None:
            native = cpu_native.NativeCpuForward()
            native.prepare(model, dtype)
            return ForwardPath(TorchAttentionBackend(), native)
        if name == "native":
            raise ValueError(f"--attention-backend native cannot run here: {reason}")
        logger.info("CPU forward through torch: %s", reason)
    if name == "native":
        raise ValueError("--attention-backend native is the CPU path; this device is " + device.type)
    path = ForwardPath(get_attention_backend(device, name))
    if can_pack(dtype, device):
        pack_linears(model)
    return path
