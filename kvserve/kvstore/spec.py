"""The KV cache spec of a whole model: per layer the formats of its two parts, their shapes, and the
window / sink / error-feedback options; the bytes per token that size the block pool follow from it.

int4 keys default to per-channel scales per paged block (asymmetric, KIVI's layout: formats.py),
which need no full-precision window; per-token int4 keys (`kv_quant_key_layout="token"`) keep the
window of 128 recent and 4 sink tokens by default (docs/kv_quantization.md, measurements)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kvserve.config import resolve_format_name
from kvserve.kvstore.formats import KEY_LAYOUTS, QUANTIZED, KVFormat
from kvserve.kvstore.scales_file import load_scales, scales_from_absmax


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

    def part_dims(self) -> tuple[int, int]:
        """The widths of a layer's two parts (K and V here; MLA's latent and RoPE key differ)."""
        return self.head_dim, self.head_dim

    def part_layouts(self):
        """(layer, part name "k"/"v", format, width) of every part, in store order."""
        for layer, pair in enumerate(self.layer_formats):
            for part_name, fmt, dim in zip("kv", pair, self.part_dims()):
                yield layer, part_name, fmt, dim

    @property
    def bytes_per_token(self) -> int:
        """Paged-cache bytes of one token over all layers (payload + scales of both parts)."""
        return sum(fmt.bytes_per_token(self.num_kv_heads, dim, self.model_dtype)
                   for _, _, fmt, dim in self.part_layouts())

    def fixed_bytes(self, rows: int) -> int:
        """Bytes outside the paged pool: the full-precision rings and error-feedback residuals of
        `rows` running sequences (plus each part's trash row)."""
        if not self.needs_rows:
            return 0
        element = torch.empty((), dtype=self.model_dtype).element_size()
        total = 0
        for _, _, fmt, dim in self.part_layouts():
            if not fmt.quantized:
                continue
            if self.window or self.sinks:
                total += (rows * (self.sinks + self.window) + 1) * self.num_kv_heads * dim * element
            if self.error_feedback:
                total += (rows + 1) * self.num_kv_heads * dim * 4
        return total

    def describe(self) -> str:
        names = sorted({f"{k.name}{'(per channel)' if k.per_channel else ''}/{v.name}" for k, v in self.layer_formats})
        extra = f", window {self.window}, sinks {self.sinks}" if self.needs_rows else ""
        return f"K/V {','.join(names)}{extra}, {self.bytes_per_token} bytes/token"


def build_kv_cache_spec(num_layers: int, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype,
                        kv_cache_dtype: str = "auto", kv_cache_dtype_k: Optional[str] = None,
                        kv_cache_dtype_v: Optional[str] = None, kv_full_precision_first_layers: int = 0,
                        kv_full_precision_last_layers: int = 0, kv_quant_group_size: Optional[int] = None,
                        kv_quant_window: Optional[int] = None, kv_quant_sinks: Optional[int] = None,
                        kv_error_feedback: bool = False, kv_scales_file: Optional[str] = None,
                        kv_static_scale_parts: str = "kv", kv_quant_key_layout: str = "auto",
                        block_size: int = 16) -> KVCacheSpec:
    """The spec from the cache options (CacheConfig's kv_* fields and block_size, same names).
    `block_size` matters to per-channel keys only: their scales are per block of that many tokens."""
    key_name = resolve_format_name(kv_cache_dtype_k or kv_cache_dtype)
    value_name = resolve_format_name(kv_cache_dtype_v or kv_cache_dtype)
    absmax = load_scales(kv_scales_file) if kv_scales_file else {}
    if kv_quant_key_layout not in KEY_LAYOUTS:
        raise ValueError(f"kv_quant_key_layout must be one of {', '.join(KEY_LAYOUTS)}, got {kv_quant_key_layout!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")

    def make(name: str, part: str) -> KVFormat:
        quantized = name in QUANTIZED
        group = kv_quant_group_size if kv_quant_group_size is not None else (32 if name == "int4" else 0)
        group = min(group, head_dim)      # a group never spans heads
        use_static = bool(absmax) and quantized and part in kv_static_scale_parts
        channel = 0
        if part == "k" and quantized:
            if kv_quant_key_layout == "channel":
                if name != "int4" or use_static:
                    raise ValueError(f"kv_quant_key_layout channel is implemented for int4 keys with dynamic scales; "
                                     f"the keys are {name}{' with static scales' if use_static else ''}")
                channel = block_size
            elif kv_quant_key_layout == "auto" and name == "int4" and not use_static and not kv_error_feedback:
                # int4 keys per channel by default: no window needed (docs/kv_quantization.md).
                channel = block_size
        fmt = KVFormat(name, group if quantized and not channel else 0, use_static, channel)
        fmt.validate(head_dim)
        return fmt

    quantized_pair = (make(key_name, "k"), make(value_name, "v"))
    full_pair = (KVFormat("auto"), KVFormat("auto"))
    layers = []
    for layer in range(num_layers):
        keep_full = layer < kv_full_precision_first_layers or layer >= num_layers - kv_full_precision_last_layers
        layers.append(full_pair if keep_full else quantized_pair)
    # The window carries int4 keys with per-token (or static) scales: +15.7% perplexity without it
    # on the default model, +0.2% with it; per-channel keys need none (docs/kv_quantization.md).
    token_int4_keys = quantized_pair[0].name == "int4" and not quantized_pair[0].per_channel
    window = kv_quant_window if kv_quant_window is not None else (128 if token_int4_keys else 0)
    sinks = kv_quant_sinks if kv_quant_sinks is not None else (4 if token_int4_keys else 0)
    if window < 0 or sinks < 0:
        raise ValueError("kv_quant_window and kv_quant_sinks must be >= 0")
    if kv_error_feedback and quantized_pair[0].per_channel:
        raise ValueError("kv_error_feedback is implemented for per-token scales: with int4 keys, pass "
                         "kv_quant_key_layout token")
    static = scales_from_absmax(absmax, layers)
    return KVCacheSpec(layers, num_kv_heads, head_dim, model_dtype, window, sinks, kv_error_feedback, static)




def capacity_ratio(spec: KVCacheSpec, reference_bytes_per_element: int = 2) -> float:
    """Tokens held per byte relative to a 16-bit cache (the issue's bf16 yardstick)."""
    layers = len(spec.layer_formats)
    reference = 2 * layers * spec.num_kv_heads * spec.head_dim * reference_bytes_per_element
    return reference / spec.bytes_per_token


# The engine options that choose the KV formats (eval/kv_fidelity's formats set exactly these), and
# all those that make up a spec (build_kv_cache_spec's keywords): the block size too, which the
# per-channel key scales are laid out by.
KV_FORMAT_OPTIONS = ("kv_cache_dtype", "kv_cache_dtype_k", "kv_cache_dtype_v", "kv_full_precision_first_layers",
                     "kv_full_precision_last_layers", "kv_quant_group_size", "kv_quant_window", "kv_quant_sinks",
                     "kv_error_feedback", "kv_scales_file", "kv_static_scale_parts", "kv_quant_key_layout")
KV_SPEC_OPTIONS = KV_FORMAT_OPTIONS + ("block_size",)
