"""CPU buffers backed by transparent huge pages (Linux `madvise(MADV_HUGEPAGE)`).

Each decode step of the native CPU path streams every packed weight once. With 4 KiB pages that
stream crosses a page every 64 cache lines. Each crossing can miss the TLB (under a hypervisor a
miss walks two levels of page tables), and the hardware prefetchers stop at page boundaries. The
packed weights therefore live in one buffer of 2 MiB pages (`views`, used by
model/cpu_native.pack_model).

On the 2-core development VM (`kvserve bench` alternated with KVSERVE_HUGE_PAGES=0) that made batch 1
faster and left batch 16 and 64 within noise. The KV cache was tried in huge pages too
(`python benchmarks/cpu/cpu_hugepages_bench.py` times the kernels alone): end to end the cache and the
weights together did no better than the weights alone, so the cache stays in ordinary pages.
Measured: see docs/cpu_performance.md#history.

Most distributions ship THP in `madvise` mode, so a process gets huge pages only for ranges it
marks. The range must be marked before its first touch: the kernel then backs it with huge pages
at fault time. The hint is best effort. Without THP (or off Linux) these are plain `torch.empty`
buffers. `KVSERVE_HUGE_PAGES=0` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os

import torch

from kvserve import envs

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
# Smaller buffers cannot hold a whole aligned huge page after alignment; they stay plain.
MIN_BYTES = 2 * HUGE_PAGE_BYTES


@functools.lru_cache(maxsize=None)
def _madvise():
    if not envs.KVSERVE_HUGE_PAGES.is_on() or not os.path.exists("/sys/kernel/mm/transparent_hugepage"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def available() -> bool:
    return _madvise() is not None


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose whole 2 MiB-aligned pages are marked for huge
    pages before anything touches them. Its storage is a slightly larger byte buffer (one huge page
    more, never touched beyond the tensor, so never resident)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if madvise is None or nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    # The tensor starts on a huge-page boundary; its last partial huge page stays in small pages.
    madvise(raw.data_ptr() + offset, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, _MADV_HUGEPAGE)
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def views(specs: list[tuple[tuple[int, ...], torch.dtype]], alignment: int = 64) -> list[torch.Tensor]:
    """Uninitialised tensors of the given (shape, dtype)s laid out one after another in one huge-page
    buffer, each starting on an `alignment`-byte boundary. Many buffers of a few MiB each, like a
    model's packed weights, then share huge pages that none of them fills alone. The tensors keep the
    buffer alive."""
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // alignment) * alignment
    arena = empty((max(total, 1),), torch.uint8)
    return [arena[start:start + size].view(dtype).view(shape)
            for (shape, dtype), start, size in zip(specs, starts, sizes)]
