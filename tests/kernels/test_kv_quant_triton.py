"""Triton kernels over a quantized KV cache (quantize-on-store, fused-dequant decode) against the
torch reference (kvserve.kvstore / kvserve.kernels.quant_reference), and the Triton backend
against the torch backend on the same quantized caches.

Runs on CUDA; skipped without it unless TRITON_INTERPRET=1 (Triton's CPU interpreter, small shapes).

Tolerances: the store is bit-exact (payload and fp16 scales) on the GPU; the interpreter emulates
fp32 -> e4m3 conversion with a carry bug at binade edges, so there fp8 payloads may differ in a
few codes. Decode attention compares against the reference on the same stored bytes, with the
full-precision kernels' tolerances per dtype (tests/kernels/test_triton_kernels.py), for both decode
kernels: the fast one (segments, scales applied after the dots, inline-PTX code conversion on the
GPU) and the generic one (element-wise dequantization), which also serves layouts the fast one
does not take (groups of fewer than 16 elements, say).
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET else "cuda"

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not INTERPRET,
                                reason="needs a CUDA GPU (or TRITON_INTERPRET=1 for Triton's CPU interpreter)")
pytest.importorskip("triton")

from kvserve.attention.backend import TorchAttentionBackend  # noqa: E402
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk  # noqa: E402
from kvserve.kernels import quant_reference  # noqa: E402
from kvserve.kernels.registry import ring_slots  # noqa: E402
from kvserve.kvstore import KVCacheStore, build_kv_cache_spec  # noqa: E402

TOL = {torch.bfloat16: (3e-2, 2e-2), torch.float16: (4e-3, 4e-3), torch.float32: (1e-4, 1e-4)}
TOKEN = {"kv_quant_key_layout": "token"}        # int4 keys with per-token scales (int4's default before)
CASES = [
    {"kv_cache_dtype": "int8"},
    {"kv_cache_dtype": "fp8_e4m3"},
    {"kv_cache_dtype": "int4", **TOKEN},                                # group 32, window 128, 4 sinks
    {"kv_cache_dtype": "int4", "kv_quant_window": 0, "kv_quant_sinks": 0, **TOKEN},
    {"kv_cache_dtype": "int4", "kv_quant_group_size": 64, "kv_quant_window": 7, "kv_quant_sinks": 2, **TOKEN},
    {"kv_cache_dtype_k": "int8", "kv_cache_dtype_v": "fp8_e4m3"},
    {"kv_cache_dtype_k": "int8", "kv_cache_dtype_v": "auto", "kv_quant_window": 5, "kv_quant_sinks": 3},
]
# int4 keys per channel and block (the int4 default, no window: what "auto" gives, named here), with a
# window, next to 8-bit values.
CHANNEL = {"kv_quant_key_layout": "channel"}
CHANNEL_CASES = [
    {"kv_cache_dtype": "int4", **CHANNEL},
    {"kv_cache_dtype": "int4", "kv_quant_group_size": 64, "kv_quant_window": 7, "kv_quant_sinks": 2, **CHANNEL},
    {"kv_cache_dtype_k": "int4", "kv_cache_dtype_v": "int8", **CHANNEL},
]
# Layouts beyond the store cases: 8-bit groups (several scales per head: segments), keys int4 and
# values plain with a window, and groups too small for the fast kernel (generic only).
EXTRA_DECODE_CASES = [
    {"kv_cache_dtype": "int8", "kv_quant_group_size": 32},
    {"kv_cache_dtype_k": "int4", "kv_cache_dtype_v": "auto", "kv_quant_group_size": 16, **TOKEN},
    {"kv_cache_dtype_k": "fp8_e4m3", "kv_cache_dtype_v": "int4", "kv_quant_window": 0, "kv_quant_sinks": 3},
    {"kv_cache_dtype": "int8", "kv_quant_group_size": 8},
]
DECODE_CASES = CASES + CHANNEL_CASES + EXTRA_DECODE_CASES
SHAPES = [(6, 2, 64), (28, 4, 128)] if not INTERPRET else [(6, 2, 64)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if not INTERPRET else [torch.float32, torch.bfloat16]


_ring_slots = ring_slots


@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_store_kernel_matches_reference(options, head_dim):
    from kvserve.kernels.triton.kv_store_quant import store_quantized, supported
    torch.manual_seed(0)
    spec = build_kv_cache_spec(1, 3, head_dim, torch.bfloat16, **options, block_size=4)
    want = KVCacheStore.allocate(spec, 6, 4, torch.device(DEVICE), num_rows=1)[0]
    got = KVCacheStore.allocate(spec, 6, 4, torch.device(DEVICE), num_rows=1)[0]
    x = (torch.randn(9, 3, head_dim) * torch.logspace(-2, 1, 9)[:, None, None]).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([0, 5, 3, 9, 15, 2, 7, 22, 11], device=DEVICE)
    # Positions 3..11 of one sequence: some in the sinks, some past the window (the trash row).
    ring_slots = _ring_slots(spec, 0, 1, torch.arange(3, 12)).to(DEVICE) if spec.needs_rows else None
    for ref_part, kernel_part in zip(want, got):
        if isinstance(ref_part, torch.Tensor):
            continue
        assert supported(kernel_part)
        ref_part.store(x, slots, ring_slots)
        store_quantized(x, kernel_part, slots, ring_slots)
        if ref_part.scales is not None:
            assert torch.equal(ref_part.scales, kernel_part.scales)
        if ref_part.window is not None:
            # The ring's rows but the trash row (its last, written by several tokens in any order).
            assert torch.equal(ref_part.window[:-1], kernel_part.window[:-1])
            assert kernel_part.window[:-1].abs().sum() > 0
        differ = (ref_part.payload != kernel_part.payload).sum().item()
        allowed = 0.02 * ref_part.payload.numel() if INTERPRET and ref_part.fmt.name == "fp8_e4m3" else 0
        assert differ <= allowed
    # A slot of -1 (graph padding) writes nothing.
    part = next(p for p in got if not isinstance(p, torch.Tensor))
    before = part.payload.clone()
    store_quantized(x[:2], part, torch.tensor([-1, -1], device=DEVICE))
    assert torch.equal(before, part.payload)


CHANNEL_TABLES = [[3, 0, 5, 6], [4, 1, 2, 7]]


def _channel_steps(block_size: int):
    """[(slots, [(sequence, first position, end position)])] of each step writing two sequences, as
    the engine's steps do (decodes first, then prefill chunks), on the blocks of CHANNEL_TABLES: a
    prompt chunk ending inside a block, one decode of it beside the other's prompt, decode steps over
    both (tokens opening blocks among them) with a CUDA-graph padding slot (-1), and a chunk that
    continues the second sequence inside a block and over the next."""
    def slots(seq, start, end):
        table = CHANNEL_TABLES[seq]
        return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]

    first = block_size + 3
    steps = [(slots(0, 0, first), [(0, 0, first)]),
             (slots(0, first, first + 1) + slots(1, 0, 2), [(0, first, first + 1), (1, 0, 2)])]
    position = [first + 1, 2]
    for _ in range(block_size + 2):
        steps.append((slots(0, position[0], position[0] + 1) + slots(1, position[1], position[1] + 1) + [-1],
                      [(0, position[0], position[0] + 1), (1, position[1], position[1] + 1)]))
        position = [p + 1 for p in position]
    steps.append((slots(1, position[1], 3 * block_size + 1), [(1, position[1], 3 * block_size + 1)]))
    return steps


@pytest.mark.parametrize("options", CHANNEL_CASES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
@pytest.mark.parametrize("head_dim", [64, 128, 24])
@pytest.mark.parametrize("block_size", [16, 4])
def test_channel_store_kernel_matches_reference(options, head_dim, block_size):
    """Per-channel int4 keys (requantize-on-grow): after every step of two sequences' writes the
    kernel's codes and (scale, zero) pairs equal the reference's, bit for bit, the window ring too;
    what the blocks read back stays within a few quantization steps of what was written; padding
    slots write nothing."""
    from kvserve.kernels.triton.kv_store_quant import store_quantized, supported
    torch.manual_seed(8)
    heads = 3
    spec = build_kv_cache_spec(1, heads, head_dim, torch.bfloat16, **options, block_size=block_size)
    want = KVCacheStore.allocate(spec, 8, block_size, torch.device(DEVICE), num_rows=2)[0].key
    got = KVCacheStore.allocate(spec, 8, block_size, torch.device(DEVICE), num_rows=2)[0].key
    assert want.fmt.per_channel and supported(got)
    # Channels with offsets and spreads of their own, tokens of growing magnitude: ranges widen.
    length = 4 * block_size
    growth = torch.linspace(0.3, 2, length)[:, None, None]
    keys = [(torch.randn(length, heads, head_dim) * torch.linspace(0.1, 4, head_dim) * growth
             + torch.linspace(-5, 3, head_dim)).to(torch.bfloat16).to(DEVICE) for _ in range(2)]
    ends = [0, 0]
    trash = 2 * (spec.sinks + spec.window)
    for step_slots, pieces in _channel_steps(block_size):
        padding = step_slots.count(-1)
        x = torch.cat([keys[seq][start:end] for seq, start, end in pieces]
                      + [torch.zeros(padding, heads, head_dim, dtype=torch.bfloat16, device=DEVICE)])
        slots = torch.tensor(step_slots, device=DEVICE)
        ring = None
        if spec.needs_rows:
            ring = torch.cat([_ring_slots(spec, seq, 2, torch.arange(start, end)) for seq, start, end in pieces]
                             + [torch.full((padding, 2), trash)]).to(DEVICE)
        real = slots >= 0
        want.store(x[real], slots[real], ring[real] if ring is not None else None)
        store_quantized(x, got, slots, ring)
        assert torch.equal(want.scales, got.scales)
        assert torch.equal(want.payload, got.payload)
        if want.window is not None:
            assert torch.equal(want.window[:-1], got.window[:-1])
        for seq, _, end in pieces:
            ends[seq] = end
    for seq, table in enumerate(CHANNEL_TABLES):
        positions = torch.arange(ends[seq])
        slots = (torch.tensor(table)[positions // block_size] * block_size + positions % block_size).to(DEVICE)
        back = got.gather_slots(slots).float()
        step = got.scales[slots // block_size][:, :, 0].float()
        assert ((back - keys[seq][:ends[seq]].float()).abs() <= 4 * step + 1e-2).all()


def _filled_caches(spec, dtype, num_blocks, block_size, tables, lens, rows, num_rows, key_offsets=None):
    k_cache, v_cache = KVCacheStore.allocate(spec, num_blocks, block_size, torch.device(DEVICE), num_rows=num_rows)[0]
    kv_heads, head_dim = spec.num_kv_heads, spec.head_dim
    for b in range(tables.shape[0]):
        positions = torch.arange(int(lens[b]))
        slots = (tables[b, positions // block_size] * block_size + positions % block_size).to(DEVICE)
        ring = _ring_slots(spec, int(rows[b]), num_rows, positions).to(DEVICE) if spec.needs_rows else None
        for cache, offsets in ((k_cache, key_offsets), (v_cache, None)):
            x = torch.randn(len(positions), kv_heads, head_dim) + (0 if offsets is None else offsets)
            quant_reference.store_part(cache, x.to(dtype).to(DEVICE), slots, ring)
    return k_cache, v_cache


def _implementations(query, k_cache, v_cache):
    from kvserve.kernels.triton.decode_attention_quant_config import fast_kernel_supported
    from kvserve.kernels.triton.decode_attention_quant_pipelined import pipelined_supported
    return ((["pipelined"] if pipelined_supported(query, k_cache, v_cache) else [])
            + (["fast"] if fast_kernel_supported(query, k_cache, v_cache) else []) + ["generic"])


def _decode_case(options: dict, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Four sequences (one empty) over filled quantized caches, a query and the reference output:
    (spec, query, k_cache, v_cache, tables, lens, rows, want)."""
    block_size, num_blocks, num_rows = 16, 64, 4
    spec = build_kv_cache_spec(1, kv_heads, head_dim, dtype, **options)
    lens = torch.tensor([300, 17, 0, 150] if not INTERPRET else [70, 17, 0, 40])
    tables = torch.stack([torch.randperm(num_blocks)[:20] for _ in range(4)])
    rows = torch.tensor([2, 0, 1, 3])
    k_cache, v_cache = _filled_caches(spec, dtype, num_blocks, block_size, tables, lens, rows, num_rows)
    query = torch.randn(4, heads, head_dim).to(dtype).to(DEVICE)
    tables, lens, rows = tables.to(DEVICE), lens.to(DEVICE), rows.to(DEVICE)
    want = quant_reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5,
                                                  rows if spec.needs_rows else None)
    return spec, query, k_cache, v_cache, tables, lens, rows, want


