"""What the folder and GGUF readers share: the error type, `ModelSource` (what `resolve_model` returns),
the architectures the engine runs, and the cache folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol

import torch
import transformers

from kvserve import envs

# Architectures (config.json "architectures" names) the engine can run.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen2ForCausalLM", "DeepseekV2ForCausalLM",
                                             "DeepseekV3ForCausalLM")
LOAD_FORMATS = ("auto", "dummy")


class ModelLoadError(Exception):
    """The model could not be found or read; the message names the path and the problem."""


@dataclass
class QuantizedWeight:
    """A 2-D weight kept in its checkpoint's quantized blocks (a GGUF tensor of a type the CPU kernels
    read): `blocks` is uint8 [out_features, bytes per row], rows in the order of the HF weight's rows."""
    ggml_type: str       # "Q4_1", ...: kvserve/kernels/cpu/weight_formats.py
    blocks: torch.Tensor
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out_features, in_features] (gguf's own dequantizer)."""
        import gguf
        values = gguf.quants.dequantize(self.blocks.numpy(), gguf.GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(values.astype("float32", copy=False).reshape(self.shape).copy())


class CheckpointReader(Protocol):
    """What a checkpoint format gives a `ModelSource`: its tensors and its tokenizer."""

    def iter_weights(self, hf_config: transformers.PretrainedConfig,
                     keep_quantized: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]: ...

    def load_tokenizer(self) -> Optional[transformers.PreTrainedTokenizerBase]: ...

    def quantized_tensor_types(self) -> dict[str, int]:
        """GGML type name -> how many 2-D tensors are stored in it (empty for float checkpoints)."""
        ...


@dataclass
class ModelSource:
    path: str                                  # absolute path of the folder or the .gguf file
    hf_config: transformers.PretrainedConfig   # LlamaConfig / Qwen2Config / ...
    architecture: str                          # e.g. "LlamaForCausalLM"
    load_format: str = "auto"                  # "auto" or "dummy"
    checkpoint_format: str = "safetensors"     # "safetensors" or "gguf"
    weight_files: tuple[str, ...] = ()         # safetensors files (absolute paths), in reading order
    _reader: Optional[CheckpointReader] = field(default=None, repr=False, compare=False)

    @property
    def is_gguf(self) -> bool:
        return self.checkpoint_format == "gguf"

    def iter_weights(self, keep_quantized: frozenset[str] = frozenset()
                     ) -> Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]:
        """Yield ``(hf_parameter_name, cpu_tensor)`` one tensor at a time.

        Safetensors tensors come in the checkpoint's dtype; GGUF tensors in float32 when quantized (else their
        float dtype), except 2-D GGUF tensors of a type in ``keep_quantized``, which come as `QuantizedWeight`.
        A tied ``lm_head.weight`` is not yielded (``hf_config.tie_word_embeddings`` says so).
        """
        if self.load_format == "dummy":
            raise ModelLoadError(
                f"{self.path}: load_format='dummy' has no weights to read (the model is initialised with random "
                f"weights); use load_format='auto' to read the checkpoint")
        assert self._reader is not None
        return self._reader.iter_weights(self.hf_config, keep_quantized)

    def quantized_tensor_types(self) -> dict[str, int]:
        """The quantized block types of the checkpoint's 2-D tensors, with their counts (GGUF only)."""
        if self.load_format == "dummy" or self._reader is None:
            return {}
        return self._reader.quantized_tensor_types()

    def load_tokenizer(self) -> Optional[transformers.PreTrainedTokenizerBase]:
        """The model's tokenizer (with its chat template); None for a folder without tokenizer files,
        which can still serve prompts given as token ids (as vLLM's skip_tokenizer_init)."""
        assert self._reader is not None
        return self._reader.load_tokenizer()


def kvserve_cache_dir() -> str:
    """``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve``."""
    return envs.cache_dir()


def check_architecture(arch: str, path: str, supported: tuple[str, ...]) -> None:
    if arch not in supported:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; supported architectures: {', '.join(supported)}")
