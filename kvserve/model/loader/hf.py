"""Hugging Face style folders: ``config.json``, ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (tensors read one at a time with `safetensors.safe_open`, memory-mapped,
in the checkpoint's dtype), and the tokenizer files."""

from __future__ import annotations

import json
import logging
import os
from typing import Iterator, Optional

import torch
import transformers

from kvserve.model.loader.common import SUPPORTED_ARCHITECTURES, ModelLoadError, ModelSource, check_architecture

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
_SAFETENSORS_FILE = "model.safetensors"
_SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# Buffers some checkpoints carry that are not parameters.
_SKIPPED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)
# config.json "model_type" -> architecture, for configs without an "architectures" list.
_MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


class SafetensorsFolder:
    """The `CheckpointReader` of a folder: its safetensors shards and its tokenizer files."""

    def __init__(self, path: str, weight_files: tuple[str, ...]):
        self.path = path
        self.weight_files = weight_files

    def iter_weights(self, hf_config: transformers.PretrainedConfig,
                     keep_quantized: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_safetensors(self.weight_files)   # no GGUF blocks in a folder: nothing to keep

    def quantized_tensor_types(self) -> dict[str, int]:
        return {}

    def load_tokenizer(self) -> Optional[transformers.PreTrainedTokenizerBase]:
        if not any(os.path.isfile(os.path.join(self.path, f)) for f in _TOKENIZER_FILES):
            logger.warning("%s: no tokenizer files (%s); prompts must be token ids",
                           self.path, ", ".join(_TOKENIZER_FILES))
            return None
        try:
            return transformers.AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except Exception as e:
            raise ModelLoadError(f"{self.path}: could not load the tokenizer: {type(e).__name__}: {e}") from e


def resolve_folder(path: str, load_format: str) -> ModelSource:
    config_path = os.path.join(path, CONFIG_FILE)
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
    check_architecture(str(arch), path, SUPPORTED_ARCHITECTURES)

    try:
        hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{config_path}: transformers cannot parse the config: {type(e).__name__}: {e}") from e

    weight_files: tuple[str, ...] = ()
    if load_format != "dummy":
        weight_files = _find_safetensors(path)
        _check_safetensors(weight_files)
    return ModelSource(path=path, hf_config=hf_config, architecture=arch, load_format=load_format,
                       checkpoint_format="safetensors", weight_files=weight_files,
                       _reader=SafetensorsFolder(path, weight_files))


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


def iter_safetensors(files: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
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