@pytest.mark.parametrize("options", DECODE_CASES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_dequant_decode_matches_reference(options, shape, dtype):
    from kvserve.kernels.triton.decode_attention_quant import paged_decode_attention_quant
    torch.manual_seed(1)
    heads, kv_heads, head_dim = shape
    spec, query, k_cache, v_cache, tables, lens, rows, want = _decode_case(options, heads, kv_heads, head_dim, dtype)
    atol, rtol = TOL[dtype]
    implementations = _implementations(query, k_cache, v_cache)
    group = options.get("kv_quant_group_size")
    if group is None or (group >= 16 and head_dim // group <= 4):
        assert "fast" in implementations
    for implementation in implementations:
        for num_splits in (1, 3):
            got = paged_decode_attention_quant(query, k_cache, v_cache, tables, lens, head_dim ** -0.5,
                                               rows if spec.needs_rows else None, num_splits=num_splits,
                                               implementation=implementation)
            torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol,
                                       msg=lambda m: f"{implementation}, {num_splits} splits: {m}")


@pytest.mark.parametrize("ids_ahead", [True, False], ids=["ids-ahead", "ids-in-loop"])
@pytest.mark.parametrize("tile,staging", [(32, "fp16"), (128, "fp16"), (64, "codes"), (32, "codes")])
@pytest.mark.parametrize("options", [CASES[0], CASES[2], EXTRA_DECODE_CASES[0], EXTRA_DECODE_CASES[2],
                                     CHANNEL_CASES[0], CHANNEL_CASES[1]],
                         ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_fast_decode_kernel_launch_variants(options, tile, staging, ids_ahead):
    """The fast kernel's tile, value staging and block-id loading are launch choices: they give the
    same result (windows, sinks and split edges then fall elsewhere in the tiles)."""
    from dataclasses import replace

    from kvserve.kernels.triton.decode_attention_quant import paged_decode_attention_quant
    from kvserve.kernels.triton.decode_attention_quant_config import default_quant_decode_config
    torch.manual_seed(5)
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    heads, kv_heads, head_dim = SHAPES[-1]
    spec, query, k_cache, v_cache, tables, lens, rows, want = _decode_case(options, heads, kv_heads, head_dim, dtype)
    config = replace(default_quant_decode_config(head_dim, dtype), tile=tile if not INTERPRET else tile // 2,
                     num_warps=8 if tile == 128 and not INTERPRET and not ids_ahead else 4, ids_ahead=ids_ahead)
    for num_splits in (1, 3):
        got = paged_decode_attention_quant(query, k_cache, v_cache, tables, lens, head_dim ** -0.5,
                                           rows if spec.needs_rows else None, num_splits=num_splits,
                                           implementation="fast", config=config, value_staging=staging)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])


