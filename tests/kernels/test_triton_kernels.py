"""Triton kernels (kvserve.kernels.triton) against their torch references, and the Triton backend
against the torch backend.

Runs on CUDA. Without CUDA the module is skipped, unless TRITON_INTERPRET=1 is set: then the
kernels run on CPU tensors in Triton's interpreter over a reduced shape grid (KVSERVE_TRITON_FULL=1
runs the full grid there too, slowly). Triton 3.6's interpreter needs numpy < 2.4 for kernels with
data-dependent loop bounds, and rounds fp32 -> bf16 by truncation, so bf16 results that are exact on
the GPU get one bf16 ulp of slack there.

Tolerances (kernel vs reference on the same inputs; attention also bounds the relative
Frobenius error, which stays meaningful where long contexts make outputs small):
  attention  bf16: atol 3e-2, rtol 2e-2, rel 1e-2  (the bf16 reference itself is ~2e-2 off fp32)
             fp16: atol 4e-3, rtol 4e-3, rel 2e-3
             fp32: atol 1e-4, rtol 1e-4, rel 1e-5
  store_kv   exact (a copy; a dtype-converting store is exact up to the interpreter's bf16 rounding)
  rms_norm   residual output exact; normed output within 2 ulps (bf16/fp16) or 8 ulps (fp32)
  silu*mul   within 2 ulps (bf16/fp16) or 8 ulps (fp32); see ULPS_ALLOWED
  both       16-bit: at most 1% of elements differ from torch's bits (the same rounding steps)
Outputs and split workspaces are poisoned with NaN before each launch so unwritten elements fail.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
FULL = torch.cuda.is_available() and not INTERPRET or os.environ.get("KVSERVE_TRITON_FULL") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not INTERPRET,
                                reason="needs a CUDA GPU (or TRITON_INTERPRET=1 for Triton's CPU interpreter)")
pytest.importorskip("triton")

from kvserve.attention.backend import TorchAttentionBackend  # noqa: E402
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk  # noqa: E402
from kvserve.kernels import reference  # noqa: E402
from kvserve.kernels.triton import references  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (query heads, kv heads, head_dim): GQA groups 1, 3 (SmolLM2), 7 (R1-Distill-Qwen-7B), 8.
HEAD_SHAPES = [(8, 8, 64), (9, 3, 64), (28, 4, 128), (16, 2, 128)]
BLOCK_SIZES = [16, 32]
# (atol, rtol, relative Frobenius error) against the reference in the same dtype, and the relative
# error bound against the reference computed in fp32 from the same (rounded) inputs.
ATTENTION_TOL = {torch.bfloat16: (3e-2, 2e-2, 2.5e-2), torch.float16: (4e-3, 4e-3, 4e-3),
                 torch.float32: (1e-4, 1e-4, 1e-5)}
ATTENTION_TOL_VS_FP32 = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}
# One unit in the last place for values in [1, 2). The fused ops round twice (the normed or activated
# value, then the product with the weight or up): when the kernel's exp or mean differs from torch's in
# the last fp32 bit, the first rounding can flip, which the product carries as up to 2 ulps. fp32: 8
# ulps (fast exp, summation order). The interpreter truncates to bf16 at both roundings: 4 ulps.
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}
ULPS_ALLOWED = {torch.bfloat16: 4 if INTERPRET else 2, torch.float16: 2, torch.float32: 8}


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()


def assert_attention_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                           expected_fp32: torch.Tensor | None = None) -> None:
    atol, rtol, rel = ATTENTION_TOL[dtype]
    assert not actual.isnan().any(), "unwritten (NaN-poisoned) or NaN output elements"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)
    error = relative_error(actual, expected)
    assert error <= rel, f"relative error {error:.2e} > {rel:.0e} against the {dtype} reference"
    if expected_fp32 is not None:
        error = relative_error(actual, expected_fp32)
        bound = ATTENTION_TOL_VS_FP32[dtype]
        assert error <= bound, f"relative error {error:.2e} > {bound:.0e} against the fp32 reference"


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: float | None = None) -> None:
    """|actual - expected| <= ulps * ulp(expected), elementwise (ulp of the expected value's binade)."""
    assert not actual.isnan().any(), "unwritten (NaN-poisoned) or NaN output elements"
    ulps = ULPS_ALLOWED[expected.dtype] if ulps is None else ulps
    expected_f = expected.float()
    binade = torch.exp2(torch.floor(torch.log2(expected_f.abs().clamp_min(1e-30))))
    excess = ((actual.float() - expected_f).abs() - ulps * ULP[expected.dtype] * binade).max().item()
    assert excess <= 1e-30, f"error exceeds {ulps} ulp by up to {excess:.3e}"


def assert_rounding_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """16-bit fused ops round where torch rounds: almost every element is bit-identical (a rounding
    step skipped or added shows up as ~25% mismatches). Not for fp32 (summation order) nor for bf16
    under the interpreter (it truncates)."""
    if expected.dtype == torch.float32 or (INTERPRET and expected.dtype == torch.bfloat16):
        return
    mismatched = (actual != expected).float().mean().item()
    assert mismatched <= 0.01, f"{100 * mismatched:.1f}% of elements differ from torch's rounding"


def make_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.randn(shape, dtype=dtype, device=DEVICE), torch.randn(shape, dtype=dtype, device=DEVICE))


