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
- int4 keys per channel (`channel_block` > 0, KIVI's layout): asymmetric codes in [0, 15], packed as
  int4's; one fp16 (scale, zero) pair per channel, KV head and paged block, shared by the block's
  tokens: x = code * scale + zero, zero = min, scale = (max - zero) / 15 over the block's tokens.
  The scales tensor is `[num_blocks, kv_heads, 2, head_dim]` (scale row, zero row). Tokens of one
  block arrive one by one in decode, so each write widens the block's range to take the new tokens
  and re-encodes the codes already there with the new (scale, zero) (`QuantizedKVCache.store`): no
  per-sequence state, and a block stays the unit of movement.

Full precision (auto/bf16/fp16/fp32) parts stay plain tensors: the unquantized path is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The names of KV formats are configuration vocabulary: config.py (a leaf) owns them.
from kvserve.config import KV_CACHE_DTYPES

QUANTIZED = ("int8", "fp8_e4m3", "int4")
# Key layouts of a quantized part (CacheConfig.kv_quant_key_layout): per-token scales (as values),
# or int4 per channel and block (asymmetric, KIVI); auto picks channel for int4 keys.
KEY_LAYOUTS = ("auto", "token", "channel")
CHANNEL_LEVELS = 15.0             # asymmetric 4-bit codes 0..15
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
    # > 0: int4 per channel, a (scale, zero) pair per channel shared by the tokens of a paged block of
    # this many tokens (the cache's block size), no per-token scales; 0: per-token scales.
    channel_block: int = 0

    @property
    def per_channel(self) -> bool:
        return self.channel_block > 0

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
        """Dynamic scales per token and KV head (0 for full precision, static or per-channel scales)."""
        if not self.quantized or self.static_scales or self.per_channel:
            return 0
        return head_dim // self.group(head_dim)

    def scales_shape(self, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...] | None:
        """The shape of one block's dynamic scales (None without them): [block_size, kv_heads, groups]
        per token, or [kv_heads, 2, head_dim] (scale, zero) per channel."""
        if self.per_channel:
            if block_size != self.channel_block:
                raise ValueError(f"per-channel key scales were laid out for blocks of {self.channel_block} tokens "
                                 f"(the spec's block_size), not {block_size}")
            return (num_kv_heads, 2, head_dim)
        groups = self.num_scale_groups(head_dim)
        return (block_size, num_kv_heads, groups) if groups else None

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
        """Payload + scales of one token, one layer, this part. Per-channel scales are a block's
        (2 fp16 per channel) over its tokens, rounded up to whole bytes (exact when the block size
        divides 4 * head_dim * kv_heads: any power-of-2 block of up to 256 tokens)."""
        element = torch.empty((), dtype=self.storage_dtype(model_dtype)).element_size()
        payload = self.payload_width(head_dim) * element
        scales = self.num_scale_groups(head_dim) * SCALE_DTYPE.itemsize
        per_block = 2 * head_dim * SCALE_DTYPE.itemsize * num_kv_heads if self.per_channel else 0
        return num_kv_heads * (payload + scales) + -(-per_block // max(1, self.channel_block))

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
        if self.per_channel and (self.name != "int4" or self.static_scales):
            static = " with static scales" if self.static_scales else ""
            raise ValueError("per-channel block scales (kv_quant_key_layout channel) are implemented for int4 "
                             f"keys with dynamic scales, not {self.name}{static}")


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
        # (Divided by a tensor: on CUDA torch multiplies by the reciprocal of a Python number, see
        # channel_scale_zero.)
        absmax = groups.abs().amax(-1)
        scales_out = (absmax / torch.full_like(absmax, fmt.qmax)).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
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
    """payload [..., width] (+ scales [..., groups]) -> values [..., head_dim] in `dtype`. (Per-channel
    parts: dequantize_channel.)"""
    values = decode(fmt, payload)
    if fmt.static_scales:
        return (values * static_scale.float()).to(dtype)
    head_dim = values.shape[-1]
    groups = values.unflatten(-1, (head_dim // fmt.group(head_dim), fmt.group(head_dim)))
    return (groups * scales.float()[..., None]).flatten(-2).to(dtype)


# --- int4 per channel and block (asymmetric) ------------------------------------------------------
def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15] [..., head_dim] (any float or int dtype) -> bytes [..., head_dim/2]."""
    codes = codes.to(torch.uint8)
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack_nibbles(payload: torch.Tensor) -> torch.Tensor:
    """Bytes [..., head_dim/2] -> codes in [0, 15] as fp32 [..., head_dim]."""
    return torch.cat(((payload & 0xF).float(), (payload >> 4).float()), dim=-1)


def channel_scale_zero(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (scale, zero) of a channel range [low, high] (fp32), as stored (fp16): zero = low, then
    scale = (high - zero) / 15 from the rounded zero, so that code 15 reaches `high`."""
    zero = low.to(SCALE_DTYPE)
    # Divided by a tensor, not the Python number: on CUDA torch divides by a scalar as a multiply by
    # its reciprocal, which can differ from the division in the last bit and so flip the fp16
    # rounding (the Triton store divides exactly, as torch does on the CPU).
    levels = torch.full_like(high, CHANNEL_LEVELS)
    scale = ((high - zero.float()) / levels).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    return scale, zero


def encode_channel(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Values [..., head_dim] (fp32) -> codes in [0, 15] (fp32) with fp16 (scale, zero) [..., head_dim]."""
    return ((x - zero.float()) / scale.float()).round().clamp(0, CHANNEL_LEVELS)


def dequantize_channel(payload: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Bytes [..., head_dim/2] with the (scale, zero) [..., head_dim] of their block -> values."""
    return (unpack_nibbles(payload) * scale.float() + zero.float()).to(dtype)
