"""Native CPU kernels (llama_forward.c), compiled once on first use and called through ctypes.

What lives here: a GEMM over weights packed once into 16-column panels (fp32, or bf16 widened in
registers, which torch's CPU matmul cannot do without AVX512-BF16), paged attention that reads K/V
blocks where they lie, and the whole Llama/Qwen2 forward pass built from them
(kvserve/model/cpu_native.py drives it).

The C file is compiled with the machine's C compiler (`cc`, as Triton does for its launchers) into
~/.cache/kvserve/cpu_kernels, keyed by the source's and flags' hash, so a machine builds it once (a
few seconds). It is built with OpenMP and linked against the libgomp torch has already loaded (the
same soname), so its parallel loops run on torch's own thread pool. Without a compiler, or if the
build fails, `available()` is False and callers keep the torch path. KVSERVE_DISABLE_CPU_KERNELS=1
turns the kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvserve import envs

logger = logging.getLogger(__name__)

# One library from both files: the forward (llama_forward.c) calls the GGUF-block GEMM (quant_gemm.c).
_SOURCES = (Path(__file__).with_name("llama_forward.c"), Path(__file__).with_name("quant_gemm.c"))
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c11"]
_OPENMP = ["-fopenmp"]
PANEL = 16
# Stored position -> column within a bf16 panel (llama_forward.c: PANEL_ORDER).
_BF16_PANEL_ORDER = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32


class ModelDims(ctypes.Structure):
    _fields_ = [("hidden_size", _i64), ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
                ("intermediate_size", _i64), ("num_layers", _i64), ("block_size", _i64),
                ("rms_eps", ctypes.c_float), ("attn_scale", ctypes.c_float), ("kv_bf16", _i32)]


class LayerPointers(ctypes.Structure):
    _fields_ = ([(name, _p) for name in ("input_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w",
                                         "gate_up_b", "down_w", "down_b", "k_cache", "v_cache")]
                + [(name, _i32) for name in ("qkv_fmt", "o_fmt", "gate_up_fmt", "down_fmt")])


def _cache_dir() -> Path:
    return Path(envs.cache_dir()) / "cpu_kernels"


def _build(compiler: str, flags: list[str]) -> Path | None:
    source = b"".join(path.read_bytes() for path in _SOURCES)
    digest = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"llama_forward_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, *map(str, _SOURCES), "-o", str(built), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("building the CPU kernels with %s failed:\n%s", " ".join(flags), result.stderr[-2000:])
            return None
        os.replace(built, target)   # atomic: a concurrent builder never sees a partial file
    return target


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if envs.KVSERVE_DISABLE_CPU_KERNELS.is_on():
        return None
    compiler = envs.CC.get() or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found; the CPU uses the torch path")
        return None
    # Without OpenMP the kernels still work, on one thread.
    target = _build(compiler, _FLAGS + _OPENMP) or _build(compiler, _FLAGS)
    if target is None:
        return None
    library = _bind(ctypes.CDLL(str(target)))
    logger.info("native CPU kernels: %s; GGUF-block dot products: %s", target.name,
                library.kvs_quant_isa().decode())
    return library


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    library.kvs_linear.restype = None
    library.kvs_linear.argtypes = [_p, _i64, _i64, _p, _i32, _p, _p, _i64, _i32]
    library.kvs_paged_attention.restype = None
    library.kvs_paged_attention.argtypes = ([_p, _i64, _p, _i64, _i64, _p, _p, _i32, _p, _i64, _p, _p]
                                            + [_i64] * 4 + [ctypes.c_float, _p, _i64])
    library.kvs_attention_scratch.restype = _i64
    library.kvs_attention_scratch.argtypes = [_i64, _i64]
    library.kvs_argmax_rows.restype = None
    library.kvs_argmax_rows.argtypes = [_p, _i64, _i64, _p]
    library.kvs_llama_workspace.restype = _i64
    library.kvs_llama_workspace.argtypes = [ctypes.POINTER(ModelDims), _i64, _i64]
    library.kvs_fma_gflops.restype = ctypes.c_double
    library.kvs_fma_gflops.argtypes = [ctypes.c_double, _p, ctypes.c_int32]
    library.kvs_llama_forward.restype = ctypes.c_int
    library.kvs_llama_forward.argtypes = ([ctypes.POINTER(ModelDims), ctypes.POINTER(LayerPointers), _p, _p, _p, _i64]
                                          + [_p] * 6 + [_i64, _p, _i64])
    library.kvs_quant_linear.restype = ctypes.c_int
    library.kvs_quant_linear.argtypes = [_p, _i64, _i64, _p, _i32, _p, _p, _i64, _i32]
    library.kvs_quant_isa.restype = ctypes.c_char_p
    library.kvs_quant_isa.argtypes = []
    library.kvs_quant_packed_bytes.restype = _i64
    library.kvs_quant_packed_bytes.argtypes = [_i32, _i64, _i64]
    library.kvs_quant_repack.restype = ctypes.c_int
    library.kvs_quant_repack.argtypes = [_p, _i32, _i64, _i64, _p]
    return library


def available() -> bool:
    return _library() is not None


def library() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (see kvserve.kernels.cpu.available)")
    return lib


# --- packed weights and the GEMM -------------------------------------------------------------------
def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """Shape of pack_weight's result for an [out_features, in_features] weight."""
    return -(-out_features // PANEL), in_features, PANEL


def pack_weight(weight: torch.Tensor, bf16: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] -> panels [ceil(N/16), K, 16] (zero-padded), fp32 or bf16 in the kernel's column order;
    written into `out` (contiguous, packed_shape, that dtype) when given."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = torch.zeros(panels * PANEL, in_features, dtype=torch.float32)
    padded[:out_features] = weight.detach().float()
    packed = padded.view(panels, PANEL, in_features).transpose(1, 2)     # [P, K, 16]
    if bf16:
        packed = packed[:, :, _BF16_PANEL_ORDER].to(torch.bfloat16)
    if out is None:
        return packed.contiguous()
    if out.shape != packed.shape or out.dtype != packed.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(packed.shape)} {packed.dtype} tensor")
    return out.copy_(packed)


