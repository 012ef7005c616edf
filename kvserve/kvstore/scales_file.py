"""Static KV scales: calibrated per-channel absolute maxima in a small JSON file, and the per-channel
scales the quantized formats divide by (`kvserve calibrate-kv` writes the file; --kv-scales-file reads it)."""

from __future__ import annotations

import json
from typing import Sequence

import torch

from kvserve.kvstore.formats import MIN_SCALE, KVFormat


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
