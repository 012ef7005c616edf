"""KV cache formats: what one part (keys or values) of one layer's paged cache stores, and the torch
reference of quantize-on-store and dequantize-on-gather.

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

A quantized part can keep a full-precision *window*: the first `sinks` tokens of a sequence and
its most recent `window` tokens, in a ring of `sinks + window` rows per running sequence. Every
token is also quantized into the paged cache when it is written, so nothing moves when a token
leaves the window; reads take the full-precision copy where the ring holds one. Keeping the sink
tokens exact is what stops the collapse seen when attention-sink tokens are quantized (transformers
issue 35185). The ring costs `rows * (sinks + window)` full-precision tokens, allocated once.

Optional error feedback carries each token's quantization residual (in fp32, per running sequence,
KV head and channel) into the next token's quantization of the same channel.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

# The names of KV formats are configuration vocabulary: config.py (a leaf) owns them.
from kvserve.config import KV_CACHE_DTYPES, resolve_format_name  # noqa: F401  (re-exported)

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


# --- one quantized part of one layer's cache -------------------------------------------------------
@dataclass
class QuantizedKVCache:
    """Device tensors of one quantized part (K or V) of one layer.

    payload [num_blocks, block_size, kv_heads, width]; scales [num_blocks, block_size, kv_heads,
    groups] fp16 (None with static scales); static_scale [kv_heads, head_dim] fp32; window
    [rows * (sinks + window) + 1, kv_heads, head_dim] in the model dtype (the last row takes writes
    that must be dropped, so a store never branches); residual [rows + 1, kv_heads, head_dim] fp32.
    """

    fmt: KVFormat
    payload: torch.Tensor
    scales: torch.Tensor | None
    head_dim: int
    dtype: torch.dtype                           # the model dtype reads dequantize to
    static_scale: torch.Tensor | None = None
    window_size: int = 0
    num_sinks: int = 0
    window: torch.Tensor | None = None
    residual: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical cache shape [num_blocks, block_size, kv_heads, head_dim]."""
        num_blocks, block_size, num_kv_heads, _ = self.payload.shape
        return num_blocks, block_size, num_kv_heads, self.head_dim

    @property
    def ring_len(self) -> int:
        return self.num_sinks + self.window_size

    # reference store: quantize on write
    def store(self, x: torch.Tensor, slot_mapping: torch.Tensor, window_slots: torch.Tensor | None = None,
              residual_rows: torch.Tensor | None = None) -> None:
        """x [T, kv_heads, head_dim] -> slots (and the full-precision ring at `window_slots`, which
        holds each token's ring row; the trash row for tokens the ring does not keep)."""
        num_kv_heads = x.shape[1]
        if self.residual is not None and residual_rows is not None:
            codes, scales = self._quantize_with_feedback(x, residual_rows)
        else:
            codes, scales = quantize(self.fmt, x, self.static_scale)
        self.payload.view(-1, num_kv_heads, codes.shape[-1]).index_copy_(0, slot_mapping, codes)
        if scales is not None:
            self.scales.view(-1, num_kv_heads, scales.shape[-1]).index_copy_(0, slot_mapping, scales)
        if self.window is not None and window_slots is not None:
            for column in range(window_slots.shape[1]):
                self.window.index_copy_(0, window_slots[:, column], x.to(self.window.dtype))

    def _quantize_with_feedback(self, x: torch.Tensor, rows: torch.Tensor):
        """Sequential over tokens: a token's residual feeds the next token of the same sequence.
        Tokens of one sequence are consecutive in a step, so this loops once per token (a decode
        step is one batched call over its rows)."""
        codes_out, scales_out = [], []
        x32 = x.float()
        # Decode tokens (distinct rows) first as one batch; then prefill tokens one at a time.
        rows_list = rows.tolist()
        start = 0
        while start < len(rows_list):
            end = start + 1
            seen = {rows_list[start]}
            while end < len(rows_list) and rows_list[end] not in seen:
                seen.add(rows_list[end])
                end += 1
            index = rows[start:end]
            target = x32[start:end] + self.residual[index]
            codes, scales = quantize(self.fmt, target, self.static_scale)
            rebuilt = dequantize(self.fmt, codes, scales, torch.float32, self.static_scale)
            self.residual[index] = target - rebuilt
            codes_out.append(codes)
            if scales is not None:
                scales_out.append(scales)
            start = end
        return torch.cat(codes_out), (torch.cat(scales_out) if scales_out else None)

    # reference gathers: dequantize on read
    def gather_blocks(self, block_tables: torch.Tensor) -> torch.Tensor:
        """Whole blocks of each row's table -> [B, max_blocks * block_size, kv_heads, head_dim]."""
        batch, max_blocks = block_tables.shape
        flat = block_tables.reshape(-1)
        payload = self.payload.index_select(0, flat)
        scales = self.scales.index_select(0, flat) if self.scales is not None else None
        values = dequantize(self.fmt, payload, scales, self.dtype, self.static_scale)
        return values.view(batch, max_blocks * self.payload.shape[1], *values.shape[2:])

    def gather_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Tokens at `slots` [C] -> [C, kv_heads, head_dim]."""
        num_kv_heads = self.payload.shape[2]
        payload = self.payload.view(-1, num_kv_heads, self.payload.shape[3])[slots]
        scales = None
        if self.scales is not None:
            scales = self.scales.view(-1, num_kv_heads, self.scales.shape[3])[slots]
        return dequantize(self.fmt, payload, scales, self.dtype, self.static_scale)

    def overlay_window(self, values: torch.Tensor, rows: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """values [B, L, kv_heads, head_dim] (position-indexed) with the ring's full-precision copies
        put in place of the sink positions and the last `window_size` positions of each row."""
        if self.window is None:
            return values
        batch, length = values.shape[:2]
        positions = torch.arange(length, device=values.device)[None, :]
        lens = context_lens.to(positions.dtype)[:, None]
        ring_index, use_ring = ring_lookup(positions, lens, self.num_sinks, self.window_size)
        flat_index = rows.to(positions.dtype)[:, None] * self.ring_len + ring_index
        flat_index = torch.where(use_ring, flat_index, torch.zeros_like(flat_index))
        exact = self.window[flat_index.reshape(-1)].view(batch, length, *values.shape[2:])
        return torch.where(use_ring[..., None, None], exact.to(values.dtype), values)


def ring_lookup(positions: torch.Tensor, context_lens: torch.Tensor, num_sinks: int,
                window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index in a sequence's ring, whether the ring holds the position) for positions < context_lens."""
    in_sink = positions < num_sinks
    in_window = positions >= context_lens - window if window else torch.zeros_like(in_sink)
    use_ring = (in_sink | in_window) & (positions < context_lens)
    ring_index = torch.where(in_sink, positions, num_sinks + (positions % window if window else 0))
    return ring_index, use_ring