def random_block_tables(context_lens: list[int], block_size: int, num_blocks: int, generator: random.Random,
                        width: int | None = None) -> torch.Tensor:
    """Disjoint random blocks per sequence, padded with random (valid) block ids."""
    needed = [max(1, math.ceil(n / block_size)) for n in context_lens]
    width = width or max(needed)
    pool = list(range(num_blocks))
    generator.shuffle(pool)
    rows, used = [], 0
    for count in needed:
        row = pool[used:used + count] + [generator.randrange(num_blocks) for _ in range(width - count)]
        used += count
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


def slots_of(table_row: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    return torch.tensor([table_row[p // block_size] * block_size + p % block_size for p in range(start, end)],
                        dtype=torch.int64, device=DEVICE)


# ---------------------------------------------------------------------------------------------
# store_kv

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEAD_SHAPES)
def test_store_kv(num_heads, num_kv_heads, head_dim, block_size, dtype):
    from kvserve.kernels.triton import store_kv
    torch.manual_seed(0)
    num_blocks, num_tokens = 12, 37
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    # key/value as the model makes them: views into one fused qkv projection (token stride > row).
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    _, key, value = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[::5] = -1                                       # graph padding: must write nothing
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    reference.store_kv(key[keep], value[keep], expected_k, expected_v, slots[keep])
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_store_kv_converts_dtype():
    from kvserve.kernels.triton import store_kv
    torch.manual_seed(1)
    k_cache, v_cache = make_cache(6, 16, 4, 128, torch.bfloat16)
    key = torch.randn(20, 4, 128, device=DEVICE)
    value = torch.randn(20, 4, 128, device=DEVICE)
    slots = torch.randperm(96, device=DEVICE)[:20].to(torch.int32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots.long())
    store_kv(key, value, k_cache, v_cache, slots)
    if INTERPRET:
        assert_within_ulps(k_cache, expected_k, ulps=1)
        assert_within_ulps(v_cache, expected_v, ulps=1)
    else:
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


# ---------------------------------------------------------------------------------------------
# paged decode attention

def decode_context_cases(block_size: int, long_full: bool = True) -> dict[str, list[int]]:
    generator = random.Random(block_size)
    bs = block_size
    boundaries = [1, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs, 2 * bs + 1, 3 * bs + 5]
    if FULL:
        batch64 = [generator.randint(1, 1500) for _ in range(60)] + [1, bs, 4 * bs + 1, 5000]
    else:
        batch64 = [generator.randint(1, 2 * bs) for _ in range(62)] + [1, bs + 1]
    return {"long": [5000 if FULL or long_full else 1000], "boundaries": boundaries, "batch64": batch64,
            "mixed": [300, 2, 5000 if FULL else 700, 129]}


def decode_cases():
    cases = []
    for heads in HEAD_SHAPES:
        for block_size in BLOCK_SIZES:
            for dtype in DTYPES:
                for case in ("long", "boundaries", "batch64", "mixed"):
                    # The interpreter runs every shape on the block-boundary case and the long
                    # and batch-64 ones on one dtype and block size per head shape.
                    if not FULL and case != "boundaries" and (dtype != torch.bfloat16 or block_size != 16):
                        continue
                    label = f"h{heads[0]}-kv{heads[1]}-d{heads[2]}-bs{block_size}-{dtype_id(dtype)}-{case}"
                    cases.append(pytest.param(*heads, block_size, dtype, case, id=label))
    return cases


def run_decode(num_heads, num_kv_heads, head_dim, block_size, dtype, context_lens, seed=0, **kwargs):
    from kvserve.kernels.triton import choose_num_splits, decode_workspace, paged_decode_attention
    torch.manual_seed(seed)
    generator = random.Random(seed)
    batch = len(context_lens)
    num_blocks = sum(max(1, math.ceil(n / block_size)) for n in context_lens) + 3
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = random_block_tables(context_lens, block_size, num_blocks, generator)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    query = 2 * torch.randn(batch, num_heads, head_dim, dtype=dtype, device=DEVICE)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    num_splits = kwargs.pop("num_splits", None)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, tables.shape[1] * block_size, query.device)
    workspace = decode_workspace(batch, num_heads, head_dim, num_splits, query.device)
    workspace[0].fill_(float("nan"))
    workspace[1].fill_(float("nan"))
    paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, out=out, num_splits=num_splits,
                           workspace=workspace, **kwargs)
    expected = references.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    expected_fp32 = references.paged_decode_attention(query.float(), k_cache.float(), v_cache.float(),
                                                      tables, lens, scale)
    return out, expected, expected_fp32


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,case", decode_cases())
def test_paged_decode_attention(num_heads, num_kv_heads, head_dim, block_size, dtype, case):
    # The interpreter runs the 5000-token context on the R1-Distill-Qwen shape only (it is slow there).
    context_lens = decode_context_cases(block_size, long_full=num_heads == 28)[case]
    out, expected, expected_fp32 = run_decode(num_heads, num_kv_heads, head_dim, block_size, dtype, context_lens)
    assert_attention_close(out, expected, dtype, expected_fp32)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 16, 64])
