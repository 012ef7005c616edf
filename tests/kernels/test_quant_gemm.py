"""The GGUF-block GEMM (kvserve/kernels/cpu/quant_gemm.c) against a torch reference built from gguf's own
dequantizer: weights dequantized by gguf, activations quantized to int8 blocks of 32 as the kernel
does (round half to even, scale max|x| / 127). Every build the machine can run is checked: the native
one (-march=native: VNNI where the CPU has it), AVX2 without VNNI, and the scalar fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels.cpu.weight_formats import GGUF_BLOCK_FORMATS

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for the native CPU kernels")

_BASE = ["-O2", "-fPIC", "-shared", "-std=c11"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]


def _cpu_has(*flags: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            present = set(next(line for line in f if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return False
    return all(flag in present for flag in flags)


@pytest.fixture(scope="module", params=["native", "avx2", "scalar"])
def kernels(request):
    if request.param == "native":
        return None, cpu_kernels.quant_isa()
    if request.param == "avx2" and not _cpu_has("avx2", "fma", "f16c"):
        pytest.skip("this CPU has no AVX2")
    lib = cpu_kernels.build_variant(_BASE + (_AVX2 if request.param == "avx2" else []))
    assert lib is not None, "the variant did not build"
    return lib, lib.kvs_quant_isa().decode()


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    blocks = x.double().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True).float().double() / 127.0
    quantized = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1.0)), 0.0)
    return ((quantized * scale).reshape(x.shape) @ weight.double().T).float()


def _gguf_weight(name: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = np.random.default_rng(seed)
    values = generator.standard_normal((rows, cols)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[name]
    blocks = np.ascontiguousarray(gguf.quants.quantize(values, kind))
    dense = torch.from_numpy(gguf.quants.dequantize(blocks, kind).astype(np.float32))
    return torch.from_numpy(blocks.view(np.uint8).copy()), dense


@pytest.mark.parametrize("name", sorted(GGUF_BLOCK_FORMATS))
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 44, 96), (4, 64, 64), (7, 19, 160), (9, 200, 576)])
def test_quant_linear_matches_reference(kernels, name, rows, out_features, in_features):
    lib, isa = kernels
    fmt = GGUF_BLOCK_FORMATS[name]
    blocks, dense = _gguf_weight(name, out_features, in_features, seed=rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)) * 3
    packed = cpu_kernels.repack_blocks(blocks, fmt.code, in_features, lib=lib)
    y = cpu_kernels.quant_linear(x, packed, fmt.code, out_features, lib=lib)
    expected = _reference(x, dense)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()), msg=isa)
    # Against unquantized activations: the int8 rounding costs well under 2% of the output's range.
    assert float((y - x @ dense.T).abs().max()) < 0.02 * float(expected.abs().max())


@pytest.mark.parametrize("name", sorted(GGUF_BLOCK_FORMATS))
def test_bias_and_accumulate(kernels, name):
    lib, _ = kernels
    fmt = GGUF_BLOCK_FORMATS[name]
    blocks, dense = _gguf_weight(name, 24, 64, seed=7)
    packed = cpu_kernels.repack_blocks(blocks, fmt.code, 64, lib=lib)
    x, bias = torch.randn(5, 64), torch.randn(24)
    base = torch.randn(5, 24)
    out = base.clone()
    cpu_kernels.quant_linear(x, packed, fmt.code, 24, bias=bias, out=out, accumulate=True, lib=lib)
    torch.testing.assert_close(out, base + _reference(x, dense) + bias, rtol=1e-4, atol=1e-3)


def test_bad_shapes_are_refused():
    fmt = GGUF_BLOCK_FORMATS["Q4_1"]
    blocks, _ = _gguf_weight("Q4_1", 8, 64, seed=1)
    with pytest.raises(ValueError, match="no quantized kernel"):
        cpu_kernels.repack_blocks(blocks, fmt.code, 48)            # not a whole number of blocks
    packed = cpu_kernels.repack_blocks(blocks, fmt.code, 64)
    with pytest.raises(ValueError, match="does not hold"):
        cpu_kernels.quant_linear(torch.randn(2, 64), packed, fmt.code, 16)


def test_default_model_blocks_kept_by_the_loader():
    """The GGUF loader's kept blocks (rotary rows un-permuted as whole rows of blocks) are the
    dequantized-at-load weight exactly, and the kernel multiplies by them."""
    from kvserve.model.loader import resolve_model
    from kvserve.model.loader.common import QuantizedWeight
    source = resolve_model(None)
    wanted = "model.layers.0.self_attn.q_proj.weight"
    dense = next(t for name, t in source.iter_weights() if name == wanted)
    kept = next(t for name, t in source.iter_weights(frozenset({"Q4_1"})) if name == wanted)
    assert isinstance(kept, QuantizedWeight) and kept.ggml_type == "Q4_1"
    assert torch.equal(kept.dequantize(), dense)
    fmt = GGUF_BLOCK_FORMATS["Q4_1"]
    x = torch.randn(3, dense.shape[1])
    y = cpu_kernels.quant_linear(x, cpu_kernels.repack_blocks(kept.blocks, fmt.code, dense.shape[1]), fmt.code,
                                 dense.shape[0])
    torch.testing.assert_close(y, _reference(x, dense), rtol=1e-4, atol=1e-3)