# --- the whole model's cache spec -------------------------------------------------------------------
@dataclass
class KVCacheSpec:
    """Per-layer (key format, value format), and the window/sink/error-feedback options."""

    layer_formats: list[tuple[KVFormat, KVFormat]]
    num_kv_heads: int
    head_dim: int
    model_dtype: torch.dtype
    window: int = 0
    sinks: int = 0
    error_feedback: bool = False
    static_scales: dict[str, torch.Tensor] = field(default_factory=dict)   # "layers.{i}.{k|v}" -> [H, D]

    @property
    def quantized(self) -> bool:
        return any(part.quantized for pair in self.layer_formats for part in pair)

    @property
    def needs_rows(self) -> bool:
        """Whether quantized parts keep per-sequence state (ring or residual) the runner must index."""
        return self.quantized and (self.window > 0 or self.sinks > 0 or self.error_feedback)

    @property
    def bytes_per_token(self) -> int:
        """Paged-cache bytes of one token over all layers (payload + scales of K and V)."""
        return sum(part.bytes_per_token(self.num_kv_heads, self.head_dim, self.model_dtype)
                   for pair in self.layer_formats for part in pair)

    def full_precision_token_bytes(self) -> int:
        element = torch.empty((), dtype=self.model_dtype).element_size()
        return self.num_kv_heads * self.head_dim * element

    def fixed_bytes(self, rows: int) -> int:
        """Bytes outside the paged pool: the full-precision rings and error-feedback residuals."""
        if not self.needs_rows:
            return 0
        parts = sum(part.quantized for pair in self.layer_formats for part in pair)
        ring = (rows * (self.sinks + self.window) + 1) * self.full_precision_token_bytes()
        residual = (rows + 1) * self.num_kv_heads * self.head_dim * 4 if self.error_feedback else 0
        return parts * (ring + residual)

    def describe(self) -> str:
        names = sorted({f"{k.name}/{v.name}" for k, v in self.layer_formats})
        extra = f", window {self.window}, sinks {self.sinks}" if self.needs_rows else ""
        return f"K/V {','.join(names)}{extra}, {self.bytes_per_token} bytes/token"

    def allocate(self, num_blocks: int, block_size: int, device: torch.device, rows: int = 0) -> list:
        """One (K, V) pair per layer: plain tensors for full precision, QuantizedKVCache otherwise."""
        caches = []
        for layer, pair in enumerate(self.layer_formats):
            parts = []
            for part_name, fmt in zip("kv", pair):
                if not fmt.quantized:
                    shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
                    parts.append(torch.zeros(shape, dtype=fmt.storage_dtype(self.model_dtype), device=device))
                    continue
                parts.append(self._allocate_part(fmt, f"layers.{layer}.{part_name}", num_blocks, block_size,
                                                 device, rows))
            caches.append(tuple(parts))
        return caches

    def _allocate_part(self, fmt: KVFormat, name: str, num_blocks: int, block_size: int,
                       device: torch.device, rows: int) -> QuantizedKVCache:
        heads, dim = self.num_kv_heads, self.head_dim
        payload = torch.zeros(num_blocks, block_size, heads, fmt.payload_width(dim),
                              dtype=fmt.storage_dtype(self.model_dtype), device=device)
        if fmt.name == "int4":
            payload.fill_(0x88)          # codes of 0.0: a never-written slot reads as zeros
        groups = fmt.num_scale_groups(dim)
        scales = torch.ones(num_blocks, block_size, heads, groups, dtype=SCALE_DTYPE, device=device) \
            if groups else None
        static = None
        if fmt.static_scales:
            if name not in self.static_scales:
                raise ValueError(f"the KV scales file has no scales for {name}")
            static = self.static_scales[name].to(device=device, dtype=torch.float32).contiguous()
        window = residual = None
        if self.needs_rows and (self.window or self.sinks):
            window = torch.zeros(rows * (self.sinks + self.window) + 1, heads, dim, dtype=self.model_dtype,
                                 device=device)
        if self.needs_rows and self.error_feedback:
            residual = torch.zeros(rows + 1, heads, dim, dtype=torch.float32, device=device)
        return QuantizedKVCache(fmt, payload, scales, dim, self.model_dtype, static, self.window, self.sinks,
                                window, residual)


