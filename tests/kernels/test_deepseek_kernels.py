"""The Triton MLA decode kernel and latent store (kvserve.kernels.triton.mla_decode) against the
torch reference (kvserve.kernels.mla_reference), and the DeepSeek model's Triton path against its
torch path.

Runs on CUDA; without CUDA it is skipped unless TRITON_INTERPRET=1 (then on CPU tensors in
Triton's interpreter, small shapes only). Tolerances, kernel vs reference on the same inputs:
bf16 atol 3e-2 / rtol 2e-2 (probabilities are rounded to bf16 before P @ latent in both, in a
different order), fp32 atol 1e-4 / rtol 1e-4. Outputs are poisoned with NaN before each launch.
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

from kvserve.kernels import mla_reference  # noqa: E402

TOL = {torch.bfloat16: (3e-2, 2e-2), torch.float32: (1e-4, 1e-4)}
DTYPES = [torch.float32] if INTERPRET else [torch.bfloat16, torch.float32]
# (heads, kv_lora_rank, rope dim): tiny; V2-Lite (16 heads); V3 (128 heads: four head blocks);
# a rank that is not a power of two.
SHAPES = [(4, 32, 8)] if INTERPRET else [(4, 32, 8), (16, 512, 64), (128, 512, 64), (20, 96, 32)]


def _paged_inputs(batch: int, heads: int, rank: int, rope: int, block_size: int, lengths: list[int],
                  dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(1, -(-max(lengths) // block_size))
    num_blocks = batch * max_blocks + 3
    latent_cache = torch.randn(num_blocks, block_size, 1, rank, generator=generator).to(DEVICE, dtype)
    rope_cache = torch.randn(num_blocks, block_size, 1, rope, generator=generator).to(DEVICE, dtype)
    tables = torch.randperm(num_blocks, generator=generator)[:batch * max_blocks].view(batch, max_blocks)
    q_latent = (torch.randn(batch, heads, rank, generator=generator) * 0.3).to(DEVICE, dtype)
    q_rope = (torch.randn(batch, heads, rope, generator=generator) * 0.3).to(DEVICE, dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return q_latent, q_rope, latent_cache, rope_cache, tables.to(DEVICE), lens


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-r{s[1]}-dr{s[2]}")
@pytest.mark.parametrize("num_splits", [1, None], ids=["one-split", "auto-splits"])
def test_mla_decode_matches_reference(dtype, shape, num_splits):
    from kvserve.kernels.triton.mla_decode import mla_decode_attention
    heads, rank, rope = shape
    lengths = [1, 37, 0, 150] if INTERPRET else [1, 37, 0, 300, 2000]
    block_size = 16
    q_latent, q_rope, latent_cache, rope_cache, tables, lens = _paged_inputs(
        len(lengths), heads, rank, rope, block_size, lengths, dtype, seed=heads + rank)
    scale = 0.13
    expected = mla_reference.mla_decode_attention(q_latent, q_rope, latent_cache, rope_cache, tables, lens, scale)
    out = torch.full_like(expected, float("nan"))
    mla_decode_attention(q_latent, q_rope, latent_cache, rope_cache, tables.to(torch.int32), lens, scale,
                         out=out, num_splits=num_splits)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    assert torch.all(out[2] == 0)           # context length 0: a padding row


def test_mla_decode_strided_queries():
    """The model passes q_latent as a transposed bmm output and q_rope as a view into q."""
    from kvserve.kernels.triton.mla_decode import mla_decode_attention
    dtype = torch.float32
    heads, rank, rope = SHAPES[0]
    lengths = [20, 33]
    _, _, latent_cache, rope_cache, tables, lens = _paged_inputs(2, heads, rank, rope, 16, lengths, dtype, seed=3)
    q_latent = torch.randn(heads, 2, rank, device=DEVICE).transpose(0, 1)
    q_full = torch.randn(2, heads, 16 + rope, device=DEVICE)
    q_rope = q_full[..., 16:]
    expected = mla_reference.mla_decode_attention(q_latent.contiguous(), q_rope.contiguous(), latent_cache,
                                                  rope_cache, tables, lens, 0.2)
    out = mla_decode_attention(q_latent, q_rope, latent_cache, rope_cache, tables, lens, 0.2)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_rows_matches_reference_and_skips_padding(dtype):
    from kvserve.kernels.triton.mla_decode import store_latent
    rank, rope, block_size = 32, 8, 16
    latent_cache = torch.zeros(4, block_size, 1, rank, dtype=dtype, device=DEVICE)
    rope_cache = torch.zeros(4, block_size, 1, rope, dtype=dtype, device=DEVICE)
    latent = torch.randn(5, 1, rank, device=DEVICE).to(dtype)
    k_rope = torch.randn(5, 1, rope, device=DEVICE).to(dtype)
    slots = torch.tensor([3, 17, -1, 63, 40], device=DEVICE)
    store_latent(latent, k_rope, latent_cache, rope_cache, slots)
    flat_latent, flat_rope = latent_cache.view(-1, rank), rope_cache.view(-1, rope)
    keep = slots >= 0
    assert torch.equal(flat_latent[slots[keep]], latent[keep, 0])
    assert torch.equal(flat_rope[slots[keep]], k_rope[keep, 0])
    assert int((flat_latent != 0).any(dim=1).sum()) == int(keep.sum())


@pytest.mark.skipif(INTERPRET, reason="whole-model run: CUDA only")
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_model_triton_path_matches_torch_path(arch, tmp_path):
    """Greedy tokens of the Triton path (MLA kernel, grouped MoE, CUDA graphs) equal the torch
    reference path's on the same tiny model, in fp32; bf16 logprobs stay close."""
    from deepseek_fixtures import build_tiny_deepseek

    from kvserve import LLM, SamplingParams
    build_tiny_deepseek(arch, tmp_path, "cpu")
    prompts = [{"prompt_token_ids": [1] + list(range(10 + i, 40 + 7 * i))} for i in range(5)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = {}
    for name, options in {"torch": dict(attention_backend="torch", enforce_eager=True),
                          "triton": dict(attention_backend="triton")}.items():
        llm = LLM(str(tmp_path), dtype="float32", device="cuda", kv_cache_memory=16 << 20, **options)
        results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert results["triton"] == results["torch"]
