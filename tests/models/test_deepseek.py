"""DeepSeek-V2/V3 (MLA + MoE) against transformers on the same tiny random weights, and the
latent cache, routing, grouped experts and expert-load statistics on their own."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import INVARIANCE_CASES, TEST_DEVICE, assert_batch_invariant, assert_decode_close, prompt_logprob_errors
from deepseek_fixtures import build_tiny_deepseek, tiny_deepseek_config
from kvserve import LLM, SamplingParams
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk

PROMPTS = [
    [1, 17, 42, 99, 3, 250, 7],
    [1, 5],
    [1] + list(range(30, 90)),          # longer than several blocks
    [1, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211],
]
MAX_NEW = 12
# fp32 on both sides: differences are GEMM summation order and the order experts are added in.
LOGITS_ATOL, LOGITS_RTOL = 1e-4, 1e-4


def _options(**overrides):
    options = dict(dtype="float32", device=TEST_DEVICE, kv_cache_memory=4 << 20, block_size=16)
    options.update(overrides)
    return options


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = build_tiny_deepseek(request.param, folder, TEST_DEVICE)
    return str(folder), model


@pytest.fixture(scope="module")
def engine_llm(checkpoint):
    folder, hf_model = checkpoint
    return LLM(folder, **_options()), hf_model


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=TEST_DEVICE)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         min_new_tokens=max_new, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _prefill_logits(llm, prompt: list[int]) -> torch.Tensor:
    runner = llm.engine.runner
    n = len(prompt)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=TEST_DEVICE))
    meta.prefills.append(PrefillChunk(0, n, n, None))
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(prompt, device=TEST_DEVICE), torch.arange(n, device=TEST_DEVICE),
                              runner.kv_store, meta, runner.backend)
        return runner.model.compute_logits(hidden)


def test_logits_match_transformers(engine_llm):
    llm, hf_model = engine_llm
    prompt = PROMPTS[2]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt], device=TEST_DEVICE)).logits[0].float()
    torch.testing.assert_close(_prefill_logits(llm, prompt), expected, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_decode_logprobs_match_transformers(engine_llm):
    """Absorbed decode over the paged latent cache vs transformers' expanded attention: the
    logprob of every generated token, step by step."""
    llm, hf_model = engine_llm
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    sequence = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([sequence], device=TEST_DEVICE)).logits[0].float(), -1)
    for step, token in enumerate(out.token_ids):
        expected = ref[len(prompt) - 1 + step, token].item()
        assert out.logprobs[step][token] == pytest.approx(expected, abs=1e-4)


def test_greedy_matches_transformers(engine_llm):
    llm, hf_model = engine_llm
    expected = [_hf_greedy(hf_model, p, MAX_NEW) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


@pytest.fixture(scope="module")
def alone(engine_llm):
    """Each prompt's greedy tokens when it runs alone (the invariance tests' reference)."""
    llm, _ = engine_llm
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("case", list(INVARIANCE_CASES))
def test_batch_invariance(checkpoint, engine_llm, alone, case):
    """As for Llama; here chunked prefill attends over a cached latent prefix."""
    folder, _ = checkpoint
    reference_llm, _ = engine_llm
    overrides = INVARIANCE_CASES[case]
    assert_batch_invariant(folder, reference_llm, alone, PROMPTS, MAX_NEW, _options(**overrides), overrides)


def test_latent_cache_layout_and_bytes(engine_llm):
    """One latent + RoPE key per token and layer; no per-head K/V anywhere in the pool."""
    llm, hf_model = engine_llm
    cfg = hf_model.config
    engine = llm.engine
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert engine.kv_bytes_per_token == cfg.num_hidden_layers * width * 4
    latent, rope = engine.runner.kv_store[0]
    assert latent.shape[1:] == (16, 1, cfg.kv_lora_rank) and rope.shape[1:] == (16, 1, cfg.qk_rope_head_dim)
    assert len(engine.runner.kv_store) == cfg.num_hidden_layers
    from kvserve.model.mla_cache import mha_equivalent_bytes_per_token
    sizes = mha_equivalent_bytes_per_token(cfg, dtype_bytes=4)
    assert sizes["mla"] == engine.kv_bytes_per_token
    assert sizes["mha"] == cfg.num_hidden_layers * cfg.num_attention_heads * (16 + 8 + 16) * 4


def test_v2_lite_config_kv_bytes():
    """The benchmark's DeepSeek-V2-Lite shape: 27 layers x (512 + 64) x 2 bytes = 31,104 bytes per
    token in bf16, against 276,480 for the same model with an expanded per-head K/V cache."""
    import transformers

    from kvserve.model.mla_cache import build_mla_kv_cache_spec, mha_equivalent_bytes_per_token
    cfg = transformers.AutoConfig.from_pretrained("benchmarks/configs/deepseek-v2-lite")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.kv_lora_rank) == (2048, 27, 16, 512)
    assert cfg.q_lora_rank is None and cfg.n_routed_experts == 64 and cfg.num_experts_per_tok == 6
    spec = build_mla_kv_cache_spec(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, torch.bfloat16)
    sizes = mha_equivalent_bytes_per_token(cfg)
    assert spec.bytes_per_token == sizes["mla"] == 31104
    assert sizes["mha"] == 276480
    fp8 = build_mla_kv_cache_spec(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, torch.bfloat16,
                                  kv_cache_dtype="fp8_e4m3")
    # fp8 latent (512 B + one fp16 scale) + bf16 RoPE key (128 B) per layer.
    assert fp8.bytes_per_token == 27 * (512 + 2 + 128)


# Bounds on |logprob difference| of the full-precision greedy tokens forced through an fp8 latent
# cache, (mean, max) over every decode step. Measured (4 prompts, 12 tokens): mean 0.08-0.09, max
# 0.75-0.93 (a small change of the hidden state can move a near-tied expert choice, which moves that
# step further); with the latent payload zeroed on store, means of 3.0-3.2.
FP8_LATENT_TOLERANCE = (0.25, 2.0)


def _fp8_latent_errors(folder, reference_llm, device: str):
    """(fp8-latent LLM, |logprob - full-precision logprob| [prompts, steps]) for the reference
    engine's greedy tokens, forced through a fresh fp8-latent engine (prefill, then one decode step
    per token: kvserve.eval.kv_fidelity.teacher_forced_logprobs)."""
    from kvserve.eval.kv_fidelity import teacher_forced_logprobs
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = [o.outputs[0] for o in reference_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                            use_tqdm=False)]
    llm = LLM(folder, **_options(kv_cache_dtype="fp8_e4m3", device=device))
    forced = teacher_forced_logprobs(llm.engine, PROMPTS, [o.token_ids for o in outputs])
    errors = [(rows[torch.arange(len(o.token_ids)), torch.tensor(o.token_ids)].cpu()
               - torch.tensor([lp[t] for lp, t in zip(o.logprobs, o.token_ids)])).abs()
              for rows, o in zip(forced, outputs)]
    return llm, torch.stack(errors)


def _assert_fp8_latent_close(errors: torch.Tensor) -> None:
    assert_decode_close(errors, FP8_LATENT_TOLERANCE, "the fp8 latent", prefill_tolerance=1e-3)


def test_fp8_latent_cache_stays_close(checkpoint, engine_llm):
    """KV formats apply to the latent: an fp8 latent with a full-precision RoPE key changes the
    logprobs of every decode step only slightly."""
    folder, _ = checkpoint
    reference_llm, _ = engine_llm
    llm, errors = _fp8_latent_errors(folder, reference_llm, TEST_DEVICE)
    assert "fp8_e4m3/auto" in llm.engine.kv_spec.describe()
    assert llm.engine.kv_bytes_per_token < reference_llm.engine.kv_bytes_per_token
    latent, rope = llm.engine.runner.kv_store[0]
    assert not isinstance(latent, torch.Tensor) and isinstance(rope, torch.Tensor)
    _assert_fp8_latent_close(errors)


def test_fp8_latent_check_fails_over_a_broken_store(checkpoint, engine_llm, monkeypatch):
    """The check above can fail: with the latent's fp8 payload zeroed on store (torch store, so on
    the CPU), the decode steps leave its bounds."""
    from kvserve.kvstore import QuantizedKVCache
    store = QuantizedKVCache.store

    def zeroed(self, x, slot_mapping, window_slots=None, residual_rows=None):
        store(self, x, slot_mapping, window_slots, residual_rows)
        self.payload.view(-1, x.shape[1], self.payload.shape[-1]).index_fill_(0, slot_mapping, 0)
    monkeypatch.setattr(QuantizedKVCache, "store", zeroed)
    folder, _ = checkpoint
    reference_llm, _ = engine_llm
    _, errors = _fp8_latent_errors(folder, reference_llm, "cpu")
    with pytest.raises(AssertionError, match="decode logprobs over the fp8 latent"):
        _assert_fp8_latent_close(errors)


def test_v3_half_split_rope_checkpoint(tmp_path):
    """rope_interleave=false checkpoints are used as stored (no de-interleaving)."""
    cfg = tiny_deepseek_config("deepseek_v3")
    cfg.rope_interleave = False
    hf_model = build_tiny_deepseek("deepseek_v3", tmp_path, TEST_DEVICE, config=cfg)
    llm = LLM(str(tmp_path), **_options())
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPTS[3]], device=TEST_DEVICE)).logits[0].float()
    torch.testing.assert_close(_prefill_logits(llm, PROMPTS[3]), expected, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


# --- MoE ---------------------------------------------------------------------------------------------
def test_grouped_experts_match_the_loop(engine_llm):
    """The grouped-GEMM path (one call for all experts) computes what the per-expert loop does."""
    llm, _ = engine_llm
    moe = llm.engine.model.layers[1].mlp
    generator = torch.Generator(device="cpu").manual_seed(1)
    hidden = torch.randn(37, moe.w13.shape[2], generator=generator).to(moe.w13.device)
    from kvserve.model.moe import route
    weights, ids = route(torch.nn.functional.linear(hidden.float(), moe.gate_weight), moe.routing,
                         moe.e_score_correction_bias)
    loop = moe._loop(hidden, weights, ids)
    grouped = moe._grouped(hidden, weights, ids)
    torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=1e-5)


def test_moe_implementation_option_gives_same_tokens(checkpoint, engine_llm):
    folder, _ = checkpoint
    reference_llm, _ = engine_llm
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = [o.outputs[0].token_ids for o in reference_llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(folder, **_options(moe_implementation="grouped"))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_routing_matches_transformers_router(engine_llm):
    llm, hf_model = engine_llm
    ours = llm.engine.model.layers[2].mlp
    theirs = hf_model.model.layers[2].mlp.gate
    hidden = torch.randn(50, ours.w13.shape[2], device=TEST_DEVICE)
    from kvserve.model.moe import route
    weights, ids = route(torch.nn.functional.linear(hidden.float(), ours.gate_weight), ours.routing,
                         ours.e_score_correction_bias)
    with torch.no_grad():
        _, hf_weights, hf_ids = theirs(hidden)
    order, hf_order = ids.sort(dim=-1), hf_ids.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices))


def test_expert_load_statistics(checkpoint):
    folder, hf_model = checkpoint
    llm = LLM(folder, **_options())
    engine = llm.engine
    engine.reset_expert_load()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    stats = engine.expert_load()
    cfg = hf_model.config
    assert stats.layers == tuple(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    # Every token that ran through the model (prompt + generated, minus the last sampled one)
    # picked top_k experts in every MoE layer.
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (5 - 1)
    for counts in stats.tokens_per_expert:
        assert len(counts) == cfg.n_routed_experts and sum(counts) == tokens * cfg.num_experts_per_tok
    assert all(value >= 1.0 for value in stats.imbalance())
    json.dumps(stats.as_dict())
    engine.reset_expert_load()
    assert all(sum(c) == 0 for c in engine.expert_load().tokens_per_expert)


def test_llama_has_no_expert_statistics(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    llm = LLM(folder, **_options())
    assert llm.engine.expert_load() is None


def test_bf16_logits_close_to_fp32_transformers(checkpoint):
    folder, hf_model = checkpoint
    diff = prompt_logprob_errors(LLM(folder, **_options(dtype="bfloat16")), hf_model, PROMPTS[2])
    # bf16 rounding of the hidden state can flip an expert choice that sits near a tie (the router
    # itself runs in fp32), which moves that position's logprob further; the rest stay close.
    assert diff.median().item() < 0.05
    assert (diff > 0.25).float().mean().item() < 0.1



def test_expert_load_in_metrics_and_bench(checkpoint):
    """/metrics exposes tokens per expert and per-layer imbalance; `kvserve bench` records them."""
    from kvserve.eval.bench import bench_kvserve
    from kvserve.engine.async_engine import EngineSnapshot
    from kvserve.obs.metrics import MOE_METRIC_NAMES, ServerMetrics
    folder, hf_model = checkpoint
    llm = LLM(folder, **_options())
    point = bench_kvserve(llm.engine, batch_size=2, input_len=8, output_len=3, repeats=1, seed=0)
    load = point.extra["expert_load"]
    cfg = hf_model.config
    assert len(load["tokens_per_expert"]) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert sum(load["tokens_per_expert"][0]) == 2 * (8 + 3 - 1) * cfg.num_experts_per_tok
    metrics = ServerMetrics(lambda: EngineSnapshot(), "tiny", expert_load=llm.engine.expert_load)
    text = metrics.render().decode()
    for name in MOE_METRIC_NAMES:
        assert name in text
    assert 'kvserve:moe_expert_tokens_total{expert="0",layer="1",model_name="tiny"}' in text


def test_dense_experts_match_the_loop(engine_llm):
    """The capturable fallback (every expert on every token, routing-weighted) equals the loop."""
    llm, _ = engine_llm
    moe = llm.engine.model.layers[2].mlp
    hidden = torch.randn(9, moe.w13.shape[2], device=moe.w13.device)
    from kvserve.model.moe import route
    weights, ids = route(torch.nn.functional.linear(hidden.float(), moe.gate_weight), moe.routing,
                         moe.e_score_correction_bias)
    torch.testing.assert_close(moe._dense(hidden, weights, ids), moe._loop(hidden, weights, ids),
                               atol=1e-5, rtol=1e-5)
