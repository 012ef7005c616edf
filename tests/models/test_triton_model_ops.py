"""The model's fused CUDA path: Triton rotary against layers.apply_rotary, and a whole tiny model with the
fused norm/rotary/SiLU kernels against the same model on torch ops.

Runs on CUDA (skipped without it, unless TRITON_INTERPRET=1, which runs the rotary kernel on CPU tensors).
Rotary: fp32 within 1e-6 (fused multiply-add); 16-bit within one unit in the last place of the operands
(torch rounds each product, then the sum; the kernel's rounding of the products can differ by an ulp,
measured on an H200 in ~20% of elements, never more than 1 ulp).
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

from kvserve.model.layers import TORCH_OPS_ONLY, apply_rotary, rotate_queries_and_keys  # noqa: E402


def _cos_sin(num_tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 32768, (num_tokens,), device=DEVICE).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (28, 4, 128), (8, 8, 64), (32, 8, 128)])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rotary_matches_reference(dtype, num_heads, num_kv_heads, head_dim, num_tokens):
    from kvserve.kernels.triton.rotary import rotary_inplace
    torch.manual_seed(num_tokens * head_dim)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    cos, sin = _cos_sin(num_tokens, head_dim, dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    expected_q = apply_rotary(qkv[:, :q_size].reshape(num_tokens, num_heads, head_dim), cos, sin)
    expected_k = apply_rotary(qkv[:, q_size:q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim), cos, sin)
    expected_v = qkv[:, q_size + kv_size:].clone()
    rotary_inplace(qkv[:, :q_size + kv_size].view(num_tokens, num_heads + num_kv_heads, head_dim), cos, sin)
    got_q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    got_k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    # One ulp of |x| <= 4 in the 16-bit formats; the interpreter truncates instead of rounding: 2 ulps there.
    ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(dtype)
    ulps = 2 if INTERPRET else 1
    tol = {"atol": 1e-6, "rtol": 1e-5} if ulp is None else {"atol": 4 * ulp * ulps, "rtol": ulp * ulps}
    torch.testing.assert_close(got_q, expected_q, **tol)
    torch.testing.assert_close(got_k, expected_k, **tol)
    assert torch.equal(qkv[:, q_size + kv_size:], expected_v), "the value columns must not be touched"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (28, 4, 128), (4, 2, 16)])
def test_rotary_and_store_kv_matches_rotary_then_store(dtype, num_heads, num_kv_heads, head_dim):
    """The fused kernel leaves qkv as rotary_inplace does and the caches as store_kv does, skipping
    slot -1 (a padding token)."""
    from kvserve.kernels.triton.kv_store import store_kv
    from kvserve.kernels.triton.rotary import rotary_and_store_kv, rotary_inplace
    torch.manual_seed(head_dim)
    num_tokens, num_blocks, block_size = 11, 6, 4
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    cos, sin = _cos_sin(num_tokens, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[3] = -1
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), 7.0, device=DEVICE, dtype=dtype)
              for _ in range(4)]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    expected = qkv.clone()
    rotary_inplace(expected[:, :q_size + kv_size].view(num_tokens, num_heads + num_kv_heads, head_dim), cos, sin)
    store_kv(expected[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
             expected[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim), caches[0], caches[1], slots)
    rotary_and_store_kv(qkv, num_heads, num_kv_heads, head_dim, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(qkv, expected)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert (caches[2].view(-1, num_kv_heads, head_dim)[slots[slots >= 0]] != 7.0).any()
    with pytest.raises(ValueError, match="fused QKV"):
        rotary_and_store_kv(qkv[:, :-1], num_heads, num_kv_heads, head_dim, cos, sin, caches[2], caches[3], slots)


def test_rotary_rejects_bad_shapes():
    from kvserve.kernels.triton.rotary import rotary_inplace
    qk = torch.randn(4, 3, 64, device=DEVICE)
    cos, sin = _cos_sin(4, 64, torch.float32)
    with pytest.raises(ValueError, match="cos/sin"):
        rotary_inplace(qk, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="even head_dim"):
        rotary_inplace(torch.randn(4, 3, 63, device=DEVICE), cos[:, :63], sin[:, :63])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused path is taken for CUDA tensors only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotate_queries_and_keys_fused_equals_torch(dtype):
    torch.manual_seed(0)
    qkv = torch.randn(5, (9 + 2 * 3) * 64, device=DEVICE).to(dtype)
    cos, sin = _cos_sin(5, 64, dtype)
    expected = [t.clone() for t in rotate_queries_and_keys(qkv.clone(), 9, 3, 64, cos, sin, TORCH_OPS_ONLY)]
    got = rotate_queries_and_keys(qkv.clone(), 9, 3, 64, cos, sin)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4 * 2.0 ** -7, "rtol": 2.0 ** -7}
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="whole-model check needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_model_path_matches_torch_ops(tiny_checkpoint, dtype):
    """The same engine with the fused kernels on and off: greedy tokens identical, logits close."""
    from kvserve import LLM, SamplingParams
    folder, _ = tiny_checkpoint
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
    llm = LLM(folder, device="cuda", dtype=dtype, kv_cache_memory=1 << 24)
    fused = llm.generate(prompts, params, use_tqdm=False)
    llm_plain = LLM(folder, device="cuda", dtype=dtype, kv_cache_memory=1 << 24, enforce_eager=True,
                    fused_ops=False)
    plain = llm_plain.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fused, plain):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        if dtype == "float32":
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            token = a.outputs[0].token_ids[0]
            assert abs(first_a[token] - first_b[token]) < 1e-4
        else:
            # bf16: the fused norm/rotary/SiLU round differently by an ulp, which can swap near-tied tokens of a
            # tiny random model; the first step's top-3 must overlap and agree where it does.
            common = set(first_a) & set(first_b)
            assert len(common) >= 2, (first_a, first_b)
            worst = max(abs(first_a[t] - first_b[t]) for t in common)
            assert worst < 0.1, (worst, first_a, first_b)
