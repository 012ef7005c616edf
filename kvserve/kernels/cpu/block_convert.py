"""GGUF block types without a kernel of their own, rewritten at load into one that has one (quant_gemm.c).

- Q4_K -> Q4_1, exactly but for the scales: a Q4_K super-block of 256 values holds 8 sub-blocks of
  32 with 6-bit scale and min codes under two fp16 super-scales (value = d*sc*q - dmin*m, q 4-bit),
  which is a Q4_1 block per sub-block (value = d'*q + m') with d' = d*sc and m' = -dmin*m rounded
  to fp16 (relative 2^-11, against the 4-bit grid's 1/15). The quants move unchanged; 5 bits per weight
  instead of 4.5.
- Q5_K, Q6_K -> Q8_0 by requantizing their values (gguf's dequantizer, then Q8_0's 255 levels per 32
  values): an error of at most half a Q8_0 step, a fraction of the 5- and 6-bit grids' own; 8.5 bits
  per weight instead of 5.5 / 6.6. (Q6_K's scales are per 16 values, finer than any kernel here.)
"""

from __future__ import annotations

import numpy as np
import torch

# Stored type -> the kernel block type it is rewritten into.
CONVERTED_TYPES = {"Q4_K": "Q4_1", "Q5_K": "Q8_0", "Q6_K": "Q8_0"}

_Q4_K_BYTES = 144          # fp16 d, fp16 dmin, 12 bytes of 6-bit scale/min codes, 128 bytes of quants
_Q4_1_BYTES = 20           # fp16 d, fp16 m, 16 bytes of quants


def _q4_k_scales_and_mins(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 code bytes of each super-block -> 8 scale codes and 8 min codes (6 bits each), [..., 8]:
    the first four in the low 6 bits of bytes 0-3 / 4-7, the last four split over bytes 8-11's
    nibbles and the top 2 bits of bytes 0-7 (llama.cpp's get_scale_min_k4)."""
    codes = codes.astype(np.uint8)
    scales = np.empty(codes.shape[:-1] + (8,), dtype=np.uint8)
    mins = np.empty_like(scales)
    scales[..., :4] = codes[..., 0:4] & 63
    mins[..., :4] = codes[..., 4:8] & 63
    scales[..., 4:] = (codes[..., 8:12] & 0xF) | ((codes[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (codes[..., 8:12] >> 4) | ((codes[..., 4:8] >> 6) << 4)
    return scales, mins


def q4_k_to_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_K rows uint8 [N, K/256*144] -> Q4_1 rows uint8 [N, K/32*20]."""
    rows = blocks.shape[0]
    supers = blocks.reshape(rows, -1, _Q4_K_BYTES)
    d = supers[..., 0:2].copy().view(np.float16).astype(np.float32)          # [N, S, 1]
    dmin = supers[..., 2:4].copy().view(np.float16).astype(np.float32)
    scales, mins = _q4_k_scales_and_mins(supers[..., 4:16])                  # [N, S, 8]
    quants = supers[..., 16:].reshape(rows, supers.shape[1], 4, 32)          # 4 chunks of 64 values
    # Chunk c's low nibbles are sub-block 2c's 32 values, its high nibbles sub-block 2c+1's.
    values = np.stack([quants & 0xF, quants >> 4], axis=3).reshape(rows, supers.shape[1], 8, 32)
    out = np.empty((rows, supers.shape[1], 8, _Q4_1_BYTES), dtype=np.uint8)
    out[..., 0:2] = (d * scales).astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:4] = (-(dmin * mins)).astype(np.float16)[..., None].view(np.uint8)
    # Q4_1 packs value i in the low nibble and value i+16 in the high nibble of byte i.
    out[..., 4:] = values[..., :16] | (values[..., 16:] << 4)
    return out.reshape(rows, -1)


def requantize_q8_0(blocks: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> np.ndarray:
    """Any type gguf can dequantize -> Q8_0 rows uint8 [N, K/32*34]."""
    import gguf
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[ggml_type]).reshape(shape)
    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)


def to_kernel_blocks(ggml_type: str, blocks: torch.Tensor, shape: tuple[int, int],
                     target: str | None = None) -> tuple[str, torch.Tensor]:
    """(kernel block type, its rows uint8 [N, bytes per row]) for a stored weight: `target` forces one
    (Q8_0, for fused parts of different types); else CONVERTED_TYPES, or the stored type unchanged."""
    target = target or CONVERTED_TYPES.get(ggml_type, ggml_type)
    if target == ggml_type:
        return ggml_type, blocks
    raw = blocks.numpy()
    if ggml_type == "Q4_K" and target == "Q4_1":
        converted = q4_k_to_q4_1(raw)
    elif target == "Q8_0":
        converted = requantize_q8_0(raw, ggml_type, shape)
    else:
        raise ValueError(f"no conversion of GGUF {ggml_type} blocks into {target}")
    return target, torch.from_numpy(np.ascontiguousarray(converted))