def build_kv_cache_spec(num_layers: int, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype,
                        kv_cache_dtype: str = "auto", kv_cache_dtype_k: Optional[str] = None,
                        kv_cache_dtype_v: Optional[str] = None, kv_full_precision_first_layers: int = 0,
                        kv_full_precision_last_layers: int = 0, kv_quant_group_size: Optional[int] = None,
                        kv_quant_window: Optional[int] = None, kv_quant_sinks: Optional[int] = None,
                        kv_error_feedback: bool = False, kv_scales_file: Optional[str] = None,
                        kv_static_scale_parts: str = "kv") -> KVCacheSpec:
    """The spec from the cache options (CacheConfig's kv_* fields, same names)."""
    key_name = resolve_format_name(kv_cache_dtype_k or kv_cache_dtype)
    value_name = resolve_format_name(kv_cache_dtype_v or kv_cache_dtype)
    absmax = load_scales(kv_scales_file) if kv_scales_file else {}
    any_int4 = "int4" in (key_name, value_name)

    def make(name: str, part: str) -> KVFormat:
        quantized = name in QUANTIZED
        group = kv_quant_group_size if kv_quant_group_size is not None else (32 if name == "int4" else 0)
        group = min(group, head_dim)      # a group never spans heads
        use_static = bool(absmax) and quantized and part in kv_static_scale_parts
        fmt = KVFormat(name, group if quantized else 0, use_static)
        fmt.validate(head_dim)
        return fmt

    quantized_pair = (make(key_name, "k"), make(value_name, "v"))
    full_pair = (KVFormat("auto"), KVFormat("auto"))
    layers = []
    for layer in range(num_layers):
        keep_full = layer < kv_full_precision_first_layers or layer >= num_layers - kv_full_precision_last_layers
        layers.append(full_pair if keep_full else quantized_pair)
    window = kv_quant_window if kv_quant_window is not None else (128 if any_int4 else 0)
    sinks = kv_quant_sinks if kv_quant_sinks is not None else (4 if any_int4 else 0)
    if window < 0 or sinks < 0:
        raise ValueError("kv_quant_window and kv_quant_sinks must be >= 0")
    static = scales_from_absmax(absmax, layers)
    return KVCacheSpec(layers, num_kv_heads, head_dim, model_dtype, window, sinks, kv_error_feedback, static)