def _linear_output(rows: int, out_features: int, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
    """The [rows, out_features] fp32 result of a linear: `out` checked, or a new one."""
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs an output to add into")
        return torch.empty(rows, out_features, dtype=torch.float32)
    if out.shape != (rows, out_features) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("the output must be a contiguous fp32 [M, N] tensor")
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """x [M, K] fp32 @ W^T (+ bias) -> [M, N] fp32; with `accumulate`, adds into `out` instead."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError("the native linear takes a 2-D fp32 input")
    x = x.contiguous()
    rows, in_features = x.shape
    if packed.shape[1] != in_features:
        raise ValueError(f"input has {in_features} features, the weight {packed.shape[1]}")
    out = _linear_output(rows, out_features, out, accumulate)
    library().kvs_linear(x.data_ptr(), rows, in_features, packed.data_ptr(), int(packed.dtype == torch.bfloat16),
                         None if bias is None else bias.data_ptr(), out.data_ptr(), out_features, int(accumulate))
    return out


def quant_isa() -> str | None:
    """Which instructions the GGUF-block dot products use here (avx512-vnni, avx-vnni, avx2, scalar)."""
    return library().kvs_quant_isa().decode() if available() else None


def repack_blocks(blocks: torch.Tensor, fmt: int, in_features: int, lib: ctypes.CDLL | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF blocks uint8 [N, bytes per row] of format code `fmt` (weight_formats.py) -> the layout
    quant_gemm.c streams (rows interleaved by 8: see its header), uint8 1-D; into `out` when given."""
    lib = lib or library()
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError("GGUF blocks come as a uint8 [rows, bytes per row] tensor")
    blocks = blocks.contiguous()
    size = lib.kvs_quant_packed_bytes(fmt, blocks.shape[0], in_features)
    if size < 0:
        raise ValueError(f"weight format {fmt} with {in_features} input features has no quantized kernel")
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    elif out.shape != (size,) or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 tensor of {size} bytes")
    lib.kvs_quant_repack(blocks.data_ptr(), fmt, blocks.shape[0], in_features, out.data_ptr())
    return out


def quant_linear(x: torch.Tensor, packed: torch.Tensor, fmt: int, out_features: int,
                 bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 accumulate: bool = False, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W^T (+ bias) -> [M, N] fp32 with W in repack_blocks's layout (format code
    `fmt`); with `accumulate`, adds into `out`. `lib`: another build of the kernels (the tests' scalar one)."""
    lib = lib or library()
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError("the quantized linear takes a 2-D fp32 input")
    x = x.contiguous()
    rows, in_features = x.shape
    if packed.dtype != torch.uint8 or packed.shape != (lib.kvs_quant_packed_bytes(fmt, out_features, in_features),):
        raise ValueError(f"packed weight does not hold format {fmt} for [{out_features}, {in_features}]")
    out = _linear_output(rows, out_features, out, accumulate)
    status = lib.kvs_quant_linear(x.data_ptr(), rows, in_features, packed.data_ptr(), fmt,
                                  None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                  int(accumulate))
    if status != 0:
        raise MemoryError("quantized linear: no memory for the quantized activations")
    return out


def build_variant(flags: list[str]) -> ctypes.CDLL | None:
    """The kernels built with other compiler flags (e.g. without -march=native: the scalar fallback),
    loaded beside the main build; None when it does not build."""
    compiler = envs.CC.get() or shutil.which("cc") or shutil.which("gcc")
    target = (_build(compiler, flags + _OPENMP) or _build(compiler, flags)) if compiler else None
    return None if target is None else _bind(ctypes.CDLL(str(target)))


# --- paged attention ---------------------------------------------------------------------------------
def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    token_seqs: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [T, heads, D] fp32; caches [blocks, block_size, kv_heads, D] fp32 or bf16 (contiguous);
    block_tables [S, max_blocks]; token t attends to the first context_lens[t] tokens of sequence
    token_seqs[t]. Returns [T, heads, D] fp32."""
    if query.dtype != torch.float32 or k_cache.dtype not in (torch.float32, torch.bfloat16) \
            or v_cache.dtype != k_cache.dtype:
        raise ValueError("the CPU attention kernel takes fp32 queries and fp32 or bf16 caches")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(k_cache.shape)}")
    if token_seqs.shape != (num_tokens,) or context_lens.shape != (num_tokens,):
        raise ValueError("token_seqs and context_lens need one entry per query token")
    query = query.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    token_seqs = token_seqs.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    max_blocks = block_tables.shape[1]
    longest = int(context_lens.max()) if num_tokens else 0
    if longest > max_blocks * block_size:
        raise ValueError("a context length exceeds its block table")
    if num_tokens and (int(token_seqs.min()) < 0 or int(token_seqs.max()) >= block_tables.shape[0]):
        raise ValueError("a token's sequence index is outside the block tables")
    out = torch.empty_like(query)
    per_thread = library().kvs_attention_scratch(num_heads, longest)
    scratch = torch.empty(per_thread * max(1, torch.get_num_threads()), dtype=torch.float32)
    width = num_heads * head_dim
    library().kvs_paged_attention(query.data_ptr(), width, out.data_ptr(), width, num_tokens, k_cache.data_ptr(),
                                  v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16), block_tables.data_ptr(),
                                  max_blocks, token_seqs.data_ptr(), context_lens.data_ptr(), num_heads, num_kv_heads,
                                  head_dim, block_size, scale, scratch.data_ptr(), per_thread)
    return out


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per row of block_tables (the reference's decode contract, lengths for a mask)."""
    if block_tables.shape[0] != query.shape[0] or context_lens.shape != (query.shape[0],):
        raise ValueError("block_tables and context_lens need one row per query")
    return paged_attention(query, k_cache, v_cache, block_tables,
                           torch.arange(query.shape[0], dtype=torch.int32), context_lens, scale)


def fma_gflops(seconds: float = 0.2) -> float | None:
    """GFLOP/s of a register-only FMA loop on every thread of torch's pool, now (None without the
    kernels or AVX2): the machine's compute right now, to state beside a CPU benchmark's figure."""
    rates = fma_gflops_by_thread(seconds)
    return round(sum(rates), 1) if rates else None


def fma_gflops_by_thread(seconds: float = 0.2) -> list[float] | None:
    """fma_gflops per thread of the pool (its threads run the loop at once): on a VM whose cores
    run at different speeds at times, the slowest one bounds a statically split kernel."""
    if not available():
        return None
    threads = torch.get_num_threads()
    rates = (ctypes.c_double * threads)()
    total = library().kvs_fma_gflops(seconds, rates, threads)
    return [round(rate, 1) for rate in rates] if total > 0 else None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for a 2-D fp32 CPU tensor (first maximum; NaN wins)."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu":
        raise ValueError("argmax_rows takes a 2-D fp32 CPU tensor")
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[1] == 0:
        raise ValueError("argmax of an empty row")
    library().kvs_argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out
