"""Engine: add_request / step / abort around Scheduler -> ModelRunner -> Sampler.

`step()` runs the loop once and is synchronous and deterministic given its inputs, so it can be
tested without a server. Nothing here imports the server.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from kvserve.config import EngineConfig
from kvserve.engine.cold_tiers import ColdTierBridge, build_cold_tiers, model_fingerprint
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.kv_map import make_kv_map
from kvserve.engine.press_control import PressControl
from kvserve.engine.runtime_config import AUTO, HOST_FIELD, ConfigChange, RuntimeConfig
from kvserve.engine.structured_output import StructuredOutputs
from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sched import phases
from kvserve.sched.phases import RequestPhases
from kvserve.sched.request import PENDING_TOKEN, CacheOptions, Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.sched.output import SchedulerOutput
from kvserve.model.compute_shape import ComputeShape, attention_pairs, compute_shape
from kvserve.sched.preemption_cost import PreemptionCost
from kvserve.sched.priority import aging_grace_s
from kvserve.sched.qos_config import QoSClassForbidden
from kvserve.sched.scheduler import RequestForbidden, RequestRejected, Scheduler, SchedulerStalled
from kvserve.sched.step_cost import StepShape, measure_step_shapes
from kvserve.structured.grammar import GrammarUnavailable
from kvserve.stats import EngineStats, KVMapSnapshot, ExpertLoadStats, TenantUsage
from kvserve.kvcache.host_tier import HostTier, default_write_policy
from kvserve.kvcache.memory_pressure import HostTierSizer, PressureMonitor
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvstore import HOST_STORE, KVCacheStore
from kvserve.kvcache.prefix_cache import PrefixCache, build_prefix_cache
from kvserve.kvcache.prefix_control import PinInfo, PrefixControl
from kvserve.model.loader.generation_config import eos_token_ids as generation_eos_token_ids
from kvserve.model.quantized_linear import kept_linears
from kvserve.model.builder import build_model, kept_weight_types, kernel_switches, resolve_device, resolve_dtype
from kvserve.model.loader import resolve_model
from kvserve.model.interfaces import MoEModel
from kvserve.model.llama import LlamaForCausalLM
from kvserve.worker.bandwidth import BandwidthMeter, measure_copy_bandwidth, weight_profile
from kvserve.worker.kv_sizing import DEFAULT_CPU_KV_BYTES, KVSizing, size_kv_cache, spec_from_config
from kvserve.worker.memory_profile import (HOST_TIER_SEGMENTS, available_host_memory, cuda_kv_budget,
                                           default_host_tier_bytes)
from kvserve.worker.runner import InflightStep, ModelRunner, StepResult
from kvserve.worker.sampler import GrammarBitmask

logger = logging.getLogger("kvserve")

PromptInput = Union[str, list[int], dict[str, Any]]


@dataclass
class EngineCounters:
    """Totals the engine keeps itself (make_stats copies them into EngineStats)."""
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: dict[str, int] = field(default_factory=dict)
    # KV bytes the decode attention read: each decoding request's KV length (pressed or tiered
    # KV is shorter) times the bytes a token takes in its format, summed over steps.
    decode_kv_bytes_total: int = 0
    # Per tenant, the requests that left (the operator's usage summary and the per-tenant series of
    # /metrics both read these): one entry per tenant seen since start.
    tenant_usage: dict[Optional[str], TenantUsage] = field(default_factory=dict)


@dataclass
class _Group:
    """One user request: n samples that share a prompt."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[Optional[IncrementalDetokenizer]]


def freeze_startup_objects() -> None:
    """For a process that keeps its engine for its lifetime (the CLI commands, the server): collect,
    then move every object alive now (weights, modules, tokenizer) out of the garbage collector's
    generations, so the full collections that steps' short-lived objects trigger no longer traverse
    them (measured on CPU: docs/cpu_performance.md#history). Not done by the
    Engine itself: a process that builds many engines (tests, notebooks) would keep any reference
    cycle among frozen objects alive."""
    gc.collect()
    gc.freeze()


