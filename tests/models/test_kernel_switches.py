"""Kernel switches (fused Triton ops, the skinny GEMM's row limit) are values given to a model when it
is built and stored on its layers; no module-level state is changed at run time. CPU only."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from kvserve.model import layers
from kvserve.model.builder import build_model, kernel_switches
from kvserve.model.layers import DEFAULT_KERNEL_SWITCHES, KernelSwitches, UsesKernelSwitches
from kvserve.model.loader import resolve_model

LAYERS_SOURCE = pathlib.Path(layers.__file__)


def test_layers_module_keeps_no_run_time_globals():
    tree = ast.parse(LAYERS_SOURCE.read_text(encoding="utf-8"))
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Global)]


def test_switches_are_frozen_values():
    switches = KernelSwitches(fused_ops=False, gemv_max_tokens=4)
    with pytest.raises(AttributeError):
        switches.fused_ops = True           # type: ignore[misc]
    assert not switches.fused(torch.zeros(2))
    assert not DEFAULT_KERNEL_SWITCHES.fused(torch.zeros(2))        # CPU tensors: torch ops
    assert DEFAULT_KERNEL_SWITCHES.gemv_for(torch.zeros(2, 8), torch.zeros(8, 8)) is None


def test_builder_stores_the_switches_on_every_layer(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    source = resolve_model(folder, load_format="dummy")
    switches = KernelSwitches(fused_ops=False, gemv_max_tokens=3)
    model = build_model(source, torch.float32, torch.device("cpu"), "dummy", 0, switches)
    switched = [m for m in model.modules() if isinstance(m, UsesKernelSwitches)]
    kinds = {type(m).__name__ for m in switched}
    assert {"Linear", "RMSNorm", "SwiGLU", "LlamaAttention"} <= kinds
    assert all(m.switches is switches for m in switched)
    # Another model built with the defaults is not affected.
    other = build_model(source, torch.float32, torch.device("cpu"), "dummy", 0)
    assert all(m.switches is DEFAULT_KERNEL_SWITCHES for m in other.modules() if isinstance(m, UsesKernelSwitches))


def test_engine_options_choose_the_switches(tiny_checkpoint):
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import Engine
    config = EngineConfig.from_options(fused_ops=False, gemv_max_tokens=5)
    assert kernel_switches(config.model_config) == KernelSwitches(fused_ops=False, gemv_max_tokens=5)
    folder, _ = tiny_checkpoint
    engine = Engine.from_options(model=folder, device="cpu", dtype="float32", kv_cache_memory=1 << 20,
                                 load_format="dummy", fused_ops=False, gemv_max_tokens=5)
    norms = [m for m in engine.model.modules() if isinstance(m, layers.RMSNorm)]
    assert norms and all(m.switches == KernelSwitches(False, 5) for m in norms)
