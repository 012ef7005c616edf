"""The native CPU kernels (kvserve.kernels.cpu: packed GEMM, paged attention) against torch references,
and the native whole-model path's selection."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import reference

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build the CPU kernel")


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (28, 4, 128), (4, 1, 32)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("batch", [1, 5])
def test_matches_reference(num_heads, num_kv_heads, head_dim, block_size, batch):
    torch.manual_seed(num_heads * 100 + block_size + batch)
    max_len = 70
    max_blocks = -(-max_len // block_size)
    num_blocks = batch * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    # Ragged lengths (1 .. max_len) over shuffled, non-contiguous blocks; unused table entries point anywhere.
    lengths = torch.randint(1, max_len + 1, (batch,), dtype=torch.int32)
    lengths[0] = max_len
    tables = torch.randperm(num_blocks)[:batch * max_blocks].view(batch, max_blocks)
    query = torch.randn(batch, num_heads, head_dim)
    mask = torch.arange(max_blocks * block_size)[None, :] < lengths[:, None]
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, mask, head_dim ** -0.5)
    got = cpu_kernels.paged_decode_attention(query, k_cache, v_cache, tables, lengths, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_batch_split_across_threads_matches_single_thread():
    torch.manual_seed(3)
    k_cache, v_cache = torch.randn(64, 16, 2, 64), torch.randn(64, 16, 2, 64)
    tables = torch.randperm(64).view(8, 8)
    lengths = torch.tensor([128, 1, 77, 5, 128, 64, 3, 100], dtype=torch.int32)
    query = torch.randn(8, 6, 64)
    together = cpu_kernels.paged_decode_attention(query, k_cache, v_cache, tables, lengths, 0.125)
    one_by_one = torch.cat([cpu_kernels.paged_decode_attention(query[i:i + 1], k_cache, v_cache, tables[i:i + 1],
                                                               lengths[i:i + 1], 0.125) for i in range(8)])
    assert torch.equal(together, one_by_one)


def test_rejects_bad_input():
    k_cache = torch.randn(4, 16, 2, 64)
    tables = torch.zeros(1, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="fp32"):
        cpu_kernels.paged_decode_attention(torch.randn(1, 4, 64).bfloat16(), k_cache, k_cache, tables,
                                           torch.tensor([3], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="exceeds its block table"):
        cpu_kernels.paged_decode_attention(torch.randn(1, 4, 64), k_cache, k_cache, tables,
                                           torch.tensor([33], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.paged_decode_attention(torch.randn(1, 3, 64), k_cache, k_cache, tables,
                                           torch.tensor([3], dtype=torch.int32), 0.1)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,in_features,out_features",
                         [(1, 64, 96), (5, 33, 40), (7, 576, 960), (130, 48, 17), (130, 700, 40), (13, 1536, 33),
                          (200, 1536, 100)])
def test_linear_matches_torch(bf16, rows, in_features, out_features):
    """Every micro-tile height (1-6 rows), partial panels, odd K, more rows than one packed row block
    (K = 700: 90 rows; K = 1536: 42) with a partial sliver after the last full one, the MLP's long K."""
    torch.manual_seed(rows + out_features)
    weight, bias, x = torch.randn(out_features, in_features), torch.randn(out_features), torch.randn(rows, in_features)
    # bf16 weights are widened exactly, so the reference is fp32 math on the rounded weight.
    effective = weight.bfloat16().float() if bf16 else weight
    packed = cpu_kernels.pack_weight(weight, bf16)
    assert packed.dtype == (torch.bfloat16 if bf16 else torch.float32)
    expected = F.linear(x.double(), effective.double(), bias.double()).float()
    torch.testing.assert_close(cpu_kernels.linear(x, packed, out_features, bias), expected, atol=1e-4, rtol=1e-4)
    residual = torch.randn(rows, out_features)
    summed = cpu_kernels.linear(x, packed, out_features, None, out=residual.clone(), accumulate=True)
    torch.testing.assert_close(summed, residual + F.linear(x.double(), effective.double()).float(), atol=1e-4, rtol=1e-4)


def test_linear_rejects_bad_input():
    packed = cpu_kernels.pack_weight(torch.randn(16, 8), False)
    with pytest.raises(ValueError, match="features"):
        cpu_kernels.linear(torch.randn(2, 9), packed, 16)
    with pytest.raises(ValueError, match="fp32"):
        cpu_kernels.linear(torch.randn(2, 8).double(), packed, 16)