PIPELINED_CASES = [
    {"kv_cache_dtype": "int8"},
    {"kv_cache_dtype": "fp8_e4m3"},
    {"kv_cache_dtype_k": "int8", "kv_cache_dtype_v": "fp8_e4m3"},
    {"kv_cache_dtype_k": "fp8_e4m3", "kv_cache_dtype_v": "int8"},
    {"kv_cache_dtype": "int4", "kv_quant_window": 0, "kv_quant_sinks": 0, **TOKEN},           # groups of 32
    {"kv_cache_dtype": "int4", "kv_quant_group_size": 64, "kv_quant_window": 0, "kv_quant_sinks": 0, **TOKEN},
    {"kv_cache_dtype": "int4", "kv_quant_group_size": 128, "kv_quant_window": 0, "kv_quant_sinks": 0, **TOKEN},
    {"kv_cache_dtype": "int4", **TOKEN},                                # group 32, window 128, 4 sinks
    {"kv_cache_dtype": "int8", "kv_quant_window": 16, "kv_quant_sinks": 3},
]


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels run on NVIDIA GPUs only")
@pytest.mark.parametrize("options", PIPELINED_CASES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
@pytest.mark.parametrize("shape", [(28, 4, 128), (6, 2, 64), (32, 4, 128), (4, 4, 64), (9, 3, 64)],
                         ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 64])