def test_paged_decode_split_counts(num_splits):
    """The split-KV combine is exact whatever the split count, including splits past short contexts."""
    lens = [1, 15, 16, 17, 95, 400 if FULL else 120]
    out, expected, expected_fp32 = run_decode(28, 4, 128, 16, torch.bfloat16, lens, seed=3, num_splits=num_splits)
    assert_attention_close(out, expected, torch.bfloat16, expected_fp32)


def decode_configs():
    from kvserve.kernels.triton.decode_attention import DecodeConfig
    return [
        pytest.param(DecodeConfig(tile=16, min_split_tokens=16), 32, id="tile-inside-block"),
        pytest.param(DecodeConfig(tile=64, min_split_tokens=64), 16, id="tile-spans-blocks"),
        pytest.param(DecodeConfig(tile=32, min_split_tokens=32), 8, id="block-size-8"),
        pytest.param(DecodeConfig(tile=16, use_dot=False, min_split_tokens=16), 16, id="broadcast-sum"),
    ]


@pytest.mark.parametrize("group", [1, 7])
@pytest.mark.parametrize("config,block_size", decode_configs())
def test_paged_decode_configs(config, block_size, group):
    lens = [1, block_size - 1, block_size + 1, 3 * block_size, 150]
    out, expected, expected_fp32 = run_decode(4 * group, 4, 128, block_size, torch.float16, lens, seed=4,
                                              config=config)
    assert_attention_close(out, expected, torch.float16, expected_fp32)


def test_paged_decode_padding_rows_are_zero():
    """Rows of length 0 (a CUDA-graph batch padded to its captured size) give zeros, not NaN."""
    for num_splits in (1, 4):
        out, expected, _ = run_decode(9, 3, 64, 16, torch.float32, [0, 7, 0, 33], seed=5, num_splits=num_splits)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
        assert_attention_close(out, expected, torch.float32)


