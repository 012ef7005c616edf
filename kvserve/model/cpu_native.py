"""The Llama/Qwen2 forward pass on the CPU through the native kernels (kvserve/kernels/cpu).

On a CPU, a decode step through torch is a few hundred small ops whose dispatch and thread fork/join
cost as much as the arithmetic, and torch cannot stream bf16 weights on CPUs without AVX512-BF16.
Here the whole step is one C call: the weights are packed once into 16-column panels (fp32, or bf16
when the model runs in bf16: half the bytes per decode step), activations and the residual stream are
fp32 throughout, and attention reads the paged cache in place for decodes and prefill chunks alike.

`NativeCpuForward` runs in place of the model's own forward; the worker chooses it
(kvserve/worker/forward_path.py: `--attention-backend auto` on CPU, or `native`).
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels.cpu import hugepages
from kvserve.kernels.cpu.weight_formats import BF16_PANELS, FP32_PANELS
from kvserve.kvstore import KVCacheStore

logger = logging.getLogger(__name__)

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class NativeLinear(nn.Module):
    """y = x W^T + b with W packed for kvserve.kernels.cpu.linear; fp32 in, fp32 out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bf16: bool,
                 destination: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight", cpu_kernels.pack_weight(weight, bf16, destination), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        self.weight_format = BF16_PANELS if bf16 else FP32_PANELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).float()
        out = cpu_kernels.linear(flat, self.packed_weight, self.out_features, self.bias)
        return out.view(*leading, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight={self.packed_weight.dtype}")


def unsupported_reason(model: nn.Module, dtype: torch.dtype, kv_store: KVCacheStore) -> str | None:
    """Why the native path cannot run this model/format here, or None when it can."""
    from kvserve.model.llama import LlamaForCausalLM
    if not cpu_kernels.available():
        return "the native CPU kernels are not available (no C compiler, or KVSERVE_DISABLE_CPU_KERNELS=1)"
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} has no native CPU forward (Llama and Qwen2 do)"
    if dtype not in NATIVE_DTYPES:
        return f"the native CPU path runs fp32 or bf16 models, not {dtype}"
    for layer in kv_store:
        if not layer.full_precision or layer.key.dtype not in NATIVE_DTYPES:
            return "quantized KV caches run on the torch path on CPU"
    return None