def test_pipelined_decode_matches_reference(options, shape, dtype, block_size):
    """The pipelined kernel (Gluon; 8-bit and int4, with the fast kernel running a window's positions):
    ragged contexts (empty, shorter than a tile, a warp's share of it or the window, across many ring
    turns), GQA groups 1-8, block sizes below and at the tile, and split counts from 1 to more than a
    short context has tiles, against the reference on the same stored bytes."""
    _check_pipelined_decode(options, shape, dtype, block_size)


# int4 keys per channel and block (no window), values per token in groups of 32 or 64.
PIPELINED_CHANNEL_CASES = [{"kv_cache_dtype": "int4", **CHANNEL},
                           {"kv_cache_dtype": "int4", "kv_quant_group_size": 64, **CHANNEL}]


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels run on NVIDIA GPUs only")
@pytest.mark.parametrize("options", PIPELINED_CHANNEL_CASES, ids=["values-g32", "values-g64"])
@pytest.mark.parametrize("shape", [(28, 4, 128), (6, 2, 64), (32, 8, 128), (4, 4, 64), (9, 3, 64)],
                         ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_pipelined_decode_with_keys_per_channel_matches_reference(options, shape, dtype, block_size):
    """Per-channel int4 keys in the pipelined kernel: one key dot per block of a warp's positions in a
    tile, the block's (scale, zero) rows folded into the query and the dot's initial accumulator. A
    block may not be larger than a warp's share of a tile (64 positions with a warp per KV head, else
    32): larger ones take the fast Triton kernel. Keys carry per-channel offsets (what per-channel
    zeros are for) and ragged contexts end inside blocks."""
    from kvserve.kernels.triton.decode_attention_quant_pipelined import head_warps, pipelined_supported
    heads, kv_heads, head_dim = shape
    if block_size > (64 if head_warps(kv_heads, True) else 32):
        spec = build_kv_cache_spec(1, kv_heads, head_dim, dtype, block_size=block_size, **options)
        k_cache, v_cache = KVCacheStore.allocate(spec, 8, block_size, torch.device(DEVICE), num_rows=1)[0]
        query = torch.randn(1, heads, head_dim, dtype=dtype, device=DEVICE)
        assert not pipelined_supported(query, k_cache, v_cache)
        return
    _check_pipelined_decode(options, shape, dtype, block_size, key_offsets=True)


def _check_pipelined_decode(options, shape, dtype, block_size, key_offsets: bool = False):
    from kvserve.kernels.triton.decode_attention_quant import paged_decode_attention_quant
    from kvserve.kernels.triton.decode_attention_quant_pipelined import pipelined_supported
    torch.manual_seed(6)
    heads, kv_heads, head_dim = shape
    num_blocks = 16384 // block_size
    spec = build_kv_cache_spec(1, kv_heads, head_dim, dtype, block_size=block_size, **options)
    lens = torch.tensor([1000, 17, 0, 1, 64, 333, 2049])
    batch = len(lens)
    per_seq = num_blocks // batch
    tables = torch.randperm(num_blocks)[:batch * per_seq].view(batch, per_seq)
    rows = torch.arange(batch)
    k_cache, v_cache = _filled_caches(spec, dtype, num_blocks, block_size, tables, lens, rows, batch,
                                      torch.linspace(-4, 4, head_dim) if key_offsets else None)
    query = (torch.randn(batch, heads, head_dim) * 3).to(dtype).to(DEVICE)
    tables, lens = tables.to(DEVICE), lens.to(DEVICE)
    seq_rows = rows.to(DEVICE) if spec.needs_rows else None
    assert pipelined_supported(query, k_cache, v_cache)
    want = quant_reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, seq_rows)
    atol, rtol = TOL[dtype]
    if k_cache.fmt.per_channel and dtype == torch.float16:
        # The reference rounds each dequantized key to fp16 (error 2^-11 |k|); the kernel rounds the
        # query's products with the block's scales and zeros instead (2^-11 |q| (15 s + |z|)), larger
        # where a channel's offset dwarfs its spread. Emulated in torch on these inputs: up to 1.4x
        # the fp16 tolerance (blocks of 64), 0.95x (blocks of 16). Both are far below the int4 step.
        atol, rtol = 2 * atol, 2 * rtol
    for num_splits in (1, 2, 5, 40):
        got = paged_decode_attention_quant(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, seq_rows,
                                           num_splits=num_splits, implementation="pipelined")
        assert torch.isfinite(got.float()).all()
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{num_splits} splits: {m}")
    # By default (no launch config forced) the engine's decode takes this kernel.
    got = paged_decode_attention_quant(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, seq_rows)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels run on NVIDIA GPUs only")