def test_choose_num_splits_fills_whole_waves(monkeypatch):
    """Host heuristic: on an H200-like GPU (132 SMs, 5 programs resident per SM = 660 slots) one
    split from 3/4 of the slots on; below, the split count fills whole waves, bounded by the context."""
    from kvserve.kernels.triton import decode_attention
    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 132)
    config = decode_attention.DecodeConfig(tile=64, min_split_tokens=128)

    def splits(batch, context_len):
        return decode_attention.choose_num_splits(batch, 4, context_len, torch.device("cpu"), config, 5)
    assert splits(64, 131072) == 5            # 1280 programs: 1.94 waves (3 splits gave 1.16)
    assert splits(32, 131072) == 5            # 640 programs: 0.97 of a wave
    assert splits(1, 131072) == 147           # 588 programs
    assert splits(1, 4096) == 32              # underfilled: as many 128-token splits as the context has
    assert splits(8, 100) == 1                # one split covers the whole context
    assert splits(1024, 4096) == 1            # many waves already
    assert splits(128, 131072) == 1           # 512 programs, 0.78 of the slots: enough to stream
    assert splits(96, 8192) == 5              # 384 programs (0.58): 1920 in 2.9 waves
    for batch, context_len in ((3, 1000), (17, 40000), (64, 129)):
        num_splits = splits(batch, context_len)
        assert 1 <= num_splits <= decode_attention.MAX_SPLITS
        assert decode_attention.active_splits(context_len, num_splits, config) <= num_splits


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_step_in_cuda_graph():
    """store_kv + decode captured once, replayed with new block tables, lengths and K/V in place."""
    from kvserve.kernels.triton import choose_num_splits, decode_workspace, paged_decode_attention, store_kv
    torch.manual_seed(6)
    num_heads, num_kv_heads, head_dim, block_size, dtype = 28, 4, 128, 16, torch.bfloat16
    batch, width, num_blocks = 8, 64, 600
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    query = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=DEVICE)
    key = torch.zeros(batch, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    value = torch.zeros_like(key)
    tables = torch.zeros(batch, width, dtype=torch.int64, device=DEVICE)
    lens = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    slots = torch.full((batch,), -1, dtype=torch.int64, device=DEVICE)
    out = torch.zeros_like(query)
    num_splits = choose_num_splits(batch, num_kv_heads, width * block_size, query.device)
    workspace = decode_workspace(batch, num_heads, head_dim, num_splits, query.device)

    def step():
        store_kv(key, value, k_cache, v_cache, slots)
        paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, out=out,
                               num_splits=num_splits, workspace=workspace)

    step()                                  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    generator = random.Random(6)
    for context_lens in ([1, 17, 300, 1000, 5, 0, 16, 999], [1000, 1, 1, 2, 33, 64, 0, 0]):
        row_tables = random_block_tables([max(n, 1) for n in context_lens], block_size, num_blocks, generator, width)
        tables.copy_(row_tables)
        lens.copy_(torch.tensor(context_lens, dtype=torch.int32))
        query.copy_(2 * torch.randn_like(query))
        key.copy_(torch.randn_like(key))
        value.copy_(torch.randn_like(value))
        new_slots = [slots_of(row_tables[i].tolist(), n - 1, n, block_size).item() if n else -1
                     for i, n in enumerate(context_lens)]
        slots.copy_(torch.tensor(new_slots))
        out.fill_(float("nan"))
        expected_k, expected_v = k_cache.clone(), v_cache.clone()
        keep = slots >= 0
        reference.store_kv(key[keep], value[keep], expected_k, expected_v, slots[keep])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
        expected = references.paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5)
        assert_attention_close(out, expected, dtype)


# ---------------------------------------------------------------------------------------------
# paged prefill attention

def prefill_chunk_specs() -> list[tuple[int, int]]:
    """(query_len, cached prefix_len) per chunk of one step; prefix 0 = a plain prefill."""
    if FULL:
        return [(37, 0), (1, 0), (17, 16), (300, 4900), (5, 1), (64, 31), (1, 200), (129, 0), (16, 1000)]
    return [(11, 0), (1, 0), (17, 16), (3, 40), (5, 1), (1, 33)]


def build_prefill_step(specs, block_size, num_kv_heads, head_dim, dtype, generator):
    context_lens = [q + p for q, p in specs]
    num_blocks = sum(math.ceil(n / block_size) for n in context_lens) + 2
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = random_block_tables(context_lens, block_size, num_blocks, generator).tolist()
    chunks, slot_parts, offset = [], [], 0
    for (query_len, prefix_len), table in zip(specs, tables):
        context_len = query_len + prefix_len
        context_slots = slots_of(table, 0, context_len, block_size) if prefix_len else None
        chunks.append(PrefillChunk(offset, query_len, context_len, context_slots))
        slot_parts.append(slots_of(table, prefix_len, context_len, block_size))
        offset += query_len
    return chunks, torch.cat(slot_parts), k_cache, v_cache, offset


