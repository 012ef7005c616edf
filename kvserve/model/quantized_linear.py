"""Linear layers whose weights stay in a GGUF file's quantized blocks (Q8_0, Q4_0, Q4_1), on the CPU.

A 4.5-bit Q4_1 weight dequantized at load takes 32 bits in memory and is read at 32 bits per decode
step; kept as blocks it is read at 4.5. The blocks are repacked once, 8 rows interleaved
(kvserve/kernels/cpu/quant_gemm.c), and multiplied by directly: by `QuantizedLinear.forward` on the
torch path, by the native forward (kvserve/model/cpu_native.py) reading `packed_weight` and
`weight_format` on the native one. Fused projections (q/k/v, gate/up) concatenate their parts'
rows of blocks before the repack. k-quants are rewritten at load into a kernel's type
(kernels/cpu/block_convert.py: Q4_K -> Q4_1, Q5_K / Q6_K -> Q8_0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels.cpu.block_convert import CONVERTED_TYPES, to_kernel_blocks
from kvserve.kernels.cpu.weight_formats import GGUF_BLOCK_FORMATS
from kvserve.model.loader.common import QuantizedWeight

logger = logging.getLogger(__name__)


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W in GGUF blocks repacked for quant_gemm.c; any float dtype in, same out
    (fp32 inside: activations are quantized to int8 per 32 values, as llama.cpp does)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, stored_types: tuple[str, ...] = ()) -> None:
        super().__init__()
        block_format = GGUF_BLOCK_FORMATS.get(weight.ggml_type)
        if block_format is None:
            raise ValueError(f"GGUF type {weight.ggml_type} has no quantized CPU kernel; kept types: "
                             f"{', '.join(GGUF_BLOCK_FORMATS)}")
        self.out_features, self.in_features = weight.shape
        self.ggml_type = weight.ggml_type                       # the kernel's block type
        self.stored_types = stored_types or (weight.ggml_type,)  # the checkpoint's, where rewritten at load
        self.weight_format = block_format.code
        self.register_buffer("packed_weight", cpu_kernels.repack_blocks(weight.blocks, block_format.code,
                                                                         self.in_features), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).float()
        out = cpu_kernels.quant_linear(flat, self.packed_weight, self.weight_format, self.out_features, self.bias)
        return out.to(x.dtype).view(*leading, self.out_features)

    def extra_repr(self) -> str:
        stored = "" if self.stored_types == (self.ggml_type,) else f" (stored {'+'.join(self.stored_types)})"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight={self.ggml_type}{stored}")


@dataclass
class QuantizedPart:
    """One checkpoint tensor's blocks bound for a linear: all its rows (`rows` None) or a slice of a
    fused linear's rows."""
    rows: slice | None
    weight: QuantizedWeight


def merged_blocks(parts: list[QuantizedPart], out_features: int) -> QuantizedWeight | None:
    """The parts' blocks as one weight of `out_features` rows in a kernel's block type, or None when
    rows are missing. Stored types without a kernel are rewritten (kernels/cpu/block_convert.py);
    parts that end in different types (a Q4_K_M file's v_proj is often Q6_K beside a Q4_K q_proj) are
    all requantized to Q8_0, still under a third of fp32's bytes."""
    ordered = sorted(parts, key=lambda part: 0 if part.rows is None else part.rows.start)
    expected_start = 0
    for part in ordered:
        start = 0 if part.rows is None else part.rows.start
        if start != expected_start:
            return None
        expected_start += part.weight.shape[0]
    if expected_start != out_features:
        return None
    targets = {CONVERTED_TYPES.get(part.weight.ggml_type, part.weight.ggml_type) for part in ordered}
    forced = None if len(targets) == 1 else "Q8_0"
    converted = [to_kernel_blocks(part.weight.ggml_type, part.weight.blocks, part.weight.shape, forced)
                 for part in ordered]
    kernel_type = converted[0][0]
    blocks = converted[0][1] if len(converted) == 1 else torch.cat([rows for _, rows in converted])
    return QuantizedWeight(kernel_type, blocks, (out_features, ordered[0].weight.shape[1]))


def kept_linears(model: nn.Module) -> dict[str, int]:
    """GGML type -> how many of the model's linears run on their blocks."""
    kept: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            kept[module.ggml_type] = kept.get(module.ggml_type, 0) + 1
    return kept


def install_quantized_linears(model: nn.Module, pending: dict[str, list[QuantizedPart]]) -> None:
    """Replaces each linear named in `pending` ("layers.0.mlp.gate_up_proj") by a QuantizedLinear over
    its parts' blocks, keeping the old module's bias (loaded by then). A linear whose parts' rows do
    not cover it gets them dequantized into its dense weight instead."""
    for module_name, parts in pending.items():
        linear = model.get_submodule(module_name)
        stored = tuple(sorted({part.weight.ggml_type for part in parts}))
        merged = merged_blocks(parts, linear.out_features)
        if merged is None:
            logger.info("%s: %s parts dequantized (their rows do not cover the linear)", module_name, stored)
            with torch.no_grad():
                for part in parts:
                    dest = linear.weight.data if part.rows is None else linear.weight.data[part.rows]
                    dest.copy_(part.weight.dequantize())
            continue
        if stored != (merged.ggml_type,):
            logger.debug("%s: GGUF %s blocks run as %s", module_name, "+".join(stored), merged.ggml_type)
        parent_name, _, child_name = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, QuantizedLinear(merged, linear.bias, stored))