@pytest.mark.parametrize("options", [{"kv_cache_dtype": "int4", **TOKEN}, {"kv_cache_dtype": "int8"}],
                         ids=["int4", "int8"])
def test_pipelined_decode_with_64_bit_offsets(monkeypatch, options):
    """Caches of 2^31 elements or more per part take 64-bit row offsets (WIDE); forced here on small
    caches, the kernel gives the reference's output all the same."""
    from kvserve.kernels.triton import decode_attention_quant_pipelined as pipelined
    from kvserve.kernels.triton.decode_attention_quant import paged_decode_attention_quant
    monkeypatch.setattr(pipelined, "_needs_wide_offsets", lambda k_cache, v_cache: True)
    torch.manual_seed(7)
    heads, kv_heads, head_dim, block_size, num_blocks = 28, 4, 128, 16, 256
    spec = build_kv_cache_spec(1, kv_heads, head_dim, torch.bfloat16, **options)
    lens = torch.tensor([700, 33, 1300])
    batch = len(lens)
    tables = torch.randperm(num_blocks)[:batch * (num_blocks // batch)].view(batch, -1)
    rows = torch.arange(batch)
    k_cache, v_cache = _filled_caches(spec, torch.bfloat16, num_blocks, block_size, tables, lens, rows, batch)
    query = (torch.randn(batch, heads, head_dim) * 3).to(torch.bfloat16).to(DEVICE)
    tables, lens = tables.to(DEVICE), lens.to(DEVICE)
    seq_rows = rows.to(DEVICE) if spec.needs_rows else None
    want = quant_reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, seq_rows)
    atol, rtol = TOL[torch.bfloat16]
    for num_splits in (1, 3):
        got = paged_decode_attention_quant(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, seq_rows,
                                           num_splits=num_splits, implementation="pipelined")
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels run on NVIDIA GPUs only")
def test_pipelined_decode_declines_what_it_does_not_cover():
    """A full-precision part (with or without a window on the other), int4 next to an 8-bit part, 8-bit
    scale groups, int4 groups under 32, per-channel int4 keys next to a window or 8-bit values, groups of
    more than 8 heads: the Triton kernels serve them."""
    from kvserve.kernels.triton.decode_attention_quant_pipelined import pipelined_supported
    head_dim, kv_heads = 128, 2
    query = torch.randn(3, 2 * kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    for options in ({"kv_cache_dtype_k": "int8", "kv_cache_dtype_v": "auto", "kv_quant_window": 8},
                    {"kv_cache_dtype_k": "int4", "kv_cache_dtype_v": "int8", "kv_quant_window": 0,
                     "kv_quant_sinks": 0, **TOKEN},
                    {"kv_cache_dtype": "int8", "kv_quant_group_size": 32},
                    {"kv_cache_dtype": "int4", "kv_quant_group_size": 16, "kv_quant_window": 0, "kv_quant_sinks": 0,
                     **TOKEN},
                    {"kv_cache_dtype": "int4", "kv_quant_window": 16, **CHANNEL},
                    {"kv_cache_dtype_k": "int4", "kv_cache_dtype_v": "int8", **CHANNEL},
                    {"kv_cache_dtype_k": "int8", "kv_cache_dtype_v": "auto"}):
        spec = build_kv_cache_spec(1, kv_heads, head_dim, torch.bfloat16, **options)
        k_cache, v_cache = KVCacheStore.allocate(spec, 8, 16, torch.device(DEVICE), num_rows=3)[0]
        assert not pipelined_supported(query, k_cache, v_cache), options
    # int4 with its full-precision window (both parts alike): this kernel, the window beside it.
    spec = build_kv_cache_spec(1, kv_heads, head_dim, torch.bfloat16, kv_cache_dtype="int4", kv_quant_window=128,
                               kv_quant_sinks=4, **TOKEN)
    k_cache, v_cache = KVCacheStore.allocate(spec, 8, 16, torch.device(DEVICE), num_rows=3)[0]
    assert pipelined_supported(query, k_cache, v_cache)
    # int4 as it is by default (keys per channel and block, no window): this kernel too.
    spec = build_kv_cache_spec(1, kv_heads, head_dim, torch.bfloat16, kv_cache_dtype="int4")
    k_cache, v_cache = KVCacheStore.allocate(spec, 8, 16, torch.device(DEVICE), num_rows=3)[0]
    assert k_cache.fmt.per_channel and pipelined_supported(query, k_cache, v_cache)
    spec = build_kv_cache_spec(1, kv_heads, head_dim, torch.bfloat16, kv_cache_dtype="int8")
    k_cache, v_cache = KVCacheStore.allocate(spec, 8, 16, torch.device(DEVICE), num_rows=3)[0]
    assert pipelined_supported(query, k_cache, v_cache)
    assert not pipelined_supported(torch.randn(3, 9 * kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE),
                                   k_cache, v_cache)
    assert not pipelined_supported(query.float(), k_cache, v_cache)


@pytest.mark.parametrize("parts", ["kv", "k", "v"])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "int4"])
def test_decode_with_static_scales_matches_reference(name, parts, tmp_path):
    """Static per-channel scales: folded into the query (keys) and into each tile's update (values),
    with a window so that exact ring rows must not be scaled."""
    from kvserve.kernels.triton.decode_attention_quant import paged_decode_attention_quant
    from kvserve.kvstore import save_scales
    torch.manual_seed(4)
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    heads, kv_heads, head_dim, block_size, num_blocks, num_rows = 6, 2, 64, 16, 64, 4
    absmax = {f"layers.0.{p}": torch.rand(kv_heads, head_dim) * 3 + 0.5 for p in "kv"}
    path = tmp_path / "scales.json"
    save_scales(str(path), absmax, {})
    spec = build_kv_cache_spec(1, kv_heads, head_dim, dtype, kv_cache_dtype=name, kv_scales_file=str(path),
                               kv_static_scale_parts=parts, kv_quant_window=6, kv_quant_sinks=2, **TOKEN)
    lens = torch.tensor([70, 17, 0, 40])
    tables = torch.stack([torch.randperm(num_blocks)[:20] for _ in range(4)])
    rows = torch.tensor([2, 0, 1, 3])
    k_cache, v_cache = _filled_caches(spec, dtype, num_blocks, block_size, tables, lens, rows, num_rows)
    query = torch.randn(4, heads, head_dim).to(dtype).to(DEVICE)
    tables, lens, rows = tables.to(DEVICE), lens.to(DEVICE), rows.to(DEVICE)
    want = quant_reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, rows)
    atol, rtol = TOL[dtype]
    implementations = _implementations(query, k_cache, v_cache)
    assert "fast" in implementations
    for implementation in implementations:
        got = paged_decode_attention_quant(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, rows,
                                           num_splits=2, implementation=implementation)
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{implementation}: {m}")


