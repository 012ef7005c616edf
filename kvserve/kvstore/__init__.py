"""The KV bytes: formats (formats.py), one quantized part (quantized_part.py), a model's spec
(spec.py), static scales files (scales_file.py) and the store that owns and moves them (store.py)."""

from kvserve.kvstore.formats import QUANTIZED, KVFormat, dequantize, quantize
from kvserve.kvstore.quantized_part import QuantizedKVCache
from kvserve.kvstore.scales_file import load_scales, save_scales
from kvserve.kvstore.spec import KV_SPEC_OPTIONS, KVCacheSpec, build_kv_cache_spec, capacity_ratio
from kvserve.kvstore.store import (DEVICE_STORE, HOST_STORE, LOAD, SWAP_IN, SWAP_OUT, WRITE_BACK, BlockCopy,
                                   KVCacheStore, KVPart, LayerKV, is_quantized)

__all__ = ["QUANTIZED", "KVFormat", "dequantize", "quantize", "QuantizedKVCache", "load_scales", "save_scales",
           "KV_SPEC_OPTIONS", "KVCacheSpec", "build_kv_cache_spec", "capacity_ratio", "DEVICE_STORE", "HOST_STORE",
           "LOAD", "SWAP_IN", "SWAP_OUT", "WRITE_BACK", "BlockCopy", "KVCacheStore", "KVPart", "LayerKV", "is_quantized"]
