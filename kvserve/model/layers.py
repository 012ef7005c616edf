"""Building blocks shared by the model families: RMSNorm, rotary embedding, SwiGLU.

Numerics follow transformers' implementations (fp32 norm statistics, fp32 rotary angles cast to
the model dtype) so that greedy outputs match its forward pass token for token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@functools.lru_cache(maxsize=1)
def _gemv_ops():
    """kvserve.kernels.triton.gemv, or None where triton is not installed (CPU-only)."""
    try:
        from kvserve.kernels.triton import gemv
    except ImportError:
        return None
    return gemv


@functools.lru_cache(maxsize=1)
def _triton_ops():
    """(fused_ops, rotary) Triton modules, or None where triton is not installed (CPU-only)."""
    try:
        from kvserve.kernels.triton import fused_ops, rotary
    except ImportError:
        return None
    return fused_ops, rotary


@dataclass(frozen=True)
class KernelSwitches:
    """Which Triton fast paths one model's layers take on CUDA. Chosen when the model is built
    (`kvserve.model.builder.build_model`, from the engine's `fused_ops` and `gemv_max_tokens`) and
    stored on every layer module that reads them (`UsesKernelSwitches`); CUDA graphs captured
    afterwards record the choice. CPU tensors always take the torch ops.

    fused_ops: RMSNorm (+ residual), rotary and SiLU*mul as single Triton kernels: at decode batch
      sizes the ~20 small torch kernels per layer they replace cost more GPU time than the layer's
      attention. Off, every layer runs torch ops only (the skinny GEMM included).
    gemv_max_tokens: steps of at most this many tokens run the linear layers through the Triton
      skinny GEMM (kvserve/kernels/triton/gemv.py), larger ones through cuBLAS; 0: always cuBLAS.
    """

    fused_ops: bool = True
    gemv_max_tokens: int = 16

    def fused(self, x: torch.Tensor) -> bool:
        """Whether an op on `x` takes its fused Triton kernel."""
        return self.fused_ops and x.is_cuda and _triton_ops() is not None

    def gemv_for(self, x: torch.Tensor, weight: torch.Tensor):
        """The gemv module when a linear layer's call on `x` should take it, else None."""
        if x.dim() != 2 or x.shape[0] > self.gemv_max_tokens or not self.fused(x):
            return None
        ops = _gemv_ops()
        return ops if ops is not None and ops.supports(x, weight) else None


DEFAULT_KERNEL_SWITCHES = KernelSwitches()
TORCH_OPS_ONLY = KernelSwitches(fused_ops=False, gemv_max_tokens=0)


class UsesKernelSwitches:
    """Mixin of a module whose forward reads `self.switches`: the class default until the model
    builder gives every such module of a model its switches (`apply_kernel_switches`)."""

    switches: KernelSwitches = DEFAULT_KERNEL_SWITCHES


def apply_kernel_switches(model: nn.Module, switches: KernelSwitches) -> nn.Module:
    """Stores `switches` on every module of `model` that reads them; returns `model`."""
    for module in model.modules():
        if isinstance(module, UsesKernelSwitches):
            module.switches = switches
    return model


class Linear(UsesKernelSwitches, nn.Linear):
    """nn.Linear whose decode-sized calls on CUDA stream the weight through kvserve's Triton skinny
    GEMM: at batch 1-8 a linear layer's time is its weight bytes over the bandwidth it reaches, and
    that kernel reaches more of it than cuBLAS on the R1-Distill shapes (benchmarks/kernels/gemv_bench.py).
    Still an nn.Linear: weight loading and CPU weight packing see no difference."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.switches.gemv_for(x, self.weight)
        if ops is not None:
            return ops.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(UsesKernelSwitches, nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual stream (norm(x + residual), x + residual); the sum is
        rounded to the model dtype first, as transformers' `hidden = residual + hidden` does."""
        if self.switches.fused(x):
            return _triton_ops()[0].rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The same formula in one op (fewer kernels; bit-identical in fp32 on the CPU, tests/models/test_layers.py).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


def rope_inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] fp32, attention scaling) for the config's rope type.

    Scaled variants (llama3, yarn, linear, dynamic-at-init) come from transformers' own table so
    they stay in step with the checkpoints it defines.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        partial = getattr(hf_config, "partial_rotary_factor", 1.0)
        dim = int(head_dim * partial)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin for a step's positions, computed once per forward and shared by all layers."""

    def __init__(self, hf_config, head_dim: int) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inverse_frequencies(hf_config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.attention_scaling).to(dtype), (angles.sin() * self.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] (half-split layout, as in HF checkpoints)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused QKV output [T, (heads + 2 kv_heads) * D] -> views q [T, heads, D], k and v [T, kv_heads, D]."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[:, :q_size].view(num_tokens, num_heads, head_dim),
            qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
            qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim))


def rotate_queries_and_keys(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                            cos: torch.Tensor, sin: torch.Tensor, switches: KernelSwitches = DEFAULT_KERNEL_SWITCHES,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused QKV output [T, (heads + 2 kv_heads) * D] -> rotated q [T, heads, D], k, and v [T, kv_heads, D]."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if switches.fused(qkv):
        # q and k are adjacent columns of the GEMM output: rotate both in place with one kernel.
        _triton_ops()[1].rotary_inplace(qkv[:, :q_size + kv_size].view(num_tokens, num_heads + num_kv_heads, head_dim),
                                        cos, sin)
        return split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    # q and k rotated as one [T, heads + kv_heads, D] tensor: half the small ops of two calls.
    qk = apply_rotary(qkv[:, :q_size + kv_size].view(num_tokens, num_heads + num_kv_heads, head_dim), cos, sin)
    return qk[:, :num_heads], qk[:, num_heads:], qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)


def rotary_and_store_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """CUDA: rotates q/k of the fused QKV output in place and writes K/V into the paged cache in one
    kernel (kvserve/kernels/triton/rotary.py), for backends with `stores_kv_with_rotary`."""
    _triton_ops()[1].rotary_and_store_kv(qkv, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache,
                                         slot_mapping)


class SwiGLU(UsesKernelSwitches, nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemv = self.switches.gemv_for(x, self.gate_up_proj.weight) if isinstance(self.gate_up_proj, Linear) else None
        if gemv is not None:      # gate_up and SiLU*mul in one pass over the weight
            return self.down_proj(gemv.gemv(x, self.gate_up_proj.weight, self.gate_up_proj.bias, silu_mul=True))
        gate_up = self.gate_up_proj(x)
        if self.switches.fused(gate_up):
            return self.down_proj(_triton_ops()[0].silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