class Engine:
    def __init__(self, config: EngineConfig, *, detokenize: bool = True) -> None:
        """detokenize=False: outputs carry token ids only (text ""), and stop strings are left to
        whoever reads them: the engine core process, whose front ends detokenize (docs/server.md)."""
        self.detokenize = detokenize
        self.device = resolve_device(config.model_config.device)
        self.config = config = config.resolved_for(self.device.type)
        model_cfg, cache_cfg = config.model_config, config.cache_config
        self.source = resolve_model(model_cfg.model, model_cfg.load_format)
        self.dtype = resolve_dtype(model_cfg.dtype, self.source.hf_config, self.device)
        self.tokenizer = self.source.load_tokenizer()
        started = time.perf_counter()
        self.model = build_model(self.source, self.dtype, self.device, model_cfg.load_format, model_cfg.seed,
                                 kernel_switches(model_cfg),
                                 kept_weight_types(model_cfg.quantization, self.source, self.device))
        if isinstance(self.model, MoEModel):
            self.model.set_moe_implementation(model_cfg.moe_implementation)
        kept = kept_linears(self.model)
        logger.info("loaded %s (%s) on %s as %s in %.1fs%s", self.source.path, self.source.architecture,
                    self.device, self.dtype, time.perf_counter() - started,
                    "".join(f"; {count} linears kept in {name} blocks" for name, count in sorted(kept.items())))

        # The copy bandwidth each step is set against, measured before the KV cache takes the memory.
        peak_bandwidth = measure_copy_bandwidth(str(self.device))
        # The KV format (kvserve/kvstore/) sets the true bytes per token, so it sizes the pool.
        self.kv_spec = spec_from_config(self.model, self.dtype, cache_cfg)
        self.kv_bytes_per_token = self.kv_spec.bytes_per_token
        sizing = self._size_kv_cache()
        if sizing.max_num_seqs != config.scheduler_config.max_num_seqs:
            # The window rows of fewer requests fit: the engine's copy of the config says so.
            self.config = config = dataclasses.replace(
                config, scheduler_config=dataclasses.replace(config.scheduler_config, max_num_seqs=sizing.max_num_seqs))
        num_blocks = sizing.num_blocks
        block_size = cache_cfg.block_size
        prefix_cache = self._build_prefix_cache(num_blocks)
        self.host_store = self._build_host_store(prefix_cache is not None, num_blocks)
        host_tier = HostTier(self.host_store.num_blocks) if self.host_store is not None else None
        preemption_mode = config.scheduler_config.preemption_mode
        if preemption_mode in ("swap", "auto") and self.host_store is None:
            raise ValueError(f"preemption_mode {preemption_mode} needs the host KV tier: kv_host_memory > 0, with "
                             f"prefix caching on")
        policy = cache_cfg.kv_host_write_policy or default_write_policy(
            self.device.type, bool(cache_cfg.kv_disk_path or cache_cfg.kv_remote_url))
        if host_tier is not None:
            logger.info("host KV tier write policy: %s%s", policy,
                        "" if cache_cfg.kv_host_write_policy else " (the default: --kv-host-write-policy sets it)")
        self.kv_manager = KVCacheManager(num_blocks, block_size, prefix_cache, host_tier,
                                         write_through=policy == "write-through",
                                         write_back_min_uses=cache_cfg.kv_host_min_uses if policy == "selective" else 1)
        # Tenant namespaces, pins and the published prefix-cache stats (docs/prefix_caching.md).
        self.prefix = PrefixControl(self.kv_manager, cache_cfg.eviction_policy, cache_cfg.prefix_sharing,
                                    cache_cfg.prefix_share_groups)
        model_limit = int(getattr(self.source.hf_config, "max_position_embeddings", 0) or 1 << 20)
        max_model_len = model_cfg.max_model_len or model_limit
        capacity = self.kv_manager.capacity_tokens
        if max_model_len > capacity:
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); clipping", max_model_len, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.eos_token_ids = self._eos_token_ids()
        self.runner = ModelRunner(self.model, self.device, self.dtype, num_blocks, block_size, self.eos_token_ids,
                                  model_cfg.attention_backend, self.kv_spec,
                                  config.scheduler_config.max_num_seqs)
        # Bytes each step reads against the measured copy bandwidth (docs/observability.md#bandwidth).
        self.bandwidth = BandwidthMeter(weight_profile(self.model), self.kv_bytes_per_token, *peak_bandwidth)
        self.preemption_cost: Optional[PreemptionCost] = None
        self.host_pressure: Optional[PressureMonitor] = None
        self.host_sizer: Optional[HostTierSizer] = None
        if self.host_store is not None and cache_cfg.kv_host_memory_pressure > 0:
            self.host_pressure = PressureMonitor()
            self.host_sizer = HostTierSizer(self.host_store.num_blocks, self.host_store.block_nbytes,
                                            threshold=cache_cfg.kv_host_memory_pressure,
                                            chunk_fraction=1 / HOST_TIER_SEGMENTS)
        if self.host_store is not None:
            self.runner.register_store(HOST_STORE, self.host_store)
            link = self.runner.transfers.measure_link(HOST_STORE)
            logger.info("host KV tier link: %.1f GB/s host to device (measured)", link / 1e9)
            inline_ms = cache_cfg.kv_host_inline_load_ms
            self.kv_manager.inline_loads_when_idle = inline_ms > 0
            self.kv_manager.inline_load_max_blocks = int(inline_ms / 1e3 * link) // self.host_store.block_nbytes
            # Measured link and prefill rates: auto preemption weighs them, and so does the cold
            # tiers' prefetch (a read slower than recomputing is not started).
            if preemption_mode == "auto" or cache_cfg.kv_disk_path or cache_cfg.kv_remote_url:
                self.preemption_cost = PreemptionCost(self.kv_bytes_per_token, transfer_bytes_per_s=link,
                                                      shape=self._compute_shape())
        if not model_cfg.enforce_eager:
            started = time.perf_counter()
            # With the host tier a request may tier its KV (kv_press_mode "tier"), which ranks blocks
            # on decode queries: the graphs record them, so its ranking steps replay graphs too.
            tiering_possible = host_tier is not None and isinstance(self.model, LlamaForCausalLM)
            self.runner.capture_cuda_graphs(config.scheduler_config.max_num_seqs, max_model_len,
                                            self.source.hf_config.num_attention_heads if tiering_possible else 0)
            if self.runner.graphs is not None:
                logger.info("captured CUDA graphs for decode batch sizes %s in %.1fs",
                            self.runner.graphs.sizes, time.perf_counter() - started)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_manager, max_model_len, self.preemption_cost)
        self.cold = self._build_cold_tiers(host_tier)
        # KV compression: the presses prune the per-head K/V of the Llama family's attention.
        self.press = PressControl(cache_cfg, self.kv_spec,
                                  "gqa" if isinstance(self.model, LlamaForCausalLM) else type(self.model).__name__,
                                  host_tier=host_tier is not None)
        if self.scheduler.slo is not None:
            self.calibrate_step_cost()
        self.stats = EngineCounters()
        self._groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, _Group] = {}
        self._ids = itertools.count()
        # Overlapped scheduling (CUDA): the launched step whose sampled tokens are not yet read.
        mode = config.scheduler_config.async_scheduling
        self._async = mode == "on" or (mode == "auto" and self.device.type == "cuda")
        self._inflight: Optional[InflightStep] = None
        # Structured output: grammar matchers per constrained request (docs/structured_output.md).
        self.structured = StructuredOutputs(self.tokenizer, self.model.config.vocab_size, sorted(self.eos_token_ids),
                                            pin_memory=self.device.type == "cuda")
        self._grammar_outputs: list[RequestOutput] = []
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%s), max_model_len %d",
                    num_blocks, block_size, capacity, self.kv_spec.describe(), max_model_len)
        self.reset_expert_load()      # the profiling step is not load
        # Settings the admin config API may change between steps, and the log of changes.
        self.initial_max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        self.runtime = RuntimeConfig(self)

    # --- MoE expert load (tokens per expert per layer; kvserve/model/moe.py) ----------------------
    def expert_load(self):
        """ExpertLoadStats since the last reset, or None for a model without MoE layers."""
        return self.model.expert_load() if isinstance(self.model, MoEModel) else None

    def reset_expert_load(self) -> None:
        if isinstance(self.model, MoEModel):
            self.model.reset_expert_load()
        self._expert_load_read_at = float("-inf")      # make_stats reads the zeroed counters next

    @classmethod
    def from_options(cls, **options: Any) -> "Engine":
        return cls(EngineConfig.from_options(**options))

    # --- sizing ---------------------------------------------------------------------------------
    def _compute_shape(self) -> Optional[ComputeShape]:
        """The model's FLOPs per token and per attention pair (None for a config it cannot read: the
        cost models then charge tokens alone)."""
        try:
            return compute_shape(self.source.hf_config)
        except (AttributeError, TypeError) as exc:
            logger.warning("cannot tell the model's compute per token from its config (%s): recompute "
                           "costs ignore the context's attention", exc)
            return None

    def _size_kv_cache(self) -> KVSizing:
        """Blocks from kv_cache_memory (default: 1 GiB on CPU; on CUDA, gpu_memory_utilization of the
        memory a profiled worst-case step leaves free)."""
        cache_cfg, sched = self.config.cache_config, self.config.scheduler_config
        budget = cache_cfg.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            budget = cuda_kv_budget(self.model, self.device, self.dtype, cache_cfg.block_size,
                                    sched.max_num_batched_tokens, sched.max_num_seqs,
                                    self.config.model_config.attention_backend, cache_cfg.gpu_memory_utilization)
        elif budget is None:
            budget = DEFAULT_CPU_KV_BYTES
        return size_kv_cache(self.kv_spec, budget, cache_cfg.block_size, sched.max_num_seqs)

    def _build_host_store(self, prefix_caching: bool, num_device_blocks: int) -> Optional[KVCacheStore]:
        """The host tier's KV store (--kv-host-memory): blocks in the device store's format, in
        pinned memory on CUDA so copies to and from the GPU run at the link's rate."""
        cache_cfg = self.config.cache_config
        available = available_host_memory()
        requested = cache_cfg.kv_host_memory
        block_bytes = self.kv_spec.bytes_per_token * cache_cfg.block_size
        if requested is None:
            requested = default_host_tier_bytes(self.device, available, num_device_blocks * block_bytes)
        if not requested:
            return None
        if not prefix_caching:
            if cache_cfg.kv_host_memory is not None:     # asked for, not the default
                logger.warning("the host KV tier is off: it keeps blocks the prefix cache evicts, and prefix "
                               "caching is off")
            return None
        if available is not None and requested > available:
            raise ValueError(f"kv_host_memory of {requested} bytes exceeds the host memory available "
                             f"now ({available} bytes, MemAvailable); ask for at most that, less what the process "
                             f"needs besides")
        num_blocks = requested // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_host_memory of {requested} bytes holds no KV block ({block_bytes} bytes)")
        try:
            # In segments: memory pressure gives them back to the OS one at a time.
            store = KVCacheStore.allocate_flat(self.kv_spec, num_blocks, cache_cfg.block_size,
                                               pin_memory=self.device.type == "cuda",
                                               segment_blocks=-(-num_blocks // HOST_TIER_SEGMENTS))
        except RuntimeError as exc:      # pinning more than the machine allows
            raise ValueError(f"kv_host_memory of {requested} bytes cannot be allocated"
                             f"{' pinned' if self.device.type == 'cuda' else ''} ({available} bytes available): "
                             f"{exc}") from None
        logger.info("host KV tier: %d blocks x %d tokens = %d tokens (%.2f GiB%s)", num_blocks, cache_cfg.block_size,
                    num_blocks * cache_cfg.block_size, store.nbytes / 2**30,
                    ", the default: --kv-host-memory sets it, 0 turns it off"
                    if cache_cfg.kv_host_memory is None else "")
        return store

    def _build_prefix_cache(self, num_blocks: int) -> Optional[PrefixCache]:
        # Window formats cache their blocks too: a request starting from cached blocks gets its
        # full-precision ring filled from them (KVCacheStore.fill_window_rows).
        return build_prefix_cache(self.config.cache_config, num_blocks)

    def _time_step_shapes(self) -> list[tuple[StepShape, float]]:
        """Forwards timed at start (latency targets only): the step-cost model's first estimate, so
        that the first requests are judged by this device's speed (measure_step_shapes says which).
        A probe runner with a cache of its own keeps the engine's blocks untouched."""
        sched = self.config.scheduler_config
        block_size = self.config.cache_config.block_size
        budget = sched.max_num_batched_tokens
        probe = ModelRunner(self.model, self.device, self.dtype, -(-budget // block_size) + 1, block_size, set(),
                            self.config.model_config.attention_backend)
        cuda = self.device.type == "cuda"

        def forward(num_tokens: int, num_sequences: int) -> None:
            probe.profile_forward(num_tokens, num_sequences)
            if cuda:
                torch.cuda.synchronize(self.device)

        if cuda:
            torch.cuda.synchronize(self.device)
        samples = measure_step_shapes(forward, budget, sched.max_num_seqs)
        logger.info("step-cost calibration: %s", ", ".join(f"{s.num_tokens} tokens x {s.num_sequences} seqs "
                                                          f"{seconds * 1e3:.1f} ms" for s, seconds in samples))
        return samples

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        config_eos = getattr(self.source.hf_config, "eos_token_id", None)
        if isinstance(config_eos, int):
            ids.add(config_eos)
        elif isinstance(config_eos, (list, tuple)):
            ids.update(int(i) for i in config_eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        ids |= generation_eos_token_ids(str(self.source.path))     # R1 and Llama-3 list several
        return ids

    # --- requests -------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(map(int, prompt["prompt_token_ids"]))
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("this model has no tokenizer: pass prompt_token_ids")
            return prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, (list, tuple)):
            return None, list(map(int, prompt))
        raise RequestRejected(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def add_request(self, request_id: Optional[str], prompt: PromptInput,
                    params: Optional[SamplingParams] = None, *, tenant: Optional[str] = None,
                    cache_salt: Optional[str] = None, pin_ttl: Optional[float] = None,
                    pin_prefix_tokens: Optional[int] = None, arrival_time: Optional[float] = None,
                    priority: int = 0, forced_token_ids: Optional[list[int]] = None, trace: bool = False) -> str:
        """Queues a request (n samples); raises RequestRejected if it can never run, RequestOverloaded
        if latency targets shed it. tenant / cache_salt choose the prefix-cache namespace; pin_ttl pins
        the prompt's first pin_prefix_tokens (default all) for that many seconds (see CacheOptions).
        arrival_time (time.monotonic()) is when a server received it, if earlier than now: TTFT
        targets and metrics count from there. priority: with --scheduling-policy priority, lower
        goes first (kvserve/sched/priority.py); ignored by fcfs. A request in a class
        (params.qos_class, or its tenant's default; --qos-config) runs at its class's priority and
        is held to its targets; RequestForbidden for a class its tenant may not use.
        forced_token_ids (internal, for evaluation: kvserve/eval/forced_decoding.py; no API field):
        teacher forcing, each output token is the given one and its logprob under the model is
        recorded; one sample, max_tokens equal to their number. trace: record its phases
        (RequestOutput.phases; the server's --otlp-traces-endpoint), for the first sample."""
        params = params or SamplingParams()
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestRejected(f"priority must be an integer, got {priority!r}")
        try:
            cache_opts = CacheOptions.resolve(prompt, tenant=tenant, cache_salt=cache_salt, pin_ttl=pin_ttl,
                                              pin_prefix_tokens=pin_prefix_tokens)
            self.press.plan_for(params)          # checked once for the group; each child gets its own plan
            qos_class = self.scheduler.qos.class_for(cache_opts.tenant, params.qos_class)
            grammar = self.structured.compile(params)
        except QoSClassForbidden as exc:
            raise RequestForbidden(str(exc)) from None
        except (ValueError, GrammarUnavailable) as exc:
            raise RequestRejected(str(exc)) from None
        grace = 0.0
        if qos_class is not None:
            request_class = self.scheduler.qos.classes[qos_class]
            priority, grace = request_class.priority, aging_grace_s(request_class.ttft_p99)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self.tokenize_prompt(prompt)
        vocab = self.model.config.vocab_size
        if prompt_ids and not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab:
            raise RequestRejected(f"prompt token ids must lie in [0, {vocab})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt_ids)
        if forced_token_ids is not None:
            self._check_forced(forced_token_ids, params, max_tokens, vocab)
        self.scheduler.check_admissible(len(prompt_ids), max(max_tokens, 1), cache_opts.tenant)
        namespace = self.prefix.namespace(cache_opts.tenant, cache_opts.cache_salt)
        self.scheduler.check_overload(prompt_ids, max(max_tokens, 1), params.n, arrival_time, namespace, qos_class)
        if cache_opts.pin_ttl is not None:
            try:
                self.prefix.pin(prompt_ids[:cache_opts.pin_prefix_tokens], cache_opts.pin_ttl, cache_opts.tenant,
                                cache_opts.cache_salt)
            except ValueError as exc:
                raise RequestRejected(f"cannot pin the prompt: {exc}") from None
        children = []
        for index in range(params.n):
            child_params = params
            if params.seed is not None and index:
                child_params = _replace_seed(params, params.seed + index)
            child = Request(f"{request_id}#{index}" if params.n > 1 else request_id,
                            list(prompt_ids), child_params, max_tokens, tenant=cache_opts.tenant)
            if arrival_time is not None:
                child.arrival_time = arrival_time
            child.priority = priority
            child.aging_grace_s = grace
            child.qos_class = qos_class
            child.set_cache_namespace(namespace)
            child.press = self.press.plan_for(child_params)
            if forced_token_ids is not None:
                child.forced_token_ids = [int(t) for t in forced_token_ids]
            if grammar is not None:
                self.structured.add(child.request_id, grammar)
            if child.press is not None:
                child.publish_limit = 0          # until its press says which blocks it left intact
                child.press_stop = child.num_prompt_tokens
            children.append(child)
        if trace:
            first = children[0]
            first.phases = recorder = RequestPhases()
            # What the trace's request span says of it, as the engine resolved it.
            recorder.event(phases.REQUEST, first.arrival_time, kv_format=self.kv_spec.describe(),
                           tenant=first.tenant or "", qos_class=qos_class or "",
                           kv_press=first.press.press.name if first.press is not None else "",
                           samples=params.n, priority=priority)
            recorder.begin(phases.QUEUED, first.arrival_time, prompt_tokens=len(prompt_ids))
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop,
                                         params.include_stop_str_in_output)
                  if self.tokenizer is not None and self.detokenize else None
                  for _ in children]
        group = _Group(request_id, prompt_text, list(prompt_ids), children, detoks)
        for child in children:
            # With tiers below the host, the child waits for its prefix to come up first.
            self.scheduler.add_request(child, prefetching=self.cold is not None and self.cold.admit(child))
            self._child_to_group[child.request_id] = group
        self._groups[request_id] = group
        self.stats.prompt_tokens_total += len(prompt_ids) * len(children)
        return request_id

    @staticmethod
    def _check_forced(forced: list[int], params: SamplingParams, max_tokens: int, vocab: int) -> None:
        """Teacher forcing needs one sample whose every output is forced, with ids the model has."""
        if params.n != 1:
            raise RequestRejected(f"forced_token_ids needs n = 1, got n = {params.n}")
        if len(forced) != max_tokens:
            raise RequestRejected(f"forced_token_ids has {len(forced)} tokens; max_tokens must be as many, "
                                  f"got {max_tokens}")
        if forced and not 0 <= min(forced) <= max(forced) < vocab:
            raise RequestRejected(f"forced_token_ids must lie in [0, {vocab})")

    def estimate_cached_prompt_tokens(self, prompt_token_ids: list[int], tenant: Optional[str] = None,
                                      cache_salt: Optional[str] = None) -> int:
        """Prompt tokens the prefix cache holds now, for admission estimates. The one Engine method
        other threads may call while the engine thread runs: it only reads (PrefixCache.peek)."""
        return self.kv_manager.peek_cached_tokens(prompt_token_ids, self.prefix.namespace(tenant, cache_salt))

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Ends a request and frees its blocks; `reason` is what it is counted as ("error" when a
        failed step took it with it)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for child in group.children:
            self.scheduler.abort(child.request_id)
            self._child_to_group.pop(child.request_id, None)
            self.structured.remove(child.request_id)
            if self.cold is not None:
                self.cold.forget(child.request_id)
        self._count_finished(reason, len(group.children))
        self._count_tenant_usage(group, reason)
        return True

    def finish_sample(self, request_id: str, index: int, stop_reason: str) -> bool:
        """Ends sample `index` of a request as stopped by `stop_reason` (a stop string its reader
        found in the text) and frees its blocks; the request leaves once all its samples have
        ended. Returns whether the request has left (an unknown one has)."""
        group = self._groups.get(request_id)
        if group is None:
            return True
        if 0 <= index < len(group.children) and not group.children[index].is_finished:
            group.children[index].stop_reason = stop_reason
            self.scheduler.finish(group.children[index], RequestStatus.FINISHED_STOPPED)
        if not all(c.is_finished for c in group.children):
            return False
        self._retire(group)
        return True

    def _retire(self, group: _Group) -> None:
        """A request whose samples have all ended leaves the engine, counted by finish reason."""
        del self._groups[group.request_id]
        for child in group.children:
            self._child_to_group.pop(child.request_id, None)
            self.structured.remove(child.request_id)
            self._count_finished(child.finish_reason or "abort", 1)
        self._count_tenant_usage(group, group.children[0].finish_reason or "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)


    # --- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. With overlapped scheduling (CUDA, `async_scheduling`), a step is queued
        on the GPU before the previous step's tokens are read back: the host then turns those
        tokens into outputs and schedules the next step while the GPU computes. The outputs a step
        returns can therefore be the previous step's."""
        outputs: list[RequestOutput] = []
        started = scheduled_at = time.monotonic()
        sched_out: Optional[SchedulerOutput] = None
        try:
            self._collect_transfers()
            if self.cold is not None:
                self.cold.step()
            if self.host_sizer is not None:
                self._resize_host_tier()
            if self._inflight is not None and self._may_preempt():
                # Preemption recomputes from the token list, which must hold no pending token.
                outputs += self._finish_inflight()
            sched_out = self.scheduler.schedule()
            scheduled_at = time.monotonic()
            if sched_out.rejected:
                outputs += self._reject(sched_out.rejected)
            if sched_out.is_empty:
                if self._inflight is not None:
                    outputs += self._finish_inflight()
                elif self.scheduler.loading:
                    self._collect_transfers(wait=True)      # nothing to run until a load lands
                elif self.scheduler.prefetching and self.cold is not None:
                    self.cold.step(wait=True)               # nothing to run until a prefix comes up
                elif not sched_out.rejected and self.scheduler.is_stalled:
                    # Nothing runs, nothing was admitted, and nothing will change until a new command:
                    # callers that step until done would spin forever. Say so instead.
                    raise SchedulerStalled(
                        f"no waiting request can be scheduled ({self.scheduler.num_unfinished} unfinished, none "
                        f"running, {self.kv_manager.num_free_blocks} of {self.kv_manager.num_blocks} KV blocks "
                        f"free)")
                return outputs
            press_due = self.press.due(sched_out)
            if sched_out.block_copies:
                self._issue_block_copies(sched_out)
            if self._async and not press_due and self.runner.can_launch_ahead(sched_out):
                launched = self.runner.launch(sched_out, self.kv_manager.block_tables, self._inflight,
                                              self._grammar_bitmask)
                outputs += self._grammar_outputs
                self._grammar_outputs = []
                if self._inflight is not None:
                    outputs += self._finish_inflight()
                for item in sched_out.scheduled:
                    if not item.request.is_finished:    # finished by the tokens just read: results dropped
                        self.scheduler.advance(item)
                if launched is not None:
                    for request in launched.requests:
                        if not request.is_finished:
                            request.output_token_ids.append(PENDING_TOKEN)
                self._inflight = launched
                return outputs
            if self._inflight is not None:
                outputs += self._finish_inflight()
                sched_out.scheduled = [item for item in sched_out.scheduled if not item.request.is_finished]
                if sched_out.is_empty:
                    return outputs
            return outputs + self._run_step(sched_out, press_due)
        finally:
            if sched_out is not None and sched_out.scheduled:
                decode_kv_tokens = kv_tokens = pairs = 0
                traced = False
                for item in sched_out.scheduled:
                    kv_tokens += item.request.num_kv_tokens
                    if self.preemption_cost is not None:    # only its cost model reads them
                        pairs += attention_pairs(max(0, item.request.num_kv_tokens - item.num_new_tokens),
                                                 item.num_new_tokens)
                    if item.num_new_tokens == 1:
                        decode_kv_tokens += item.request.num_kv_tokens
                    traced = traced or item.request.phases is not None
                self.stats.decode_kv_bytes_total += self.kv_bytes_per_token * decode_kv_tokens
                elapsed = time.monotonic() - started
                utilization = self.bandwidth.observe(
                    self.bandwidth.step_bytes(sched_out.num_batched_tokens, kv_tokens), elapsed)
                if traced:
                    self._record_step_phases(sched_out, scheduled_at, started + elapsed, utilization)
                if self.scheduler.slo is not None:
                    self.scheduler.slo.observe_step(elapsed, len(sched_out.scheduled), sched_out.num_batched_tokens)
                if self.preemption_cost is not None:
                    self.preemption_cost.observe_step(sched_out.num_batched_tokens, elapsed, pairs)

    def _issue_block_copies(self, sched_out: SchedulerOutput) -> None:
        """Issues the step's block copies ahead of its forward. An inline load (BlockCopy.inline) that
        failed as it was issued takes its request out of the batch (it recomputes once the failure
        is reported), so no forward reads blocks that never arrived."""
        failed = self.runner.run_block_copies(sched_out.block_copies, beside_a_batch=bool(sched_out.scheduled))
        sched_out.block_copies = []
        held = {request_id for request_id in map(self.kv_manager.take_back_inline, failed) if request_id is not None}
        if held:
            logger.warning("%d inline KV load(s) failed as issued: their requests recompute", len(held))
            self.scheduler.hold_for_load(sched_out, held)

    def _record_step_phases(self, sched_out: SchedulerOutput, started: float, ended: float,
                            utilization: float) -> None:
        """A traced request's share of this step: a prefill chunk (its tokens, where they start), or
        one decode step (sampled: RequestPhases.step)."""
        batch = dict(batch_size=len(sched_out.scheduled), batch_tokens=sched_out.num_batched_tokens,
                     step_s=round(ended - started, 6), bandwidth_utilization=round(utilization, 4))
        # started: when the step's batch was scheduled (the request was admitted by then).
        for item in sched_out.scheduled:
            recorder = item.request.phases
            if recorder is None:
                continue
            first = item.request.num_computed_tokens - item.num_new_tokens
            if item.num_new_tokens > 1 or first < item.request.num_prompt_tokens:
                recorder.add(phases.PREFILL_CHUNK, started, ended, tokens=item.num_new_tokens, first_position=first,
                             recompute=item.request.num_preemptions > 0, **batch)
                if item.request.num_computed_tokens >= item.request.num_prompt_tokens \
                        and not recorder.is_open(phases.DECODE):
                    recorder.begin(phases.DECODE, ended)       # its first token is sampled by this chunk
            else:
                recorder.step(ended, **batch)

    def _build_cold_tiers(self, host_tier: Optional[HostTier]) -> Optional[ColdTierBridge]:
        """The disk and remote KV tiers (--kv-disk-path, --kv-remote-url), staged through the host tier."""
        cache_cfg = self.config.cache_config
        if not (cache_cfg.kv_disk_path or cache_cfg.kv_remote_url):
            return None
        if self.host_store is None or host_tier is None:
            raise ValueError("the disk and remote KV tiers (kv_disk_path, kv_remote_url) need the host KV tier "
                             "(kv_host_memory > 0): their blocks come and go through it")
        tiers = build_cold_tiers(self.config, self.host_store.block_nbytes)
        fingerprint = model_fingerprint(self.config, self.source.hf_config.to_dict(), str(self.source.path))
        names = ", ".join(store.name for store in tiers.stores)
        logger.info("cold KV tiers: %s (model fingerprint %s, KV format %s)", names, fingerprint,
                    self.kv_spec.describe())
        return ColdTierBridge(tiers, fingerprint, self.kv_spec.describe(), cache_cfg.block_size, self.kv_manager,
                              host_tier, self.host_store, self.runner.transfers, self.scheduler,
                              cache_cfg.kv_cold_max_wait, self.preemption_cost)

    @property
    def has_pending_tier_work(self) -> bool:
        """Idle, but blocks computed by the last steps have not reached the disk / remote tiers yet:
        the caller should `flush_tiers` rather than sleep (another replica, or a restart, would
        miss them)."""
        return self.cold is not None and (self.kv_manager.has_pending_copies or self.cold.has_pending_writes)

    @property
    def tier_writes_in_flight(self) -> bool:
        """Blocks handed to the disk / remote tiers whose writes have not finished."""
        return self.cold is not None and self.cold.tiers.writes_in_flight

    def flush_tiers(self) -> None:
        """Between requests: runs the block copies the last step queued (write-through of the
        blocks it filled) and hands what has landed to the disk / remote tiers. Nothing runs on the
        device meanwhile, so waiting for the copies costs no step."""
        if self.cold is None or self._inflight is not None or self.has_unfinished_requests():
            return
        copies = self.kv_manager.take_block_copies()
        if copies:
            self.runner.run_block_copies(copies)
        self.runner.transfers.synchronize()
        self._collect_transfers()               # dropped write-backs leave the host index first
        self.cold.step()                        # takes the issued blocks (their fence is recorded now)
        self.runner.transfers.synchronize()
        self.cold.step()                        # and hands them down, landed

    def close(self) -> None:
        """Hands what the host tier received to the cold tiers and waits for their writes (a
        restarted server finds them); a no-op without cold tiers."""
        if self.cold is not None:
            self.flush_tiers()
            self.cold.close()
            self.cold = None

    def _resize_host_tier(self) -> None:
        """Memory pressure (--kv-host-memory-pressure): the host tier gives segments back to the OS
        while the machine runs short, and takes them again once it has been calm a while."""
        tier = self.kv_manager.host_tier
        now = time.monotonic()
        target = self.host_sizer.decide(tier.capacity, self.host_pressure.sample(), now)
        if target == tier.capacity:
            return
        before = tier.capacity
        if self.set_host_tier_blocks(target) != before:
            # A run-time change of the tier's size, the engine's own: logged and counted as one.
            block_bytes = self.kv_bytes_per_token * self.config.cache_config.block_size
            self.runtime.events.record(AUTO, HOST_FIELD, before * block_bytes, tier.capacity * block_bytes,
                                       why=f"{before} -> {tier.capacity} host blocks: {self.host_sizer.last_reason}")

    def set_host_tier_blocks(self, target: int) -> int:
        """Resizes the host tier to `target` blocks (whole segments; blocks a swap or this step's loads
        hold are kept): memory pressure's sizer and the admin config API. Returns the new size."""
        tier, segment = self.kv_manager.host_tier, self.host_store.flat.segment_blocks
        if target > tier.capacity:
            tier.set_capacity(self.host_store.resize_flat(target), segment)
        else:
            self.runner.transfers.synchronize()     # no copy in flight touches a segment about to go
            self.host_store.resize_flat(tier.set_capacity(target, segment))
        return tier.capacity

    # --- run-time reconfiguration (engine/runtime_config.py; the admin config API) ---------------
    def runtime_config(self) -> dict[str, Any]:
        """The current value of every setting `reconfigure` may change."""
        return self.runtime.current()

    def reconfigure(self, changes: dict[str, Any]) -> list[ConfigChange]:
        """Changes settings between steps, all or none: every change is checked as its flag is (a
        ValueError naming the field, nothing applied), then applied, logged and recorded as a config
        event. Returns the changes that took effect, with their old and new values."""
        return self.runtime.reconfigure(changes)

    def calibrate_step_cost(self) -> None:
        """Primes the latency controller's step-cost model with forwards timed now (at start, or when
        a first latency target is set at run time)."""
        self.scheduler.slo.step_cost.calibrate(self._time_step_shapes())

    def _collect_transfers(self, wait: bool = False) -> None:
        """Hands the worker's report on tier copies to the scheduler and the KV manager."""
        transfers = self.runner.transfers
        loaded, seconds = transfers.loaded_bytes, transfers.load_seconds
        report = transfers.poll(wait)
        if self.preemption_cost is not None:
            self.preemption_cost.observe_transfer(transfers.loaded_bytes - loaded, transfers.load_seconds - seconds)
        if report.lost_host_blocks:
            self.kv_manager.forget_host_blocks(report.lost_host_blocks)
        if report.landed or report.failed:
            self.scheduler.complete_transfers(report.landed, report.failed)

    def _reject(self, requests: list[Request]) -> list[RequestOutput]:
        """Outputs for requests the scheduler shed; a group's other samples go with them."""
        outputs = []
        for request in requests:
            group = self._child_to_group.get(request.request_id)
            if group is None or self._groups.pop(group.request_id, None) is None:
                continue    # an earlier sample of its group took the group with it
            for child in group.children:
                self.scheduler.finish(child, RequestStatus.FINISHED_REJECTED)
                self._child_to_group.pop(child.request_id, None)
            self._count_finished(RequestStatus.FINISHED_REJECTED.value, len(group.children))
            self._count_tenant_usage(group, RequestStatus.FINISHED_REJECTED.value)
            outputs.append(self._make_output(group))
        return outputs

    def _may_preempt(self) -> bool:
        """Whether this step's scheduling could preempt: for blocks, or for priority."""
        return self.scheduler.may_run_out_of_blocks() or self.scheduler.wants_priority_preemption()

    def _grammar_bitmask(self, requests: list[Request]) -> Optional[GrammarBitmask]:
        """The runner's grammar hook: called with a step's sampled rows once its forward is queued.
        A constrained row's mask needs its previous token, so a launched-ahead step reads the step
        before it here (its outputs go out with this step's), then fills the masks while the
        device computes."""
        if not self.structured.active or not any(self.structured.has(r.request_id) for r in requests):
            return None
        if self._inflight is not None:
            self._grammar_outputs += self._finish_inflight()
        return self.structured.bitmask([r.request_id for r in requests])

    def _finish_inflight(self) -> list[RequestOutput]:
        inflight, self._inflight = self._inflight, None
        return self._process_results(inflight.results(), pending=True)

    def _run_step(self, sched_out: SchedulerOutput, press_due: Optional[dict[str, int]] = None) -> list[RequestOutput]:
        observe = {rid: rows for rid, rows in (press_due or {}).items() if rows}
        results = self.runner.execute(sched_out, self.kv_manager.block_tables, observe, self._grammar_bitmask)
        for item in sched_out.scheduled:
            self.scheduler.advance(item)
        if press_due:
            # Before the next step is scheduled: the blocks the presses free are free for it.
            self.press.apply([item.request for item in sched_out.scheduled if item.request.request_id in press_due],
                             self.runner, self.kv_manager)
        return self._process_results(results, pending=False)

    def _process_results(self, results: list[StepResult], pending: bool) -> list[RequestOutput]:
        """Records sampled tokens (in place of their PENDING_TOKEN when `pending`), checks stops,
        detokenizes, and builds the outputs of the groups that are due one."""
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        for result in results:
            request = result.request
            group = self._child_to_group.get(request.request_id)
            if group is None or request.is_finished:
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            if pending:
                self.scheduler.fill_pending_token(request, result.token_id, self.eos_token_ids)
            else:
                self.scheduler.append_token(request, result.token_id, self.eos_token_ids)
            if self.structured.accept(request.request_id, result.token_id) and not request.is_finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)   # its grammar is complete
            self.stats.generation_tokens_total += 1
            if result.logprobs is not None:
                request.output_logprobs.append(result.logprobs)
                request.cumulative_logprob += result.logprobs[result.token_id]
            detok = group.detokenizers[group.children.index(request)]
            if detok is not None:
                hit = detok.append(result.token_id)
                if hit is not None and not request.is_finished:
                    request.stop_reason = hit
                    self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            touched[group.request_id] = group
        outputs = [self._make_output(group) for group in touched.values()
                   if group.children[0].params.output_kind == "cumulative"
                   or all(child.is_finished for child in group.children)]
        for output in outputs:
            if output.finished:
                self._retire(self._groups[output.request_id])
        return outputs

    def _count_finished(self, reason: str, count: int) -> None:
        totals = self.stats.requests_finished_total
        totals[reason] = totals.get(reason, 0) + count

    def _count_tenant_usage(self, group: _Group, reason: str) -> None:
        """A request leaving, in its tenant's totals: by the first sample's reason and with the
        prompt once, as the response reports them."""
        first = group.children[0]
        usage = self.stats.tenant_usage
        usage[first.tenant] = usage.get(first.tenant, TenantUsage()).plus(
            reason, len(group.prompt_token_ids), first.num_cached_tokens or 0,
            sum(len(child.output_token_ids) for child in group.children))

    def _make_output(self, group: _Group) -> RequestOutput:
        completions = []
        for index, (child, detok) in enumerate(zip(group.children, group.detokenizers)):
            logprobs = list(child.output_logprobs) if child.params.logprobs is not None else None
            cumulative = child.cumulative_logprob if logprobs is not None else None
            completions.append(CompletionOutput(
                index=index, text=detok.text if detok is not None else "",
                token_ids=list(child.output_token_ids), cumulative_logprob=cumulative, logprobs=logprobs,
                finish_reason=child.finish_reason, stop_reason=child.stop_reason))
        first = group.children[0]
        prompt_logprobs = first.prompt_logprobs if first.params.prompt_logprobs is not None else None
        metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                                 max((c.finished_time or 0.0) for c in group.children) or None,
                                 sum(c.num_preemptions for c in group.children))
        finished = all(c.is_finished for c in group.children)
        records = None
        if finished and first.phases is not None:
            records = self._phase_records(first)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, prompt_logprobs,
                             completions, finished, metrics, first.num_cached_tokens, records)

    def _phase_records(self, request: Request) -> list:
        """Its phases, closed at its finish, once; a KV load's blocks also in bytes (its format's)."""
        recorder, request.phases = request.phases, None
        block_bytes = self.kv_bytes_per_token * self.config.cache_config.block_size
        records = recorder.finish(request.finished_time or time.monotonic())
        return [(name, start, end, {**attrs, "bytes": attrs["blocks"] * block_bytes})
                if name == phases.KV_LOAD else (name, start, end, attrs)
                for name, start, end, attrs in records]

    # --- prefix cache -----------------------------------------------------------------------------
    def pin_prefix(self, prompt: PromptInput, ttl_s: float, *, tenant: Optional[str] = None,
                   cache_salt: Optional[str] = None, num_tokens: Optional[int] = None) -> PinInfo:
        """Pins a prefix (e.g. a system prompt) in the tenant's namespace for ttl_s seconds:
        its blocks, cached now or when first computed, are evicted only after unpinned ones."""
        _, token_ids = self.tokenize_prompt(prompt)
        return self.prefix.pin(token_ids[:num_tokens], ttl_s, tenant, cache_salt)

    def unpin_prefix(self, pin_id: int, *, tenant: Optional[str] = None) -> bool:
        return self.prefix.unpin(pin_id, tenant)

    # --- introspection --------------------------------------------------------------------------
    def make_stats(self) -> EngineStats:
        """A frozen copy of what the engine's parts report (kvserve/stats.py): what metrics read."""
        counters = self.stats
        prefix_stats = self.prefix.make_stats()
        kv_stats = self.kv_manager.make_stats()
        if self.host_store is not None:
            kv_stats = dataclasses.replace(kv_stats, transfers=self.runner.transfers.make_stats())
        if self.cold is not None:
            kv_stats = dataclasses.replace(kv_stats, cold=self.cold.tiers.make_stats(),
                                           cold_writes_dropped=self.cold.tiers.writes_dropped,
                                           cold_hit_tokens=dict(self.cold.hit_tokens),
                                           cold_prefetches=self.cold.prefetch_outcomes())
        fair = self.scheduler.fair
        # tenant_usage's values are frozen: a copy of the dict is a copy of the totals.
        return EngineStats(self.scheduler.make_stats(), kv_stats, counters.prompt_tokens_total,
                           counters.generation_tokens_total, dict(counters.requests_finished_total),
                           prefix_cache=prefix_stats, expert_load=self._expert_load_stats(),
                           presses=self.press.make_stats(), decode_kv_bytes_total=counters.decode_kv_bytes_total,
                           tenant_usage=dict(counters.tenant_usage),
                           fair_share=fair.make_stats() if fair is not None else None,
                           bandwidth=self.bandwidth.make_stats(), config_events=self.runtime.events.events(),
                           runtime_config=self.runtime.make_stats())

    def make_kv_map(self, **bounds: int) -> KVMapSnapshot:
        """The KV cache block by block, bounded (engine/kv_map.py; max_cells, max_requests,
        max_trees, max_tree_nodes): what the dashboard draws. Engine thread, between steps."""
        return make_kv_map(self.kv_manager, self.scheduler, self.kv_spec.describe(), self.kv_bytes_per_token,
                           self.config.cache_config.heat_half_life_s, **bounds)

    # The expert load make_stats last read, and when (monotonic seconds): see _expert_load_stats.
    _expert_load_read: Optional[ExpertLoadStats] = None
    _expert_load_read_at: float = float("-inf")
    EXPERT_LOAD_READ_INTERVAL_S = 1.0

    def _expert_load_stats(self) -> Optional[ExpertLoadStats]:
        """expert_load() as stats data. Reading the counters waits for the GPU, which after every step
        would take the overlap from overlapped scheduling: they are read at most once a second while
        requests run, and whenever none do (so an idle engine publishes the final counts)."""
        now = time.monotonic()
        if self._groups and now - self._expert_load_read_at < self.EXPERT_LOAD_READ_INTERVAL_S:
            return self._expert_load_read
        load = self.expert_load()
        self._expert_load_read = None if load is None else ExpertLoadStats(
            tuple(load.layers), tuple(tuple(int(c) for c in row) for row in load.tokens_per_expert), load.top_k)
        self._expert_load_read_at = now
        return self._expert_load_read

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)


def _replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import dataclasses
    return dataclasses.replace(params, seed=seed)
