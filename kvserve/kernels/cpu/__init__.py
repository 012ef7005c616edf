"""Native CPU kernels, compiled once from C on first use and called through ctypes.

torch has no paged attention on the CPU: the reference gathers every sequence's blocks into a
contiguous copy per layer and step, then runs SDPA, which on this repo's 2-core test machine cost more
than the layer's GEMMs at batch 16. The C kernel here reads the blocks in place.

The C file is compiled with the machine's C compiler (`cc`, as Triton does for its launchers) into
~/.cache/kvserve/cpu_kernels, keyed by the source's hash, so a machine builds it once (about a second).
Without a compiler, or if the build fails, `available()` is False and callers keep the torch path.
ctypes drops the GIL during the call, so a batch is split across a small thread pool, one slice per
torch intra-op thread.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11"]


def _cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvserve")
    return Path(root) / "cpu_kernels"


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVSERVE_DISABLE_CPU_KERNELS") == "1":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found; CPU decode attention uses the torch path")
        return None
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join([compiler, *_FLAGS]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode_attention_{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building the CPU attention kernel failed; using the torch path:\n%s",
                               result.stderr[-2000:])
                return None
            os.replace(built, target)   # atomic: a concurrent builder never sees a partial file
    library = ctypes.CDLL(str(target))
    fn = library.paged_decode_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float]
    return library


def available() -> bool:
    return _library() is not None


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()), thread_name_prefix="kvserve-attn")


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as kvserve.kernels.reference.paged_decode_attention, with context lengths instead of
    a mask: query [B, heads, D] fp32; caches [blocks, block_size, kv_heads, D] fp32 (contiguous);
    block_tables [B, max_blocks] int64; context_lens [B] int32. Returns [B, heads, D]."""
    library = _library()
    if library is None:
        raise RuntimeError("the CPU attention kernel is not available (see kvserve.kernels.cpu.available)")
    if query.dtype != torch.float32 or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
        raise ValueError("the CPU attention kernel takes fp32 queries and caches")
    query = query.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(k_cache.shape)}")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError("block_tables and context_lens need one row per query")
    max_blocks = block_tables.shape[1]
    if batch and int(context_lens.max()) > max_blocks * block_size:
        raise ValueError("a context length exceeds its block table")
    out = torch.empty_like(query)
    fn = library.paged_decode_attention_f32
    pointers = (query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                context_lens.data_ptr(), out.data_ptr())
    shape = (num_heads, num_kv_heads, head_dim, block_size, max_blocks)

    def run(begin: int, end: int) -> int:
        return fn(*pointers, begin, end, *shape, ctypes.c_float(scale))

    workers = min(batch, max(1, torch.get_num_threads()))
    if workers <= 1:
        status = [run(0, batch)]
    else:
        # Slices of equal total context, so threads finish together.
        lengths = context_lens.tolist()
        bounds, target, running = [0], sum(lengths) / workers, 0
        for index, length in enumerate(lengths):
            running += length
            if running >= target * len(bounds) and len(bounds) < workers:
                bounds.append(index + 1)
        bounds.append(batch)
        status = list(_pool().map(run, bounds[:-1], bounds[1:]))
    if any(status):
        raise MemoryError("the CPU attention kernel could not allocate its scratch buffers")
    return out
