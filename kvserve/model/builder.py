"""Builds a model of the checkpoint's architecture on a device, with real or random weights."""

from __future__ import annotations

import logging

import torch

from kvserve.config import ModelConfig
from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels.cpu.block_convert import CONVERTED_TYPES
from kvserve.kernels.cpu.weight_formats import GGUF_BLOCK_FORMATS
from kvserve.model.deepseek import MODEL_CLASSES as DEEPSEEK_CLASSES
from kvserve.model.layers import DEFAULT_KERNEL_SWITCHES, KernelSwitches, apply_kernel_switches
from kvserve.model.llama import MODEL_CLASSES as LLAMA_CLASSES

MODEL_CLASSES = {**LLAMA_CLASSES, **DEEPSEEK_CLASSES}
# The architectures whose load_weights takes GGUF blocks (QuantizedWeight) for its linears.
QUANTIZED_WEIGHT_ARCHITECTURES = tuple(LLAMA_CLASSES)
# The GGUF types the CPU kernels run: their own, and those rewritten into one at load.
CPU_KEPT_TYPES = (*GGUF_BLOCK_FORMATS, *CONVERTED_TYPES)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    """auto: the checkpoint's half-precision dtype on CUDA; float32 on CPU, whose bf16 matmuls are
    slower than fp32 on CPUs without native bf16 units."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared)
    return declared if declared in (torch.bfloat16, torch.float16) else torch.bfloat16


def model_class(architecture: str):
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_CLASSES)}") from None


def kernel_switches(model_config: ModelConfig) -> KernelSwitches:
    """The Triton fast paths the engine's options turn on (`--fused-ops`, `--gemv-max-tokens`)."""
    return KernelSwitches(fused_ops=model_config.fused_ops, gemv_max_tokens=model_config.gemv_max_tokens)


def kept_weight_types(quantization: str, source, device: torch.device) -> frozenset[str]:
    """The GGUF block types whose weights stay quantized in memory (`--quantization`): auto keeps
    every type the CPU kernels read when a GGUF runs on the CPU; gguf demands it (a clear error where
    it cannot run); none, or a float checkpoint, keeps nothing."""
    if quantization not in ("auto", "none", "gguf"):
        raise ValueError(f"quantization must be auto, none or gguf, got {quantization!r}")
    if quantization == "none" or source.load_format == "dummy":
        return frozenset()
    stored = source.quantized_tensor_types()
    kernels = CPU_KEPT_TYPES if device.type == "cpu" and cpu_kernels.available() else ()
    kept = frozenset(name for name in stored if name in kernels)
    if quantization == "gguf":
        if not source.is_gguf:
            raise ValueError(f"quantization 'gguf' needs a .gguf model; {source.path} is a {source.checkpoint_format} "
                             f"checkpoint")
        if device.type != "cpu":
            raise ValueError(f"quantization 'gguf' runs on the CPU kernels; on {device.type} use quantization "
                             f"'none' (blocks dequantized at load)")
        if not cpu_kernels.available():
            raise ValueError("quantization 'gguf' needs the native CPU kernels, which are not available here "
                             "(no C compiler, or KVSERVE_DISABLE_CPU_KERNELS=1)")
        if source.architecture not in QUANTIZED_WEIGHT_ARCHITECTURES:
            raise ValueError(f"quantization 'gguf' runs {', '.join(QUANTIZED_WEIGHT_ARCHITECTURES)}, not "
                             f"{source.architecture}")
        unsupported = sorted(set(stored) - kept)
        if unsupported:
            raise ValueError(f"quantization 'gguf': GGUF tensor types {', '.join(unsupported)} have no quantized "
                             f"CPU kernel (kept types: {', '.join(CPU_KEPT_TYPES)}); use quantization 'auto' "
                             f"to dequantize those at load")
    if source.architecture not in QUANTIZED_WEIGHT_ARCHITECTURES:
        return frozenset()
    dequantized = sorted(set(stored) - kept)
    if dequantized:
        logger.info("GGUF tensor types %s dequantized at load (%s)", ", ".join(dequantized),
                    "no quantized kernel for them" if kernels else f"blocks run on the CPU kernels, not {device.type}")
    return kept


def build_model(source, dtype: torch.dtype, device: torch.device, load_format: str, seed: int,
                switches: KernelSwitches = DEFAULT_KERNEL_SWITCHES,
                keep_quantized: frozenset[str] = frozenset()) -> torch.nn.Module:
    """`switches` are stored on every layer that reads them, before anything runs (CUDA graphs
    captured later record them). Weights of a GGUF type in `keep_quantized` stay in their blocks
    (kept_weight_types)."""
    cls = model_class(source.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(source.hf_config)
    finally:
        torch.set_default_dtype(previous)
    apply_kernel_switches(model, switches)
    if load_format == "dummy":
        _init_random(model, seed)
    else:
        model.load_weights(source.iter_weights(keep_quantized))
    # Rotary frequencies stay fp32 whatever the model dtype, as in transformers; scaled variants
    # are computed on the host, so move them too.
    model.rotary.inv_freq = model.rotary.inv_freq.to(device=device, dtype=torch.float32)
    # Linears are packed for the CPU path that will run them when the runner picks its backend.
    return model.eval().requires_grad_(False)


def _init_random(model: torch.nn.Module, seed: int) -> None:
    """Random weights for speed work: small normal values keep activations finite in bf16."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
