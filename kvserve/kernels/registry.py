"""One registry of the Triton kernels: each entry point with its torch reference, inputs and tolerance.

A `KernelCase` names a kernel entry point (`function` of a module of kvserve.kernels.triton, resolved
only when `kernel()` is called, so this module imports on a machine without triton), how the entry
point is called on the case's inputs, the torch reference that defines what it must compute
(kvserve.kernels.reference, quant_reference, mla_reference, triton.references), `make_inputs(device,
dtype, seed)` (deterministic: a seed gives the same tensors on every device, drawn on the CPU) and the
tolerance of each dtype it runs in, `(atol, rtol)` as in `torch.testing.assert_close` (0, 0: exact).

`call` and `reference` both take the inputs and return the outputs to compare (a tensor or a tuple);
neither changes the inputs (in-place kernels work on copies), so one `make_inputs` result serves both.
Outputs written by a kernel into a given buffer are poisoned with NaN first, so unwritten elements fail.

tests/kernels/test_kernel_registry.py runs every case on CUDA against its reference, every reference on the
CPU, and checks that each public kernel and each kernel module is covered here. The per-kernel test
files (tests/kernels/test_triton_kernels.py, test_kv_quant_triton.py, test_triton_gemv.py,
test_triton_model_ops.py, test_deepseek_kernels.py) keep the wide shape grids, launch configurations,
split heuristics and CUDA-graph checks that one comparison per case does not express.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from kvserve.kernels import block_copy, mla_reference, quant_reference, reference
from kvserve.kernels.triton import references
from kvserve.kvstore import KVCacheStore, build_kv_cache_spec

Inputs = dict[str, Any]
Outputs = Union[torch.Tensor, tuple[torch.Tensor, ...]]
Tolerance = Mapping[torch.dtype, tuple[float, float]]

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# Attention (kernel vs reference in the same dtype; the bf16 reference itself is ~2e-2 off fp32).
ATTENTION_TOL: Tolerance = {BF16: (3e-2, 2e-2), FP16: (4e-3, 4e-3), FP32: (1e-4, 1e-4)}
# Copies and quantize-on-store: bit-exact on the GPU.
EXACT: Tolerance = {BF16: (0.0, 0.0), FP16: (0.0, 0.0), FP32: (0.0, 0.0)}
# One unit in the last place of a value in [1, 2).
ULP = {BF16: 2.0 ** -7, FP16: 2.0 ** -10, FP32: 2.0 ** -23}
# Fused norm / activation: two roundings, each may flip when the kernel's exp or mean differs from
# torch's in the last fp32 bit: 2 ulps relative in 16 bits; fp32 (fast exp, summation order) 8 ulps.
RMS_NORM_TOL: Tolerance = {BF16: (1e-5, 2 * ULP[BF16]), FP16: (1e-5, 2 * ULP[FP16]), FP32: (1e-6, 8 * ULP[FP32])}
SILU_MUL_TOL: Tolerance = {BF16: (1e-5, 2 * ULP[BF16]), FP16: (1e-5, 2 * ULP[FP16]), FP32: (1e-6, 1e-5)}
# Rotary: torch rounds each product, then the sum; the kernel's product rounding can differ by an ulp
# (|x| <= 4 here, so 4 ulps absolute). fp32: fused multiply-add.
ROTARY_TOL: Tolerance = {BF16: (4 * ULP[BF16], ULP[BF16]), FP16: (4 * ULP[FP16], ULP[FP16]), FP32: (1e-6, 1e-5)}
# Skinny GEMM vs F.linear in fp32 on the same 16-bit operands: the output's rounding, summation order.
GEMV_TOL: Tolerance = {BF16: (2e-2, 1e-2), FP16: (2e-2, 2e-3)}
GEMV_SILU_TOL: Tolerance = {BF16: (2e-2, 2e-2), FP16: (2e-2, 4e-3)}
MLA_TOL: Tolerance = {BF16: (3e-2, 2e-2), FP32: (1e-4, 1e-4)}

_TRITON_PACKAGE = "kvserve.kernels.triton"


def triton_module(name: str):
    """kvserve.kernels.triton.<name> (imports triton)."""
    return importlib.import_module(f"{_TRITON_PACKAGE}.{name}")


@dataclass(frozen=True)
class KernelCase:
    """One kernel entry point on one family of inputs, against its torch reference."""

    name: str                                              # unique: "entry[variant]"
    module: str                                            # module of kvserve.kernels.triton
    entry: str                                             # the entry point's name in that module
    call: Callable[[Callable[..., Any], Inputs], Outputs]  # (the entry point, inputs) -> outputs
    reference: Callable[[Inputs], Outputs]                 # inputs -> the outputs the kernel must give
    make_inputs: Callable[[torch.device, torch.dtype, int], Inputs]
    tolerance: Tolerance                                   # dtype -> (atol, rtol)
    covers: tuple[str, ...] = ()                           # other kernel modules the call runs
    interpreter: bool = True     # False: Gluon / NVIDIA-only code that Triton's CPU interpreter cannot run

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(self.tolerance)

    @property
    def modules(self) -> tuple[str, ...]:
        return (self.module, *self.covers)

    def kernel(self) -> Callable[..., Any]:
        """The Triton entry point (imports its module, and so triton, on first use)."""
        return getattr(triton_module(self.module), self.entry)

    def run_kernel(self, inputs: Inputs) -> Outputs:
        return self.call(self.kernel(), inputs)

    def run_reference(self, inputs: Inputs) -> Outputs:
        return self.reference(inputs)


def as_tuple(outputs: Outputs) -> tuple[torch.Tensor, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


# ---------------------------------------------------------------------------------------------------
# input helpers (drawn on the CPU from a seeded generator, then moved: the same on every device)

def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, device, dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def _block_tables(gen: torch.Generator, context_lens: Sequence[int], block_size: int,
                  num_blocks: int) -> torch.Tensor:
    """Disjoint random blocks per sequence, padded with random (valid) block ids: [B, width] int64."""
    needed = [max(1, math.ceil(n / block_size)) for n in context_lens]
    width = max(needed)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    rows, used = [], 0
    for count in needed:
        pad = torch.randint(0, num_blocks, (width - count,), generator=gen).tolist()
        rows.append(pool[used:used + count] + pad)
        used += count
    return torch.tensor(rows, dtype=torch.int64)


def _slots(table_row: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    return torch.tensor([table_row[p // block_size] * block_size + p % block_size for p in range(start, end)],
                        dtype=torch.int64)


def ring_slots(spec, row: int, num_rows: int, positions: torch.Tensor) -> torch.Tensor:
    """Window-ring slots [T, 2] (recent window, sinks) of positions of one sequence; the trash row
    (`num_rows * ring_len`) where a position is in neither (as the runner builds them)."""
    ring_len = spec.sinks + spec.window
    slots = torch.full((positions.shape[0], 2), num_rows * ring_len, dtype=torch.long)
    end = int(positions[-1]) + 1 if positions.numel() else 0
    if spec.window:
        keep = positions >= end - spec.window
        slots[keep, 0] = row * ring_len + spec.sinks + positions[keep] % spec.window
    if spec.sinks:
        keep = positions < spec.sinks
        slots[keep, 1] = row * ring_len + positions[keep]
    return slots


def _cos_sin(gen: torch.Generator, num_tokens: int, head_dim: int, device, dtype):
    positions = torch.randint(0, 32768, (num_tokens,), generator=gen).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, D], half-split layout: kvserve.model.layers.apply_rotary (the
    model layer sits above the kernels; tests/kernels/test_kernel_registry.py checks the two agree)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# ---------------------------------------------------------------------------------------------------
# store_kv (kv_store)

def _store_kv_inputs(device, dtype, seed, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                     num_blocks=12, num_tokens=37) -> Inputs:
    gen = _generator(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = _randn(gen, *shape, device=device, dtype=dtype), _randn(gen, *shape, device=device, dtype=dtype)
    # key/value as the model makes them: views into one fused qkv projection (token stride > row).
    qkv = _randn(gen, num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device, dtype=dtype)
    _, key, value = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1                                       # graph padding: must write nothing
    return dict(key=key.view(num_tokens, num_kv_heads, head_dim), value=value.view(num_tokens, num_kv_heads, head_dim),
                k_cache=k_cache, v_cache=v_cache, slots=slots.to(device))


def _store_kv_call(kernel, x: Inputs) -> Outputs:
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    kernel(x["key"], x["value"], k_cache, v_cache, x["slots"])
    return k_cache, v_cache


def _store_kv_reference(x: Inputs) -> Outputs:
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    keep = x["slots"] >= 0
    reference.store_kv(x["key"][keep], x["value"][keep], k_cache, v_cache, x["slots"][keep])
    return k_cache, v_cache


# ---------------------------------------------------------------------------------------------------
# paged decode attention (decode_attention)

def _decode_inputs(num_heads, num_kv_heads, head_dim, block_size, context_lens, num_splits):
    def make(device, dtype, seed) -> Inputs:
        gen = _generator(seed)
        num_blocks = sum(max(1, math.ceil(n / block_size)) for n in context_lens) + 3
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return dict(k_cache=_randn(gen, *shape, device=device, dtype=dtype),
                    v_cache=_randn(gen, *shape, device=device, dtype=dtype),
                    block_tables=_block_tables(gen, context_lens, block_size, num_blocks).to(device),
                    context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
                    query=_randn(gen, len(context_lens), num_heads, head_dim, device=device, dtype=dtype, scale=2.0),
                    scale=head_dim ** -0.5, num_splits=num_splits)
    return make


def _decode_call(kernel, x: Inputs) -> Outputs:
    out = _nan_like(x["query"])
    kernel(x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"], x["scale"], out=out,
           num_splits=x["num_splits"])
    return out


def _decode_reference(x: Inputs) -> Outputs:
    return references.paged_decode_attention(x["query"], x["k_cache"], x["v_cache"], x["block_tables"],
                                             x["context_lens"], x["scale"])


# ---------------------------------------------------------------------------------------------------
# paged prefill attention (prefill_attention)

class PrefillChunkSpec(NamedTuple):
    """What plan_prefill and the reference read of a PrefillChunk (kvserve.attention.metadata)."""

    query_start: int
    query_len: int
    context_len: int
    context_slots: Optional[torch.Tensor]


def _prefill_inputs(num_heads, num_kv_heads, head_dim, block_size, chunk_specs):
    """chunk_specs: (query_len, cached prefix_len) per chunk of one step; prefix 0 = a plain prefill."""
    def make(device, dtype, seed) -> Inputs:
        gen = _generator(seed)
        context_lens = [q + p for q, p in chunk_specs]
        num_blocks = sum(math.ceil(n / block_size) for n in context_lens) + 2
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = _randn(gen, *shape, device=device, dtype=dtype)
        v_cache = _randn(gen, *shape, device=device, dtype=dtype)
        tables = _block_tables(gen, context_lens, block_size, num_blocks).tolist()
        chunks, slot_parts, offset = [], [], 0
        for (query_len, prefix_len), table in zip(chunk_specs, tables):
            context_len = query_len + prefix_len
            context_slots = _slots(table, 0, context_len, block_size).to(device) if prefix_len else None
            chunks.append(PrefillChunkSpec(offset, query_len, context_len, context_slots))
            slot_parts.append(_slots(table, prefix_len, context_len, block_size))
            offset += query_len
        return dict(query=_randn(gen, offset, num_heads, head_dim, device=device, dtype=dtype, scale=2.0),
                    k_cache=k_cache, v_cache=v_cache, chunks=chunks, slot_mapping=torch.cat(slot_parts).to(device),
                    scale=head_dim ** -0.5)
    return make


def _prefill_call(kernel, x: Inputs) -> Outputs:
    plan = triton_module("prefill_attention").plan_prefill(x["chunks"], x["slot_mapping"])
    out = _nan_like(x["query"])
    kernel(x["query"], x["k_cache"], x["v_cache"], plan, x["scale"], out=out)
    return out


def _prefill_reference(x: Inputs) -> Outputs:
    return references.paged_prefill_attention(x["query"], x["k_cache"], x["v_cache"], x["chunks"],
                                              x["slot_mapping"], x["scale"])


# ---------------------------------------------------------------------------------------------------
# fused RMSNorm (+ residual) and SiLU * mul (fused_ops)

def _rms_norm_inputs(with_residual: bool, num_rows: int = 7, hidden_size: int = 1000):
    def make(device, dtype, seed) -> Inputs:
        gen = _generator(seed)
        x = _randn(gen, num_rows, hidden_size, device=device, dtype=dtype, scale=3.0)
        weight = (1 + 0.1 * torch.randn(hidden_size, generator=gen)).to(device=device, dtype=dtype)
        residual = _randn(gen, num_rows, hidden_size, device=device, dtype=dtype) if with_residual else None
        return dict(x=x, weight=weight, eps=1e-6, residual=residual)
    return make


def _rms_norm_call(kernel, x: Inputs) -> Outputs:
    return kernel(x["x"], x["weight"], x["eps"], x["residual"])


def _rms_norm_reference(x: Inputs) -> Outputs:
    return references.rms_norm(x["x"], x["weight"], x["eps"], x["residual"])


def _silu_and_mul_inputs(device, dtype, seed, num_rows: int = 7, inner_size: int = 700) -> Inputs:
    return dict(gate_up=_randn(_generator(seed), num_rows, 2 * inner_size, device=device, dtype=dtype, scale=3.0))


# ---------------------------------------------------------------------------------------------------
# rotary (rotary)

def _rotary_inputs(num_tokens, num_heads, num_kv_heads, head_dim, store: bool, block_size=16, num_blocks=4):
    def make(device, dtype, seed) -> Inputs:
        gen = _generator(seed)
        qkv = _randn(gen, num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device, dtype=dtype)
        cos, sin = _cos_sin(gen, num_tokens, head_dim, device, dtype)
        inputs = dict(qkv=qkv, cos=cos, sin=sin, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        if store:
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
            slots[1::3] = -1                              # padding tokens: nothing stored
            inputs.update(k_cache=_randn(gen, *shape, device=device, dtype=dtype),
                          v_cache=_randn(gen, *shape, device=device, dtype=dtype), slots=slots.to(device))
        return inputs
    return make


def _qk_view(qkv: torch.Tensor, x: Inputs) -> torch.Tensor:
    heads, head_dim = x["num_heads"] + x["num_kv_heads"], x["head_dim"]
    return qkv[:, :heads * head_dim].view(qkv.shape[0], heads, head_dim)


def _rotary_inplace_call(kernel, x: Inputs) -> Outputs:
    qkv = x["qkv"].clone()
    kernel(_qk_view(qkv, x), x["cos"], x["sin"])
    return qkv


def _rotary_reference_qkv(x: Inputs) -> torch.Tensor:
    qkv = x["qkv"].clone()
    qk = _qk_view(qkv, x)
    qk.copy_(rotary_reference(qk, x["cos"], x["sin"]))
    return qkv


def _rotary_and_store_call(kernel, x: Inputs) -> Outputs:
    qkv, k_cache, v_cache = x["qkv"].clone(), x["k_cache"].clone(), x["v_cache"].clone()
    kernel(qkv, x["num_heads"], x["num_kv_heads"], x["head_dim"], x["cos"], x["sin"], k_cache, v_cache, x["slots"])
    return qkv, k_cache, v_cache


def _rotary_and_store_reference(x: Inputs) -> Outputs:
    qkv = _rotary_reference_qkv(x)
    num_heads, num_kv_heads, head_dim = x["num_heads"], x["num_kv_heads"], x["head_dim"]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    key = qkv[:, q_size:q_size + kv_size].view(-1, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size:].view(-1, num_kv_heads, head_dim)
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    keep = x["slots"] >= 0
    reference.store_kv(key[keep], value[keep], k_cache, v_cache, x["slots"][keep])
    return qkv, k_cache, v_cache


# ---------------------------------------------------------------------------------------------------
# skinny GEMM (gemv)

def _gemv_inputs(rows, out_features, in_features, bias: bool, silu_mul: bool):
    def make(device, dtype, seed) -> Inputs:
        gen = _generator(seed)
        x = _randn(gen, rows, in_features, device=device, dtype=dtype)
        weight = _randn(gen, out_features, in_features, device=device, dtype=dtype, scale=0.1 if silu_mul else 0.05)
        b = _randn(gen, out_features, device=device, dtype=dtype) if bias else None
        return dict(x=x, weight=weight, bias=b, silu_mul=silu_mul)
    return make


def _gemv_call(kernel, x: Inputs) -> Outputs:
    return kernel(x["x"], x["weight"], x["bias"], silu_mul=x["silu_mul"])


def _gemv_reference(x: Inputs) -> Outputs:
    """F.linear in fp32 on the same operands; with silu_mul, rounded as the unfused path rounds (the
    GEMM's output, then F.silu, then the product, each to the model dtype)."""
    bias = x["bias"].float() if x["bias"] is not None else None
    out = F.linear(x["x"].float(), x["weight"].float(), bias)
    if not x["silu_mul"]:
        return out
    dtype = x["x"].dtype
    gate, up = out.to(dtype).float().chunk(2, dim=-1)
    return F.silu(gate).to(dtype).float() * up


# ---------------------------------------------------------------------------------------------------
# MLA decode and the latent store (mla_decode)

def _mla_inputs(num_heads, rank, rope_dim, context_lens, block_size=16):
    def make(device, dtype, seed) -> Inputs:
        gen = _generator(seed)
        batch = len(context_lens)
        max_blocks = max(1, -(-max(context_lens) // block_size))
        num_blocks = batch * max_blocks + 3
        return dict(latent_cache=_randn(gen, num_blocks, block_size, 1, rank, device=device, dtype=dtype),
                    rope_cache=_randn(gen, num_blocks, block_size, 1, rope_dim, device=device, dtype=dtype),
                    block_tables=_block_tables(gen, context_lens, block_size, num_blocks).to(device),
                    q_latent=_randn(gen, batch, num_heads, rank, device=device, dtype=dtype, scale=0.3),
                    q_rope=_randn(gen, batch, num_heads, rope_dim, device=device, dtype=dtype, scale=0.3),
                    context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device), scale=0.13)
    return make


def _mla_call(kernel, x: Inputs) -> Outputs:
    out = _nan_like(x["q_latent"])
    kernel(x["q_latent"], x["q_rope"], x["latent_cache"], x["rope_cache"], x["block_tables"].to(torch.int32),
           x["context_lens"], x["scale"], out=out)
    return out


def _mla_reference(x: Inputs) -> Outputs:
    return mla_reference.mla_decode_attention(x["q_latent"], x["q_rope"], x["latent_cache"], x["rope_cache"],
                                              x["block_tables"], x["context_lens"], x["scale"])


def _store_latent_inputs(device, dtype, seed, rank=32, rope_dim=8, block_size=16, num_blocks=4,
                         num_tokens=5) -> Inputs:
    gen = _generator(seed)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[2] = -1                                         # a padding token
    return dict(latent=_randn(gen, num_tokens, 1, rank, device=device, dtype=dtype),
                k_rope=_randn(gen, num_tokens, 1, rope_dim, device=device, dtype=dtype),
                latent_cache=_randn(gen, num_blocks, block_size, 1, rank, device=device, dtype=dtype),
                rope_cache=_randn(gen, num_blocks, block_size, 1, rope_dim, device=device, dtype=dtype),
                slots=slots.to(device))


def _store_latent_call(kernel, x: Inputs) -> Outputs:
    latent_cache, rope_cache = x["latent_cache"].clone(), x["rope_cache"].clone()
    kernel(x["latent"], x["k_rope"], latent_cache, rope_cache, x["slots"])
    return latent_cache, rope_cache


def _store_latent_reference(x: Inputs) -> Outputs:
    latent_cache, rope_cache = x["latent_cache"].clone(), x["rope_cache"].clone()
    keep = x["slots"] >= 0
    mla_reference.store_latent(latent_cache, rope_cache, x["latent"][keep], x["k_rope"][keep], x["slots"][keep])
    return latent_cache, rope_cache


# ---------------------------------------------------------------------------------------------------
# quantize-on-store (kv_store_quant)

def _store_quant_inputs(options: Mapping[str, Any], num_kv_heads=3, head_dim=64, num_blocks=6, block_size=4):
    def make(device, dtype, seed) -> Inputs:
        gen = _generator(seed)
        spec = build_kv_cache_spec(1, num_kv_heads, head_dim, dtype, **options)
        scales = torch.logspace(-2, 1, 9)[:, None, None]         # tokens of very different magnitudes
        x = (torch.randn(9, num_kv_heads, head_dim, generator=gen) * scales).to(device=device, dtype=dtype)
        slots = torch.tensor([0, 5, 3, 9, 15, 2, 7, 22, 11], device=device)
        # Positions 3..11 of one sequence: some in the sinks, some past the window (the trash row).
        ring = ring_slots(spec, 0, 1, torch.arange(3, 12)).to(device) if spec.needs_rows else None
        return dict(spec=spec, x=x, slots=slots, ring_slots=ring, num_blocks=num_blocks, block_size=block_size,
                    device=torch.device(device))
    return make


def _store_channel_inputs(device, dtype, seed, num_kv_heads=3, head_dim=64, num_blocks=6, block_size=4) -> Inputs:
    """Per-channel int4 keys: one call holding what a step writes, a prefill chunk of two sequences'
    worth of runs (one starting inside a block, over zeros there: the re-encode path) and a decode
    token opening a block; tokens of very different magnitudes and channel offsets."""
    gen = _generator(seed)
    spec = build_kv_cache_spec(1, num_kv_heads, head_dim, dtype, kv_cache_dtype="int4", kv_quant_key_layout="channel",
                               block_size=block_size)
    scales = torch.logspace(-2, 1, 8)[:, None, None]
    x = (torch.randn(8, num_kv_heads, head_dim, generator=gen) * scales
         + torch.linspace(-2, 2, head_dim)).to(device=device, dtype=dtype)
    slots = torch.tensor([20, 9, 10, 11, 12, 13, 14, 15], device=device)
    return dict(spec=spec, x=x, slots=slots, ring_slots=None, num_blocks=num_blocks, block_size=block_size,
                device=torch.device(device))


def _quantized_part(x: Inputs):
    """A fresh, zeroed store's first quantized part (keys of layer 0)."""
    layer = KVCacheStore.allocate(x["spec"], x["num_blocks"], x["block_size"], x["device"], num_rows=1)[0]
    return layer.key


def _part_state(part) -> Outputs:
    """What a store writes: payload, scales (unless static), the window ring but its trash row (its
    last, written by several tokens in any order)."""
    state = [part.payload]
    if part.scales is not None:
        state.append(part.scales)
    if part.window is not None:
        state.append(part.window[:-1])
    return tuple(state)


def _store_quant_call(kernel, x: Inputs) -> Outputs:
    part = _quantized_part(x)
    kernel(x["x"], part, x["slots"], x["ring_slots"])
    return _part_state(part)


def _store_quant_reference(x: Inputs) -> Outputs:
    part = _quantized_part(x)
    quant_reference.store_part(part, x["x"], x["slots"], x["ring_slots"])
    return _part_state(part)


# ---------------------------------------------------------------------------------------------------
# fused-dequant decode over quantized caches (decode_attention_quant: pipelined, fast, generic)

def _quant_decode_inputs(options: Mapping[str, Any], implementation: str, num_splits: int,
                         num_heads=28, num_kv_heads=4, head_dim=128, block_size=16,
                         context_lens=(300, 17, 0, 150), rows=(2, 0, 1, 3)):
    def make(device, dtype, seed) -> Inputs:
        gen = _generator(seed)
        spec = build_kv_cache_spec(1, num_kv_heads, head_dim, dtype, **options)
        num_rows = len(context_lens)
        num_blocks = sum(max(1, math.ceil(n / block_size)) for n in context_lens) + 3
        tables = _block_tables(gen, context_lens, block_size, num_blocks)
        k_cache, v_cache = KVCacheStore.allocate(spec, num_blocks, block_size, device, num_rows=num_rows)[0]
        for b, length in enumerate(context_lens):
            positions = torch.arange(length)
            slots = (tables[b, positions // block_size] * block_size + positions % block_size).to(device)
            ring = ring_slots(spec, rows[b], num_rows, positions).to(device) if spec.needs_rows else None
            for cache in (k_cache, v_cache):
                quant_reference.store_part(cache, _randn(gen, length, num_kv_heads, head_dim, device=device,
                                                         dtype=dtype), slots, ring)
        return dict(query=_randn(gen, len(context_lens), num_heads, head_dim, device=device, dtype=dtype),
                    k_cache=k_cache, v_cache=v_cache, block_tables=tables.to(device),
                    context_lens=torch.tensor(context_lens, device=device), scale=head_dim ** -0.5,
                    seq_rows=torch.tensor(rows, device=device) if spec.needs_rows else None,
                    num_splits=num_splits, implementation=implementation)
    return make


def _quant_decode_call(kernel, x: Inputs) -> Outputs:
    out = _nan_like(x["query"])
    kernel(x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"], x["scale"], x["seq_rows"],
           out=out, num_splits=x["num_splits"], implementation=x["implementation"])
    return out


def _quant_decode_reference(x: Inputs) -> Outputs:
    return quant_reference.paged_decode_attention(x["query"], x["k_cache"], x["v_cache"], x["block_tables"],
                                                  x["context_lens"], x["scale"], x["seq_rows"])


# ---------------------------------------------------------------------------------------------------
# the registry

_QUANT_FAST = ("decode_attention_quant_config", "code_conversion", "decode_attention")
_QUANT_PIPELINED = ("decode_attention_quant_pipelined", "decode_attention_quant_config", "code_conversion",
                    "decode_attention")


def _quant_decode_case(variant: str, options: Mapping[str, Any], implementation: str, tolerance: Tolerance,
                       covers: tuple[str, ...], interpreter: bool = True, num_splits: int = 3) -> KernelCase:
    return KernelCase(f"paged_decode_attention_quant[{variant}]", "decode_attention_quant",
                      "paged_decode_attention_quant", _quant_decode_call, _quant_decode_reference,
                      _quant_decode_inputs(options, implementation, num_splits), tolerance, covers, interpreter)


# ---------------------------------------------------------------------------------------------------
# block copy between paged pieces and rows of bytes (block_copy)

def _block_rows_inputs(to_rows: bool, host_rows: bool):
    """The pieces of a store (a model-dtype part, an int8 payload with its fp32 scales, an odd-sized
    piece that forces narrow words), rows in three segments (pinned host memory with `host_rows`
    when the device is a GPU), ids out of order and across segments."""
    def make(device, dtype, seed) -> Inputs:
        gen = _generator(seed)
        pieces = [_randn(gen, 9, 4, 2, 16, device=device, dtype=dtype),
                  torch.randint(-128, 127, (9, 4, 2, 8), generator=gen, dtype=torch.int8).to(device),
                  _randn(gen, 9, 4, 2, 1, device=device, dtype=FP32),
                  torch.randint(0, 255, (9, 3), generator=gen, dtype=torch.uint8).to(device)]
        row_nbytes = sum(block_copy.piece_nbytes(piece) for piece in pieces)
        on_host = host_rows and device.type == "cuda"
        segments = []
        for rows in (4, 4, 3):
            segment = torch.randint(0, 255, (rows, row_nbytes), generator=gen, dtype=torch.uint8)
            segments.append(segment.pin_memory() if on_host else segment.to(device))
        return dict(pieces=pieces, segments=segments, block_ids=torch.tensor([8, 0, 3, 5, 6]),
                    row_ids=torch.tensor([10, 1, 4, 7, 0]), rows_per_segment=4, to_rows=to_rows)
    return make


def _block_rows_run(copy, x: Inputs) -> Outputs:
    pieces = [piece.clone() for piece in x["pieces"]]
    segments = [segment.clone().pin_memory() if segment.is_pinned() else segment.clone() for segment in x["segments"]]
    copy(pieces, x["block_ids"], segments, x["row_ids"], x["rows_per_segment"], x["to_rows"])
    if pieces[0].is_cuda:
        torch.cuda.synchronize()
    # As bytes: rows written into a float piece may hold NaN patterns.
    return tuple(p.contiguous().view(torch.uint8).cpu() for p in pieces) + tuple(s.cpu() for s in segments)


CASES: tuple[KernelCase, ...] = (
    KernelCase("store_kv[gqa3-d64]", "kv_store", "store_kv", _store_kv_call, _store_kv_reference,
               _store_kv_inputs, EXACT),
    KernelCase("copy_block_rows[to-rows-device]", "block_copy", "copy_block_rows", _block_rows_run,
               lambda x: _block_rows_run(block_copy.copy_block_rows, x), _block_rows_inputs(True, False), EXACT),
    KernelCase("copy_block_rows[from-pinned-host-rows]", "block_copy", "copy_block_rows", _block_rows_run,
               lambda x: _block_rows_run(block_copy.copy_block_rows, x), _block_rows_inputs(False, True), EXACT),
    KernelCase("copy_block_rows[to-pinned-host-rows]", "block_copy", "copy_block_rows", _block_rows_run,
               lambda x: _block_rows_run(block_copy.copy_block_rows, x), _block_rows_inputs(True, True), EXACT),
    KernelCase("paged_decode_attention[gqa7-d128-auto-splits]", "decode_attention", "paged_decode_attention",
               _decode_call, _decode_reference, _decode_inputs(28, 4, 128, 16, [1, 15, 16, 17, 95, 400, 0], None),
               ATTENTION_TOL),
    KernelCase("paged_decode_attention[gqa3-d64-one-split]", "decode_attention", "paged_decode_attention",
               _decode_call, _decode_reference, _decode_inputs(9, 3, 64, 32, [1, 31, 32, 33, 130], 1),
               ATTENTION_TOL),
    KernelCase("paged_prefill_attention[gqa7-d128]", "prefill_attention", "paged_prefill_attention",
               _prefill_call, _prefill_reference,
               _prefill_inputs(28, 4, 128, 16, [(11, 0), (1, 0), (17, 16), (3, 40), (5, 1), (1, 33)]), ATTENTION_TOL),
    KernelCase("paged_prefill_attention[mha-d64-bs32]", "prefill_attention", "paged_prefill_attention",
               _prefill_call, _prefill_reference, _prefill_inputs(8, 8, 64, 32, [(37, 0), (9, 50), (2, 17)]),
               ATTENTION_TOL),
    KernelCase("rms_norm[plain]", "fused_ops", "rms_norm", _rms_norm_call, _rms_norm_reference,
               _rms_norm_inputs(False), RMS_NORM_TOL),
    KernelCase("rms_norm[residual]", "fused_ops", "rms_norm", _rms_norm_call, _rms_norm_reference,
               _rms_norm_inputs(True), RMS_NORM_TOL),
    KernelCase("silu_and_mul[7x700]", "fused_ops", "silu_and_mul", lambda kernel, x: kernel(x["gate_up"]),
               lambda x: references.silu_and_mul(x["gate_up"]), _silu_and_mul_inputs, SILU_MUL_TOL),
    KernelCase("rotary_inplace[gqa3-d64]", "rotary", "rotary_inplace", _rotary_inplace_call, _rotary_reference_qkv,
               _rotary_inputs(7, 9, 3, 64, store=False), ROTARY_TOL),
    KernelCase("rotary_inplace[gqa7-d128]", "rotary", "rotary_inplace", _rotary_inplace_call, _rotary_reference_qkv,
               _rotary_inputs(33, 28, 4, 128, store=False), ROTARY_TOL),
    KernelCase("rotary_and_store_kv[gqa3-d64]", "rotary", "rotary_and_store_kv", _rotary_and_store_call,
               _rotary_and_store_reference, _rotary_inputs(7, 9, 3, 64, store=True), ROTARY_TOL),
    KernelCase("gemv[7x257x136-bias]", "gemv", "gemv", _gemv_call, _gemv_reference,
               _gemv_inputs(7, 257, 136, bias=True, silu_mul=False), GEMV_TOL),
    KernelCase("gemv[16x33x1024]", "gemv", "gemv", _gemv_call, _gemv_reference,
               _gemv_inputs(16, 33, 1024, bias=False, silu_mul=False), GEMV_TOL),
    KernelCase("gemv[silu_mul-5x140x520-bias]", "gemv", "gemv", _gemv_call, _gemv_reference,
               _gemv_inputs(5, 140, 520, bias=True, silu_mul=True), GEMV_SILU_TOL),
    KernelCase("mla_decode_attention[h16-r512-dr64]", "mla_decode", "mla_decode_attention", _mla_call,
               _mla_reference, _mla_inputs(16, 512, 64, [1, 37, 0, 300]), MLA_TOL, ("decode_attention",)),
    KernelCase("mla_decode_attention[h128-r512-dr64]", "mla_decode", "mla_decode_attention", _mla_call,
               _mla_reference, _mla_inputs(128, 512, 64, [150, 2, 0]), MLA_TOL, ("decode_attention",)),
    KernelCase("store_latent[r32-dr8]", "mla_decode", "store_latent", _store_latent_call, _store_latent_reference,
               _store_latent_inputs, {BF16: (0.0, 0.0), FP32: (0.0, 0.0)}),
    KernelCase("store_quantized[int8]", "kv_store_quant", "store_quantized", _store_quant_call,
               _store_quant_reference, _store_quant_inputs({"kv_cache_dtype": "int8"}), {BF16: (0.0, 0.0)}),
    KernelCase("store_quantized[int4-window-sinks]", "kv_store_quant", "store_quantized", _store_quant_call,
               _store_quant_reference,
               _store_quant_inputs({"kv_cache_dtype": "int4", "kv_quant_key_layout": "token"}, head_dim=128),
               {BF16: (0.0, 0.0)}),
    KernelCase("store_quantized[int4-keys-per-channel]", "kv_store_quant", "store_quantized", _store_quant_call,
               _store_quant_reference, _store_channel_inputs, {BF16: (0.0, 0.0), FP32: (0.0, 0.0)}),
    _quant_decode_case("fast-int8", {"kv_cache_dtype": "int8"}, "fast", ATTENTION_TOL, _QUANT_FAST),
    _quant_decode_case("fast-fp8_e4m3", {"kv_cache_dtype": "fp8_e4m3"}, "fast", ATTENTION_TOL, _QUANT_FAST),
    _quant_decode_case("fast-int4-window-sinks", {"kv_cache_dtype": "int4", "kv_quant_key_layout": "token"}, "fast",
                       ATTENTION_TOL, _QUANT_FAST),
    _quant_decode_case("fast-int4-keys-per-channel", {"kv_cache_dtype": "int4"}, "fast", ATTENTION_TOL, _QUANT_FAST),
    _quant_decode_case("generic-int4-keys-per-channel-window", {"kv_cache_dtype": "int4", "kv_quant_window": 5,
                                                                "kv_quant_sinks": 3}, "generic", ATTENTION_TOL,
                       ("decode_attention",), num_splits=2),
    _quant_decode_case("generic-k-int8-v-plain-window",
                       {"kv_cache_dtype_k": "int8", "kv_cache_dtype_v": "auto", "kv_quant_window": 5,
                        "kv_quant_sinks": 3}, "generic", ATTENTION_TOL, ("decode_attention",), num_splits=1),
    _quant_decode_case("pipelined-int8", {"kv_cache_dtype": "int8"}, "pipelined",
                       {BF16: ATTENTION_TOL[BF16], FP16: ATTENTION_TOL[FP16]}, _QUANT_PIPELINED, interpreter=False),
    _quant_decode_case("pipelined-int4-keys-per-channel", {"kv_cache_dtype": "int4"}, "pipelined",
                       {BF16: ATTENTION_TOL[BF16], FP16: ATTENTION_TOL[FP16]}, _QUANT_PIPELINED, interpreter=False),
    _quant_decode_case("pipelined-int4-window-sinks", {"kv_cache_dtype": "int4", "kv_quant_key_layout": "token"},
                       "pipelined",
                       {BF16: ATTENTION_TOL[BF16], FP16: ATTENTION_TOL[FP16]}, _QUANT_PIPELINED, interpreter=False),
)

# Names kvserve.kernels.triton exports that are no kernel: launch helpers and configuration types,
# with the kernel they serve (tests/kernels/test_kernel_registry.py checks every other export has a case).
HELPER_EXPORTS: dict[str, str] = {
    "choose_num_splits": "paged_decode_attention",
    "decode_workspace": "paged_decode_attention",
    "decode_num_splits": "paged_decode_attention",
    "DecodeConfig": "paged_decode_attention",
    "plan_prefill": "paged_prefill_attention",
    "PrefillPlan": "paged_prefill_attention",
    "PrefillConfig": "paged_prefill_attention",
}
# Modules of kvserve.kernels.triton that hold no kernel: shared launch helpers and the torch references.
NON_KERNEL_MODULES = ("_common", "references")


def case(name: str) -> KernelCase:
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no kernel case {name!r}; known: {', '.join(c.name for c in CASES)}")


def cases_for(entry: str) -> list[KernelCase]:
    return [c for c in CASES if c.entry == entry]
