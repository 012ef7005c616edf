"""Inline PTX that turns quantized KV codes into exact fp16 values, shared by the fused-dequant decode
kernels (decode_attention_quant.py, decode_attention_quant_pipelined.py).

The GPU's int -> float conversion instructions run at a quarter of the FP32 rate or less; these use
byte permutes under an fp16 exponent and packed fp16 arithmetic instead (4 int8 or 8 int4 codes per
few instructions), or, for e4m3, the hardware's packed e4m3x2 -> f16x2 conversion (sm_89+).
"""

import triton.language as tl

# 4 int8 codes (one register) -> 4 exact fp16 values (two registers): code ^ 0x80 = code + 128 in
# [0, 255] as the low byte under the exponent byte 0x64 is the fp16 1024 + code + 128; subtract 1152.
INT8_TO_F16_PTX = tl.constexpr(
    "{\n"
    ".reg .b32 t, bias;\n"
    "xor.b32 t, $2, 0x80808080;\n"
    "prmt.b32 $0, t, 0x64646464, 0x4140;\n"
    "prmt.b32 $1, t, 0x64646464, 0x4342;\n"
    "mov.b32 bias, 0x64806480;\n"
    "sub.f16x2 $0, $0, bias;\n"
    "sub.f16x2 $1, $1, bias;\n"
    "}")
# 4 int4 bytes -> their 4 low nibbles and 4 high nibbles as exact fp16 codes (nibble - 8):
# 1024 + nibble under the exponent byte 0x64, minus 1032.
INT4_TO_F16_PTX = tl.constexpr(
    "{\n"
    ".reg .b32 lo, hi, bias;\n"
    "and.b32 lo, $4, 0x0F0F0F0F;\n"
    "shr.u32 hi, $4, 4;\n"
    "and.b32 hi, hi, 0x0F0F0F0F;\n"
    "prmt.b32 $0, lo, 0x64646464, 0x4140;\n"
    "prmt.b32 $1, lo, 0x64646464, 0x4342;\n"
    "prmt.b32 $2, hi, 0x64646464, 0x4140;\n"
    "prmt.b32 $3, hi, 0x64646464, 0x4342;\n"
    "mov.b32 bias, 0x64086408;\n"
    "sub.f16x2 $0, $0, bias;\n"
    "sub.f16x2 $1, $1, bias;\n"
    "sub.f16x2 $2, $2, bias;\n"
    "sub.f16x2 $3, $3, bias;\n"
    "}")
# 4 e4m3 bytes -> 4 fp16 values with the hardware's packed conversion (sm_89+).
E4M3_TO_F16_PTX = tl.constexpr(
    "{\n"
    ".reg .b16 lo, hi;\n"
    "mov.b32 {lo, hi}, $2;\n"
    "cvt.rn.f16x2.e4m3x2 $0, lo;\n"
    "cvt.rn.f16x2.e4m3x2 $1, hi;\n"
    "}")
# A bf16 query enters fp16 dots times this (a power of 2: exact), so that no bf16 value overflows.
BF16_QUERY_PRESCALE = 2.0 ** -8
# 4 int4 bytes b0..b3 -> 8 fp16 values that still carry an offset, one LOP3 per two: the low nibbles as
# 1024 + nibble in the order (b0, b2, b1, b3), the high nibbles as 1024 + 16 * nibble in the same order
# (a nibble ORed under the exponent 0x6400; the high one sits 4 bits up, still inside the mantissa).
# The offsets are linear, so a kernel removes them after the dot product instead of per value:
# sum_i w_i (nibble_i - 8) = sum_i w_i x_i - 1032 sum_i w_i (low), (sum_i w_i x_i - 1152 sum_i w_i) / 16
# (high). The dot's operands are exact and it accumulates in fp32, so the correction cancels exactly up
# to fp32 rounding of the offset term (~1e-4 of a code step for 32 terms).
INT4_LOW_OFFSET = tl.constexpr(1032.0)
INT4_HIGH_OFFSET = tl.constexpr(1152.0)
INT4_TO_OFFSET_F16_PTX = tl.constexpr(
    "{\n"
    ".reg .b32 t;\n"
    "lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA;\n"
    "lop3.b32 $2, $4, 0x00F000F0, 0x64006400, 0xEA;\n"
    "shr.u32 t, $4, 8;\n"
    "lop3.b32 $1, t, 0x000F000F, 0x64006400, 0xEA;\n"
    "lop3.b32 $3, t, 0x00F000F0, 0x64006400, 0xEA;\n"
    "}")
# The same in dim order (b0, b1, b2, b3): one byte permute first (PRMT 0x3120 puts the bytes as b0, b2,
# b1, b3, which the conversion's order undoes), so per-dim factors (per-channel key scales) need no
# reordering of their own.
INT4_TO_OFFSET_F16_IN_ORDER_PTX = tl.constexpr(
    "{\n"
    ".reg .b32 p, t;\n"
    "prmt.b32 p, $4, 0, 0x3120;\n"
    "lop3.b32 $0, p, 0x000F000F, 0x64006400, 0xEA;\n"
    "lop3.b32 $2, p, 0x00F000F0, 0x64006400, 0xEA;\n"
    "shr.u32 t, p, 8;\n"
    "lop3.b32 $1, t, 0x000F000F, 0x64006400, 0xEA;\n"
    "lop3.b32 $3, t, 0x00F000F0, 0x64006400, 0xEA;\n"
    "}")