def prefill_cases():
    cases = []
    for heads in HEAD_SHAPES:
        for block_size in BLOCK_SIZES:
            for dtype in DTYPES:
                if not FULL and block_size != 16 and dtype != torch.bfloat16:
                    continue
                cases.append(pytest.param(*heads, block_size, dtype,
                                          id=f"h{heads[0]}-kv{heads[1]}-d{heads[2]}-bs{block_size}-{dtype_id(dtype)}"))
    return cases


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", prefill_cases())
def test_paged_prefill_attention(num_heads, num_kv_heads, head_dim, block_size, dtype):
    from kvserve.kernels.triton import paged_prefill_attention, plan_prefill
    torch.manual_seed(7)
    chunks, slot_mapping, k_cache, v_cache, num_tokens = build_prefill_step(
        prefill_chunk_specs(), block_size, num_kv_heads, head_dim, dtype, random.Random(7))
    query = 2 * torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=DEVICE)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(query, k_cache, v_cache, plan_prefill(chunks, slot_mapping), scale, out=out)
    expected = references.paged_prefill_attention(query, k_cache, v_cache, chunks, slot_mapping, scale)
    expected_fp32 = references.paged_prefill_attention(query.float(), k_cache.float(), v_cache.float(), chunks,
                                                       slot_mapping, scale)
    assert_attention_close(out, expected, dtype, expected_fp32)


def test_paged_prefill_configs():
    from kvserve.kernels.triton import paged_prefill_attention, plan_prefill
    from kvserve.kernels.triton.prefill_attention import PrefillConfig
    torch.manual_seed(8)
    specs = [(23, 0), (9, 50), (2, 17)]
    chunks, slot_mapping, k_cache, v_cache, num_tokens = build_prefill_step(
        specs, 16, 4, 128, torch.float16, random.Random(8))
    query = 2 * torch.randn(num_tokens, 28, 128, dtype=torch.float16, device=DEVICE)
    expected = references.paged_prefill_attention(query, k_cache, v_cache, chunks, slot_mapping, 128 ** -0.5)
    plan = plan_prefill(chunks, slot_mapping)
    for config in (PrefillConfig(block_m=16, block_n=16), PrefillConfig(block_m=64, block_n=32),
                   PrefillConfig(block_m=128, block_n=64)):
        out = torch.full_like(query, float("nan"))
        paged_prefill_attention(query, k_cache, v_cache, plan, 128 ** -0.5, out=out, config=config)
        assert_attention_close(out, expected, torch.float16)


# ---------------------------------------------------------------------------------------------
# fused RMSNorm (+ residual) and SiLU * mul

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("hidden_size", [576, 3584, 4096])
@pytest.mark.parametrize("num_rows", [1, 7, 64])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(with_residual, num_rows, hidden_size, dtype):
    from kvserve.kernels.triton import rms_norm
    torch.manual_seed(9)
    x = 3 * torch.randn(num_rows, hidden_size, dtype=dtype, device=DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden_size, device=DEVICE)).to(dtype)
    residual = torch.randn_like(x) if with_residual else None
    result = rms_norm(x, weight, 1e-6, residual)
    expected = references.rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        (out, new_residual), (expected_out, expected_residual) = result, expected
        if INTERPRET and dtype == torch.bfloat16:
            assert_within_ulps(new_residual, expected_residual, ulps=1)
        else:
            assert torch.equal(new_residual, expected_residual)
    else:
        out, expected_out = result, expected
    assert out.dtype == expected_out.dtype
    assert_within_ulps(out, expected_out)
    assert_rounding_matches(out, expected_out)


def test_rms_norm_reference_matches_model_layer():
    """The reference is the model's RMSNorm (plus the decoder layer's residual add), bit for bit."""
    from kvserve.model.layers import TORCH_OPS_ONLY, RMSNorm, apply_kernel_switches
    torch.manual_seed(10)
    for dtype in DTYPES:
        norm = apply_kernel_switches(RMSNorm(96, 1e-5).to(device=DEVICE, dtype=dtype), TORCH_OPS_ONLY)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(96))
        x, residual = torch.randn(5, 96, dtype=dtype, device=DEVICE), torch.randn(5, 96, dtype=dtype, device=DEVICE)
        with torch.no_grad():   # the layer's torch path (TORCH_OPS_ONLY), not its fused kernel
            assert torch.equal(references.rms_norm(x, norm.weight, 1e-5), norm(x))
            out, new_residual = references.rms_norm(x, norm.weight, 1e-5, residual)
            assert torch.equal(new_residual, residual + x) and torch.equal(out, norm(residual + x))


