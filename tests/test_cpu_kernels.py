"""The native CPU paged decode attention (kvserve.kernels.cpu) against the torch reference."""

from __future__ import annotations

import pytest
import torch

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
