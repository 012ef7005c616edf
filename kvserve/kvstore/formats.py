"""KV cache formats: what one part (keys or values) of one layer's paged cache stores, and the torch
reference of quantize and dequantize.

A format states in one place its payload dtype and width, its scale granularity (a group of
`group_size` head_dim elements of one token and one KV head shares one fp16 scale: per token+head
for 8-bit by default; or static per-channel scales read from a calibration file, which cost no
bytes per token), and so its true bytes per token. The block pool is sized from those bytes, so a
smaller format buys proportionally more tokens.

Payload layouts (per token and KV head; NHD paged like the full-precision cache,
`[num_blocks, block_size, num_kv_heads, width]`):
- int8: int8 codes, symmetric, scale = absmax / 127.
- fp8_e4m3: e4m3 bytes stored as uint8 (indexing float8 tensors is not implemented everywhere),
  scale = absmax / 448.
- int4: symmetric codes in [-7, 7] stored +8 as nibbles, two per byte; byte `i` holds element `i`
  (low nibble) and element `i + head_dim/2` (high nibble), so a kernel unpacks with a shift chosen
  per element and no interleave. scale = absmax / 7 per group.

Full precision (auto/bf16/fp16/fp32) parts stay plain tensors: the unquantized path is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The names of KV formats are configuration vocabulary: config.py (a leaf) owns them.
from kvserve.config import KV_CACHE_DTYPES

QUANTIZED = ("int8", "fp8_e4m3", "int4")
_FULL_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "int4": 7.0}
SCALE_DTYPE = torch.float16
# Smallest fp16 normal: smaller scales would lose precision as subnormals, and a zero vector's
# scale must not be 0 (x / 0).
MIN_SCALE = 2.0 ** -14


@dataclass(frozen=True)
class KVFormat:
    """How one part (keys or values) of one layer is stored."""

    name: str                      # one of KV_CACHE_DTYPES
    group_size: int = 0            # head_dim elements per dynamic scale; 0 = the whole head
    static_scales: bool = False    # per-channel scales from a calibration file (no bytes per token)

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZED

    @property
    def qmax(self) -> float:
        return _QMAX[self.name]

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if self.name == "int8":
            return torch.int8
        if self.quantized:
            return torch.uint8
        return _FULL_PRECISION_DTYPES.get(self.name, model_dtype)

    def payload_width(self, head_dim: int) -> int:
        return head_dim // 2 if self.name == "int4" else head_dim

    def group(self, head_dim: int) -> int:
        return self.group_size or head_dim

    def num_scale_groups(self, head_dim: int) -> int:
        """Dynamic scales per token and KV head (0 for full precision or static scales)."""
        if not self.quantized or self.static_scales:
            return 0
        return head_dim // self.group(head_dim)

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
        """Payload + scales of one token, one layer, this part."""
        element = torch.empty((), dtype=self.storage_dtype(model_dtype)).element_size()
        payload = self.payload_width(head_dim) * element
        scales = self.num_scale_groups(head_dim) * SCALE_DTYPE.itemsize
        return num_kv_heads * (payload + scales)

    def validate(self, head_dim: int) -> None:
        if self.name not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.name!r}; choose from {KV_CACHE_DTYPES}")
        if not self.quantized:
            return
        group = self.group(head_dim)
        if head_dim % group:
            raise ValueError(f"KV quantization group {group} does not divide head_dim {head_dim}")
        if self.name == "int4" and head_dim % 2:
            raise ValueError(f"int4 packs two elements per byte: head_dim {head_dim} must be even")


# --- reference quantize / dequantize ---------------------------------------------------------------
def quantize(fmt: KVFormat, x: torch.Tensor,
             static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., head_dim] -> (payload [..., width], scales [..., groups] fp16 or None if static)."""
    head_dim = x.shape[-1]
    x32 = x.float()
    if fmt.static_scales:
        scale = static_scale.float()                              # [kv_heads, head_dim]
        scaled = x32 / scale
        scales_out = None
    else:
        groups = x32.unflatten(-1, (head_dim // fmt.group(head_dim), fmt.group(head_dim)))
        # The scale is rounded to its stored dtype first, so quantize and dequantize use the same one.
        scales_out = (groups.abs().amax(-1) / fmt.qmax).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
        scaled = (groups / scales_out.float()[..., None]).flatten(-2)
    return encode(fmt, scaled), scales_out


def encode(fmt: KVFormat, scaled: torch.Tensor) -> torch.Tensor:
    """Values already divided by their scale -> payload codes."""
    if fmt.name == "int8":
        return scaled.round().clamp(-127, 127).to(torch.int8)
    if fmt.name == "fp8_e4m3":
        return scaled.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = (scaled.round().clamp(-7, 7) + 8).to(torch.uint8)
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def decode(fmt: KVFormat, payload: torch.Tensor) -> torch.Tensor:
    """Payload codes -> fp32 values before scaling, [..., head_dim]."""
    if fmt.name == "int8":
        return payload.float()
    if fmt.name == "fp8_e4m3":
        return payload.view(torch.float8_e4m3fn).float()
    low = (payload & 0xF).float() - 8
    high = (payload >> 4).float() - 8
    return torch.cat((low, high), dim=-1)


def dequantize(fmt: KVFormat, payload: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype,
               static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """payload [..., width] (+ scales [..., groups]) -> values [..., head_dim] in `dtype`."""
    values = decode(fmt, payload)
    if fmt.static_scales:
        return (values * static_scale.float()).to(dtype)
    head_dim = values.shape[-1]
    groups = values.unflatten(-1, (head_dim // fmt.group(head_dim), fmt.group(head_dim)))
    return (groups * scales.float()[..., None]).flatten(-2).to(dtype)


