"""Builds a model of the checkpoint's architecture on a device, with real or random weights."""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.model.deepseek import MODEL_CLASSES as DEEPSEEK_CLASSES
from kvserve.model.layers import DEFAULT_KERNEL_SWITCHES, KernelSwitches, apply_kernel_switches
from kvserve.model.llama import MODEL_CLASSES as LLAMA_CLASSES

MODEL_CLASSES = {**LLAMA_CLASSES, **DEEPSEEK_CLASSES}

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


def build_model(source, dtype: torch.dtype, device: torch.device, load_format: str, seed: int,
                switches: KernelSwitches = DEFAULT_KERNEL_SWITCHES) -> torch.nn.Module:
    """`switches` are stored on every layer that reads them, before anything runs (CUDA graphs
    captured later record them)."""
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
        model.load_weights(source.iter_weights())
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