def pack_model(model: nn.Module, dtype: torch.dtype) -> None:
    """Replaces the model's linears by NativeLinear (idempotent). A tied lm_head gets its own packed
    copy; the embedding keeps its dense table for lookups. QuantizedLinears (GGUF blocks) stay as they
    are: the native forward reads their blocks."""
    bf16 = dtype == torch.bfloat16
    linears = [(parent, name, child) for parent in list(model.modules())
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    # All packed weights in one huge-page buffer (kernels/cpu/hugepages.py: each decode step streams
    # them all), each packed straight into its place.
    destinations = hugepages.views([(cpu_kernels.packed_shape(*child.weight.shape),
                                     torch.bfloat16 if bf16 else torch.float32) for _, _, child in linears])
    for (parent, name, child), destination in zip(linears, destinations):
        setattr(parent, name, NativeLinear(child.weight, child.bias, bf16, destination))


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class NativeCpuForward:
    """Runs the whole Llama/Qwen2 model per step in kvserve.kernels.cpu (see the module docstring)."""

    def __init__(self) -> None:
        # (dims, layer pointers, final norm, the KV store they point into): built once per store;
        # the pointers stay valid because weights and caches never move.
        self._prepared: tuple | None = None
        self._workspace = torch.empty(0, dtype=torch.float32)

    def prepare(self, model: nn.Module, dtype: torch.dtype) -> None:
        pack_model(model, dtype)
        # Norm weights in fp32 for the kernels (a bf16 model keeps bf16 parameters).
        for module in model.modules():
            if hasattr(module, "eps") and isinstance(getattr(module, "weight", None), torch.Tensor):
                module.native_weight = module.weight.detach().float().contiguous()

    def _layers(self, model, kv_store: KVCacheStore) -> tuple:
        if self._prepared is not None and self._prepared[3] is kv_store:
            return self._prepared
        attn0 = model.layers[0].self_attn
        k0 = kv_store[0].key
        dims = cpu_kernels.ModelDims(
            hidden_size=model.config.hidden_size, num_heads=attn0.num_heads, num_kv_heads=attn0.num_kv_heads,
            head_dim=attn0.head_dim, intermediate_size=model.layers[0].mlp.intermediate_size,
            num_layers=len(model.layers), block_size=k0.shape[1], rms_eps=model.norm.eps, attn_scale=attn0.scale,
            kv_bf16=int(k0.dtype == torch.bfloat16))
        layers = (cpu_kernels.LayerPointers * len(model.layers))()
        for entry, layer, (k_cache, v_cache) in zip(layers, model.layers, kv_store):
            attn, mlp = layer.self_attn, layer.mlp
            entry.input_norm = layer.input_layernorm.native_weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.native_weight.data_ptr()
            for prefix, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                   ("down", mlp.down_proj)):
                # A NativeLinear's panels or a QuantizedLinear's GGUF blocks (kernels/cpu/weight_formats.py).
                setattr(entry, f"{prefix}_w", linear.packed_weight.data_ptr())
                setattr(entry, f"{prefix}_fmt", linear.weight_format)
                setattr(entry, f"{prefix}_b", _pointer(linear.bias))
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self._prepared = (dims, layers, model.norm.native_weight, kv_store)
        return self._prepared

    def run(self, model, input_ids: torch.Tensor, positions: torch.Tensor, kv_store: KVCacheStore,
            meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden] fp32 for the flat token batch."""
        dims, layers, final_norm, _ = self._layers(model, kv_store)
        num_tokens = input_ids.shape[0]
        residual = model.embed_tokens(input_ids).float().contiguous()
        cos, sin = model.rotary(positions, torch.float32)
        cos, sin = cos.contiguous(), sin.contiguous()
        block_tables, token_seqs, context_lens = token_tables(meta, num_tokens, dims.block_size)
        longest = int(context_lens.max()) if num_tokens else 0
        library = cpu_kernels.library()
        needed = library.kvs_llama_workspace(ctypes.byref(dims), num_tokens, longest)
        if self._workspace.numel() < needed:
            self._workspace = torch.empty(needed, dtype=torch.float32)
        out = torch.empty_like(residual)
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        status = library.kvs_llama_forward(
            ctypes.byref(dims), layers, final_norm.data_ptr(), residual.data_ptr(), out.data_ptr(), num_tokens,
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), token_seqs.data_ptr(), context_lens.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], self._workspace.data_ptr(), self._workspace.numel())
        if status == -1:
            raise RuntimeError("native CPU forward: workspace too small")   # a bug: sized just above
        if status != 0:
            raise MemoryError("native CPU forward: no memory for a quantized linear's int8 activations")
        return out


def token_tables(meta: AttentionMetadata, num_tokens: int, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block tables [S, max_blocks] int64, each token's sequence row [T] int32, each token's context
    length [T] int32) from the step's metadata: decodes first (one row each), then one row per
    prefill chunk, whose tokens attend causally (context = position + 1)."""
    tables, seqs, lens = [], [], []
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        tables.append(meta.decode_block_tables.to(torch.int64))
        seqs.append(torch.arange(num_decodes, dtype=torch.int32))
        lens.append(meta.decode_context_lens.to(torch.int32))
    for row, chunk in enumerate(meta.prefills, start=num_decodes):
        slots = chunk.context_slots
        if slots is None:      # the chunk is the whole context: its own slots
            slots = meta.slot_mapping[chunk.query_start:chunk.query_start + chunk.query_len]
        tables.append(torch.div(slots[::block_size], block_size, rounding_mode="floor").to(torch.int64)[None])
        seqs.append(torch.full((chunk.query_len,), row, dtype=torch.int32))
        first = chunk.context_len - chunk.query_len + 1
        lens.append(torch.arange(first, chunk.context_len + 1, dtype=torch.int32))
    if not tables:
        empty = torch.zeros(0, dtype=torch.int32)
        return torch.zeros(0, 1, dtype=torch.int64), empty, empty
    width = max(table.shape[1] for table in tables)
    if len(tables) == 1:
        block_tables = tables[0].contiguous()
    else:
        block_tables = torch.zeros(sum(table.shape[0] for table in tables), width, dtype=torch.int64)
        row = 0
        for table in tables:
            block_tables[row:row + table.shape[0], :table.shape[1]] = table
            row += table.shape[0]
    token_seqs = torch.cat(seqs) if len(seqs) > 1 else seqs[0]
    context_lens = torch.cat(lens) if len(lens) > 1 else lens[0]
    if token_seqs.shape[0] != num_tokens:
        raise ValueError(f"metadata covers {token_seqs.shape[0]} tokens, the batch has {num_tokens}")
    return block_tables, token_seqs.contiguous(), context_lens.contiguous()