@pytest.mark.parametrize("options", CASES[:4] + CHANNEL_CASES,
                         ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_triton_backend_matches_torch_backend_on_quantized_caches(options):
    """One mixed step (two decodes + a plain prefill + a prefill over a cached prefix) through both
    backends, each on its own copy of the same cache."""
    from kvserve.attention.triton_backend import TritonAttentionBackend
    if INTERPRET and "fp8_e4m3" in options.values():
        pytest.skip("the interpreter's fp32 -> e4m3 conversion differs from the GPU's (see module docstring)")
    torch.manual_seed(2)
    dtype, heads, kv_heads, head_dim, block_size, num_blocks, num_rows = torch.float32, 6, 2, 64, 16, 32, 4
    spec = build_kv_cache_spec(1, kv_heads, head_dim, dtype, **options)
    lens_before = torch.tensor([40, 9, 0, 20])            # decode, decode, plain prefill, chunk over prefix
    new_tokens = [1, 1, 12, 6]
    tables = torch.stack([torch.arange(i * 8, i * 8 + 8) for i in range(4)])
    rows = torch.tensor([0, 1, 2, 3])
    caches = [_filled_caches(spec, dtype, num_blocks, block_size, tables, lens_before, rows, num_rows)
              for _ in range(2)]
    torch.manual_seed(3)
    for cache_a, cache_b in zip(*caches):               # same bytes in both copies
        for name in ("payload", "scales", "window"):
            if not isinstance(cache_a, torch.Tensor) and getattr(cache_a, name) is not None:
                getattr(cache_b, name).copy_(getattr(cache_a, name))
        if isinstance(cache_a, torch.Tensor):
            cache_b.copy_(cache_a)
    total = sum(new_tokens)
    query = torch.randn(total, heads, head_dim, device=DEVICE)
    key = torch.randn(total, kv_heads, head_dim, device=DEVICE)
    value = torch.randn(total, kv_heads, head_dim, device=DEVICE)
    slots, token_rows, ring = [], [], []
    for b, count in enumerate(new_tokens):
        positions = torch.arange(int(lens_before[b]), int(lens_before[b]) + count)
        slots.append(tables[b, positions // block_size] * block_size + positions % block_size)
        token_rows.append(torch.full((count,), int(rows[b])))
        ring.append(_ring_slots(spec, int(rows[b]), num_rows, positions) if spec.needs_rows
                    else torch.zeros(count, 2, dtype=torch.long))
    meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(DEVICE), num_decode_tokens=2)
    context = lens_before[:2] + 1
    meta.decode_block_tables = tables[:2].to(DEVICE)
    meta.decode_context_lens = context.to(torch.int32).to(DEVICE)
    meta.decode_context_mask = (torch.arange(8 * block_size)[None, :] < context[:, None]).to(DEVICE)
    if spec.needs_rows:
        meta.kv_rows = torch.cat(token_rows).to(DEVICE)
        meta.kv_window_slots = torch.cat(ring).to(DEVICE)
        meta.decode_kv_rows = rows[:2].to(DEVICE)
    meta.prefills.append(PrefillChunk(2, 12, 12, None, 2))
    prefix_positions = torch.arange(26)
    meta.prefills.append(PrefillChunk(14, 6, 26, (tables[3, prefix_positions // block_size] * block_size
                                                  + prefix_positions % block_size).to(DEVICE), 3))
    want = TorchAttentionBackend().forward(query, key, value, *caches[0], meta, head_dim ** -0.5)
    got = TritonAttentionBackend().forward(query, key, value, *caches[1], meta, head_dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


TORCH_EAGER = {"attention_backend": "torch", "enforce_eager": True}


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels run on NVIDIA GPUs only")
@pytest.mark.parametrize("options, kernels, reference", [
    ({"kv_cache_dtype": "int4", **TOKEN}, ["pipelined"], TORCH_EAGER),  # group 32, window 128, 4 sinks
    ({"kv_cache_dtype": "int8"}, ["pipelined"], TORCH_EAGER),
    ({"kv_cache_dtype": "int4", "kv_quant_window": 128, "kv_quant_sinks": 4, "kv_quant_key_layout": "channel"},
     ["fast"], TORCH_EAGER),
    ({"kv_cache_dtype": "int4", "kv_quant_key_layout": "channel"}, ["pipelined"], {"enforce_eager": True}),
], ids=["int4-token-window", "int8", "int4-channel-keys-window", "int4-channel-keys-graphs-vs-eager"])
def test_engine_decodes_through_the_quantized_kernels(tmp_path, options, kernels, reference):
    """Through the engine on CUDA (Triton backend, CUDA graphs, the split count taken from the kernel's
    occupancy, a window's extra launch and combine), a bf16 model with head_dim 128 and 4 KV heads
    decodes over a quantized cache with the pipelined kernel (int4: each warp on its own KV head; int4
    keys per channel, the default: the store kernel's requantize-on-grow under the graphs, and the
    pipelined kernel, or the fast Triton one with a window), and its greedy steps agree with the torch reference backend (eager) on the same
    format: same tokens with close logprobs, up to a step where the reference's top two are too close
    to call. int4's default (keys per channel, no window) is compared with the same backend run
    eagerly instead: see below why a cache without a window is not compared across backends here (the
    kernel tests read the same stored bytes through both).

    The two runs quantize their own (bf16, differently rounded) K/V, so a code on a rounding edge may
    differ between them. int4 groups of 64 without a window (every position quantized) differed by
    0.26 in one logprob on an H200, which we attribute to that (not confirmed); it is left to the
    kernel tests above, which read the same stored bytes."""
    import transformers

    from kvserve.sampling_params import SamplingParams
    from kvserve.kernels.triton import decode_attention_quant
    from kvserve.llm import LLM
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                      max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1,
                                      eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    prompts = [list(range(3, 253)) + list(range(3, 53)), list(range(40, 220)), list(range(9, 49))]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    runs = []
    decode_attention_quant._quant_resident_per_sm.clear()     # records each decode kernel launched
    for extra in ({}, reference):
        llm = LLM(model=str(tmp_path), device="cuda", dtype="bfloat16", kv_cache_memory=64 << 20, seed=0,
                  **options, **extra)
        runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert [key[7] for key in decode_attention_quant._quant_resident_per_sm] == kernels
    compared = 0
    for got, want in zip(*runs):
        got, want = got.outputs[0], want.outputs[0]
        for step, (token, reference) in enumerate(zip(got.token_ids, want.token_ids)):
            top = sorted(want.logprobs[step].values(), reverse=True)
            if token != reference:
                assert top[0] - top[1] < 0.15, f"step {step}: {token} vs {reference} (margin {top[0] - top[1]:.3f})"
                break
            assert got.logprobs[step][token] == pytest.approx(want.logprobs[step][reference], abs=0.15)
            compared += step > 0                # steps after the first read the quantized cache
    assert compared >= 15