def test_rms_norm_fp32_weight_bf16_input():
    """An fp32 weight on bf16 activations: torch promotes the product to fp32; so does the kernel."""
    from kvserve.kernels.triton import rms_norm
    torch.manual_seed(11)
    x = torch.randn(3, 576, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.randn(576, device=DEVICE)
    out = rms_norm(x, weight, 1e-6)
    expected = references.rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=2.0 ** -7)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_rows,inner_size", [(1, 1536), (7, 18944 if FULL else 1000), (64, 14336 if FULL else 700)])
def test_silu_and_mul(num_rows, inner_size, dtype):
    from kvserve.kernels.triton import silu_and_mul
    torch.manual_seed(12)
    gate_up = 3 * torch.randn(num_rows, 2 * inner_size, dtype=dtype, device=DEVICE)
    out = silu_and_mul(gate_up)
    expected = references.silu_and_mul(gate_up)
    assert out.shape == expected.shape and out.dtype == dtype
    if dtype == torch.float32:
        # Triton's fp32 exp differs from torch's by a few ulps, which near zero exceeds an
        # ulp bound relative to the tiny result (seen on an H200: 1.9e-9 over 8 ulps).
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        return
    assert_within_ulps(out, expected)
    assert_rounding_matches(out, expected)


def test_silu_and_mul_reference_matches_model_layer():
    from kvserve.model.layers import TORCH_OPS_ONLY, SwiGLU, apply_kernel_switches
    torch.manual_seed(13)
    mlp = apply_kernel_switches(SwiGLU(32, 48).to(DEVICE), TORCH_OPS_ONLY)
    x = torch.randn(4, 32, device=DEVICE)
    with torch.no_grad():
        assert torch.equal(mlp.down_proj(references.silu_and_mul(mlp.gate_up_proj(x))), mlp(x))


# ---------------------------------------------------------------------------------------------
# backend

@pytest.mark.parametrize("plain_prefill", ["triton", "sdpa"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,dtype",
                         [(9, 3, 64, torch.float32), (28, 4, 128, torch.bfloat16)])
def test_triton_backend_matches_torch_backend(num_heads, num_kv_heads, head_dim, dtype, plain_prefill):
    """A mixed step (decodes, then plain and chunked prefills) through both backends, twice (the
    second layer reuses the prefill plan)."""
    from kvserve.attention.triton_backend import TritonAttentionBackend
    torch.manual_seed(14)
    generator = random.Random(14)
    block_size = 16
    decode_lens = [1, 16, 17, 90] if not FULL else [1, 16, 17, 90, 2000, 33]
    prefill_specs = [(12, 0), (9, 40), (2, 15)] if not FULL else [(200, 0), (64, 500), (2, 15), (1, 0)]
    context_lens = decode_lens + [q + p for q, p in prefill_specs]
    num_blocks = sum(math.ceil(n / block_size) for n in context_lens) + 2
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = random_block_tables(context_lens, block_size, num_blocks, generator)
    table_rows = tables.tolist()
    slot_parts = [slots_of(table_rows[i], n - 1, n, block_size) for i, n in enumerate(decode_lens)]
    prefills, offset = [], len(decode_lens)
    for j, (query_len, prefix_len) in enumerate(prefill_specs):
        row = table_rows[len(decode_lens) + j]
        context_len = query_len + prefix_len
        slot_parts.append(slots_of(row, prefix_len, context_len, block_size))
        prefills.append(PrefillChunk(offset, query_len, context_len,
                                     slots_of(row, 0, context_len, block_size) if prefix_len else None))
        offset += query_len
    decode_tables = tables[:len(decode_lens)]
    lens = torch.tensor(decode_lens, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slot_parts), num_decode_tokens=len(decode_lens),
        decode_block_tables=decode_tables, decode_context_lens=lens,
        decode_context_mask=references.decode_context_mask(lens, decode_tables.shape[1] * block_size),
        prefills=prefills)
    backend, torch_backend = TritonAttentionBackend(plain_prefill=plain_prefill), TorchAttentionBackend()
    triton_caches = (k_cache.clone(), v_cache.clone())
    for _layer in range(2):
        query = 2 * torch.randn(offset, num_heads, head_dim, dtype=dtype, device=DEVICE)
        key = torch.randn(offset, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
        value = torch.randn_like(key)
        out = backend.forward(query, key, value, *triton_caches, meta, head_dim ** -0.5)
        expected = torch_backend.forward(query, key, value, k_cache, v_cache, meta, head_dim ** -0.5)
        assert torch.equal(triton_caches[0], k_cache) and torch.equal(triton_caches[1], v_cache)
        assert_attention_close(out, expected, dtype)
