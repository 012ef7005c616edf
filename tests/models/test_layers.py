"""Building blocks against transformers' own implementations, bit for bit where the model relies on it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kvserve.model.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_rms_norm_is_transformers_bit_for_bit(dtype, rows):
    torch.manual_seed(rows)
    ours, theirs = RMSNorm(576, 1e-5), LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x, residual = torch.randn(rows, 576, dtype=dtype) * 3, torch.randn(rows, 576, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, residual + x) and torch.equal(normed, theirs(residual + x))
