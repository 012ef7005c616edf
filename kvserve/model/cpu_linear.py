"""fp32 linear layers on CPU with weights pre-packed once by oneDNN.

torch's CPU `F.linear` hands the weight to MKL in its checkpoint layout on every call. oneDNN can
reorder a weight once, at load, into the blocked layout its GEMM kernels stream, which is faster at
decode and prefill shapes alike (benchmarks/cpu/cpu_linear_bench.py; measured: docs/cpu_performance.md).
torch's own
`torch.compile` freezing pass uses the same two operators for CPU inference.

Only fp32 is packed: oneDNN's bf16 path needs AVX512-BF16 / AVX-NE-CONVERT, and where it is missing
torch refuses the reorder. Anything that cannot pack keeps its ordinary `nn.Linear`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The batch size oneDNN tunes the packed layout for: decode batches on CPU are tens of rows.
_PACK_FOR_ROWS = 16


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (the dense copy is dropped)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_FOR_ROWS)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """True when oneDNN can pack and run fp32 linears here (checked once with a tiny weight)."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = PackedLinear(torch.ones(8, 8), None)
        return bool(torch.allclose(probe(torch.ones(2, 8)), torch.full((2, 8), 8.0)))
    except (RuntimeError, AttributeError) as err:  # an op missing from this torch build
        logger.info("oneDNN weight packing unavailable (%s); using torch's linear", err)
        return False


def pack_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear of `model` by a PackedLinear, in place; returns how many.

    A weight shared with another module (a tied lm_head shares the embedding table) is copied into
    the packed layout; the embedding keeps its own dense table for lookups.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                replaced += 1
    return replaced