# --- static calibration -----------------------------------------------------------------------------
def save_scales(path: str, absmax: dict[str, torch.Tensor], meta: dict) -> None:
    """Calibrated per-channel absolute maxima -> a JSON scales file (readable, small)."""
    record = {"format": "kvserve-kv-scales/1", "meta": meta,
              "absmax": {name: tensor.float().tolist() for name, tensor in absmax.items()}}
    with open(path, "w") as fh:
        json.dump(record, fh)


def load_scales(path: str) -> dict[str, torch.Tensor]:
    """Scales file -> {"layers.{i}.{k|v}": absmax [kv_heads, head_dim]}; callers divide by qmax
    (see static_scale_for)."""
    with open(path) as fh:
        record = json.load(fh)
    if record.get("format") != "kvserve-kv-scales/1":
        raise ValueError(f"{path} is not a kvserve KV scales file")
    return {name: torch.tensor(values, dtype=torch.float32) for name, values in record["absmax"].items()}


def scales_from_absmax(absmax: dict[str, torch.Tensor], spec_formats: Sequence[tuple[KVFormat, KVFormat]]
                       ) -> dict[str, torch.Tensor]:
    """Per-channel absmax -> per-channel scales for each layer's quantized parts."""
    scales = {}
    for layer, pair in enumerate(spec_formats):
        for part_name, fmt in zip("kv", pair):
            name = f"layers.{layer}.{part_name}"
            if fmt.quantized and fmt.static_scales and name in absmax:
                scales[name] = (absmax[name] / fmt.qmax).clamp_min(MIN_SCALE)
    return scales


def capacity_ratio(spec: KVCacheSpec, reference_bytes_per_element: int = 2) -> float:
    """Tokens held per byte relative to a 16-bit cache (the issue's bf16 yardstick)."""
    layers = len(spec.layer_formats)
    reference = 2 * layers * spec.num_kv_heads * spec.head_dim * reference_bytes_per_element
    return reference / spec.bytes_per_token


# The engine options that make up a KV cache spec (build_kv_cache_spec's keywords; eval/kv_fidelity's
# formats set exactly these).
KV_SPEC_OPTIONS = ("kv_cache_dtype", "kv_cache_dtype_k", "kv_cache_dtype_v", "kv_full_precision_first_layers",
                   "kv_full_precision_last_layers", "kv_quant_group_size", "kv_quant_window", "kv_quant_sinks",
                   "kv_error_feedback", "kv_scales_file", "kv_static_scale_parts")


def spec_from_config(model: torch.nn.Module, model_dtype: torch.dtype, cache_config) -> KVCacheSpec:
    """The spec of `model`'s cache from a CacheConfig (its kv_* fields)."""
    options = {name: getattr(cache_config, name) for name in KV_SPEC_OPTIONS if hasattr(cache_config, name)}
    if hasattr(model, "build_kv_cache_spec"):
        # A model with its own cache layout (MLA's latent + RoPE key: kvserve/model/mla_cache.py).
        return model.build_kv_cache_spec(model_dtype, options)
    num_kv_heads, head_dim = model.kv_head_shape
    return build_kv_cache_spec(model.num_kv_layers, num_kv_heads, head_dim, model_dtype, **options)
