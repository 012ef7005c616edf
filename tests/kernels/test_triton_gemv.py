"""The Triton skinny GEMM (kvserve/kernels/triton/gemv.py) against F.linear in fp32 on the same
bf16/fp16 operands: every row count 1-16, feature counts that are not multiples of the tiles, K not
a multiple of the K step, bias, and split-K (fp32 atomics).

Runs on CUDA; skipped without it unless TRITON_INTERPRET=1 (Triton's CPU interpreter)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET else "cuda"

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not INTERPRET,
                                reason="needs a CUDA GPU (or TRITON_INTERPRET=1 for Triton's CPU interpreter)")
pytest.importorskip("triton")

from kvserve.kernels.triton import gemv as gemv_mod  # noqa: E402

CONFIGS = [gemv_mod.GemvConfig(), gemv_mod.GemvConfig(block_n=16, block_k=128, split_k=3),
           gemv_mod.GemvConfig(block_n=64, block_k=64, split_k=1, num_warps=8, num_stages=3)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "split3", "wide"])
@pytest.mark.parametrize("rows,out_features,in_features,bias",
                         [(1, 96, 256, False), (3, 100, 520, True), (16, 33, 1024, False), (7, 257, 136, True)])
def test_gemv_matches_fp32_linear(dtype, config, rows, out_features, in_features, bias):
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter computes bf16 tl.dot wrongly (numpy has no bf16); runs on CUDA")
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).to(DEVICE, dtype)
    b = torch.randn(out_features, generator=generator).to(DEVICE, dtype) if bias else None
    got = gemv_mod.gemv(x, weight, b, config=config)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    expected = F.linear(x.float(), weight.float(), b.float() if bias else None)
    # Split-K: the last split to arrive at a tile reduces it and resets the tile's counter, so a
    # second call on the same shape must give the same result.
    assert torch.equal(gemv_mod.gemv(x, weight, b, config=config), got)
    # fp32 accumulation on both sides: the difference is the output's rounding (and summation order).
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2 if dtype == torch.bfloat16 else 2e-3)


def test_gemv_rejects_what_it_does_not_take():
    weight = torch.zeros(32, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        gemv_mod.gemv(torch.zeros(17, 64, dtype=torch.bfloat16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="rows"):
        gemv_mod.gemv(torch.zeros(2, 64, dtype=torch.float32, device=DEVICE), weight)
    with pytest.raises(ValueError, match="bias"):
        gemv_mod.gemv(torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE), weight,
                      torch.zeros(31, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows,intermediate,in_features,bias", [(1, 48, 256, False), (5, 70, 520, True), (16, 128, 64, False)])
def test_gemv_silu_mul_matches_swiglu_activation(dtype, rows, intermediate, in_features, bias):
    """silu_mul: silu(gate) * up from one weight of gate rows then up rows, rounded as the unfused
    path rounds (the GEMM's output, then F.silu, then the product, each to the model dtype)."""
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter computes bf16 tl.dot wrongly (numpy has no bf16); runs on CUDA")
    generator = torch.Generator().manual_seed(rows + intermediate)
    x = torch.randn(rows, in_features, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(2 * intermediate, in_features, generator=generator) * 0.1).to(DEVICE, dtype)
    b = torch.randn(2 * intermediate, generator=generator).to(DEVICE, dtype) if bias else None
    got = gemv_mod.gemv(x, weight, b, silu_mul=True)
    assert got.shape == (rows, intermediate) and got.dtype == dtype
    gate_up = F.linear(x.float(), weight.float(), b.float() if bias else None).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = F.silu(gate).to(dtype).float() * up
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2 if dtype == torch.bfloat16 else 4e-3)
    with pytest.raises(ValueError, match="even"):
        gemv_mod.gemv(x, weight[:-1], silu_mul=True)
