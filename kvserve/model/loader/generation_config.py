"""A model folder's `generation_config.json`: the sampling defaults its authors recommend (R1: temperature
0.6, top_p 0.95) and its end-of-sequence tokens. The server applies the defaults to fields a request
leaves unset (`--generation-config auto`, vLLM's default); the engine stops at its eos ids too."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(source_path: str) -> dict[str, Any]:
    """The file's contents ({} for a GGUF file, a folder without one, or one that does not parse)."""
    path = os.path.join(source_path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        logger.warning("%s: not read (%s); the model's generation defaults are not applied", path, exc)
        return {}
    return config if isinstance(config, dict) else {}


def sampling_defaults(source_path: str) -> dict[str, Any]:
    """SamplingParams field -> the model's default, for the fields the file sets."""
    config = read_generation_config(source_path)
    return {field: config[key] for key, field in SAMPLING_DEFAULTS.items()
            if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool)}


def eos_token_ids(source_path: str) -> set[int]:
    value = read_generation_config(source_path).get("eos_token_id")
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {int(v) for v in value if isinstance(v, int)}
    return set()