def test_bf16_cache_matches_reference_on_the_widened_cache():
    torch.manual_seed(5)
    k_cache, v_cache = torch.randn(12, 16, 2, 64).bfloat16(), torch.randn(12, 16, 2, 64).bfloat16()
    tables = torch.randperm(12)[:8].view(2, 4)
    lengths = torch.tensor([64, 23], dtype=torch.int32)
    query = torch.randn(2, 6, 64)
    mask = torch.arange(64)[None, :] < lengths[:, None]
    expected = reference.paged_decode_attention(query, k_cache.float(), v_cache.float(), tables, mask, 0.125)
    got = cpu_kernels.paged_decode_attention(query, k_cache, v_cache, tables, lengths, 0.125)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(28, 4, 128), (9, 3, 64), (4, 2, 48), (2, 2, 32)])
def test_bf16_cache_over_shapes_and_chunk_edges(num_heads, num_kv_heads, head_dim):
    """bf16 K/V go through the unpack-widened path (head_dim a multiple of 16, the query permuted to
    match) or the scalar one (48); contexts end before, on and after the 32-key P @ V chunk edges."""
    torch.manual_seed(num_heads + head_dim)
    block_size, lengths = 16, torch.tensor([1, 31, 32, 33, 97, 64], dtype=torch.int32)
    max_blocks = -(-int(lengths.max()) // block_size)
    num_blocks = len(lengths) * max_blocks + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).bfloat16()
    tables = torch.randperm(num_blocks)[:len(lengths) * max_blocks].view(len(lengths), max_blocks)
    query = torch.randn(len(lengths), num_heads, head_dim)
    mask = torch.arange(max_blocks * block_size)[None, :] < lengths[:, None]
    expected = reference.paged_decode_attention(query, k_cache.float(), v_cache.float(), tables, mask,
                                                head_dim ** -0.5)
    got = cpu_kernels.paged_decode_attention(query, k_cache, v_cache, tables, lengths, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_per_token_contexts_give_causal_prefill_attention():
    """A prompt's tokens, each attending to its own prefix through the paged cache, equal causal SDPA
    over the contiguous prompt: the same kernel serves prefill chunks and decodes."""
    torch.manual_seed(6)
    length, heads, kv_heads, dim, block_size = 37, 6, 2, 32, 8
    keys, values = torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
    query = torch.randn(length, heads, dim)
    table = torch.tensor([[4, 0, 2, 5, 1]])
    k_cache, v_cache = torch.zeros(6, block_size, kv_heads, dim), torch.zeros(6, block_size, kv_heads, dim)
    positions = torch.arange(length)
    slots = table[0, positions // block_size] * block_size + positions % block_size
    k_cache.view(-1, kv_heads, dim)[slots] = keys
    v_cache.view(-1, kv_heads, dim)[slots] = values
    got = cpu_kernels.paged_attention(query, k_cache, v_cache, table, torch.zeros(length, dtype=torch.int32),
                                      (positions + 1).to(torch.int32), dim ** -0.5)
    group = heads // kv_heads
    expected = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys.repeat_interleave(group, 1).transpose(0, 1),
        values.repeat_interleave(group, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_backend_selection_on_cpu(tiny_checkpoint):
    """auto picks the native path for Llama/Qwen2 in fp32 and bf16; quantized KV falls back to torch
    under auto and is a clear error under `native`."""
    from kvserve import LLM
    from kvserve.model.cpu_native import NativeCpuForward
    folder, _ = tiny_checkpoint
    options = dict(device="cpu", kv_cache_memory=4 << 20)
    for dtype in ("float32", "bfloat16"):
        path = LLM(folder, dtype=dtype, **options).engine.runner.forward_path
        assert isinstance(path.native, NativeCpuForward) and path.name == "native"
    quantized = LLM(folder, kv_cache_dtype="int8", **options).engine.runner.forward_path
    assert quantized.native is None and quantized.name == "torch"
    with pytest.raises(ValueError, match="quantized KV"):
        LLM(folder, kv_cache_dtype="int8", attention_backend="native", **options)


def test_argmax_rows_matches_torch_including_ties_and_nan():
    torch.manual_seed(8)
    logits = torch.randn(7, 1003)
    logits[1, 5] = logits[1, 900] = 50.0          # a tie: the first index wins
    logits[2, :] = -torch.inf
    logits[3, 17] = torch.nan                     # NaN counts as the maximum
    logits[4, -1] = 99.0                          # the scalar tail
    assert torch.equal(cpu_kernels.argmax_rows(logits), logits.argmax(dim=-1))
    with pytest.raises(ValueError, match="2-D fp32"):
        cpu_kernels.argmax_rows(logits.double())


def test_fma_probe_reports_each_thread():
    """kvserve bench records each thread's FMA rate beside every CPU run (the VM's cores differ at
    times, which the total hides)."""
    rates = cpu_kernels.fma_gflops_by_thread(0.05)
    if rates is None:
        pytest.skip("no AVX2: the probe has no vector loop to time")
    assert len(rates) == torch.get_num_threads()
    assert all(rate > 0 for rate in rates)
    total = cpu_kernels.fma_gflops(0.05)
    assert total is not None and total > 0
