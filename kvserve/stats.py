"""Stats as data: what the engine's parts report about themselves, as frozen dataclasses.

Each owner builds its own (`KVCacheManager.make_stats`, `PrefixCache.make_stats`,
`SLOController.make_stats`, `Scheduler.make_stats`, `Engine.make_stats`) on the engine thread;
readers on other threads (the server's metrics, a dashboard, a trace) read only these, never the
owners. A leaf module, so that every layer can return them; adding a metric is adding a field here
and a line in its owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class StepCoefficients:
    fixed_s: float
    per_token_s: float
    per_sequence_s: float

    def seconds(self, num_tokens: int, num_sequences: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens + self.per_sequence_s * num_sequences


@dataclass(frozen=True)
class HostTierStats:
    """The host KV tier (--kv-host-memory; kvcache/host_tier.py). Counts are totals since start."""
    num_blocks: int              # live blocks (memory pressure may have released some)
    used_blocks: int             # host blocks holding a cached block
    hit_tokens: int              # prompt tokens served from the host (loaded, not recomputed)
    blocks_written: int          # GPU blocks copied to the host when the GPU cache evicted them
    blocks_loaded: int           # host blocks copied back into GPU blocks
    blocks_evicted: int          # host blocks reused for newer ones
    writes_dropped: int          # write-backs skipped: every host block was being read that step
    swapped_out: int = 0         # preempted requests whose blocks went to the host (--preemption-mode swap)
    swapped_in: int = 0          # of those, resumed from the host
    swap_failures: int = 0       # preemptions that recomputed: the host tier had no room for the blocks
    load_failures: int = 0       # loads or swaps whose copy failed: the request recomputed
    max_blocks: int = 0          # the configured size; num_blocks is less while memory pressure holds it down
    blocks_released: int = 0     # cached blocks dropped because memory pressure gave their memory back
    loads_joined: int = 0        # requests whose hit reached blocks another request was loading: they waited
                                 # for those to land and be published (a GPU hit) instead of loading them again


@dataclass(frozen=True)
class ColdStoreStats:
    """One KV tier below the host (disk or remote; kvserve/kvstore/cold_store.py). Totals since start."""
    name: str                    # "disk" or "remote"
    available: bool              # False while the store is unreachable (remote down) or stopped writing (disk full)
    entries: int                 # blocks it holds (as far as this process knows)
    used_bytes: int
    capacity_bytes: int          # 0: bounded by the store itself (a remote server's maxmemory)
    hits: int = 0                # values found and read (before their checks: see corrupt)
    misses: int = 0              # blocks looked up and not found
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    writes_dropped: int = 0      # not written: queue full, store full, tenant quota reached, store down
    evictions: int = 0           # blocks this process removed to stay under the size cap
    corrupt: int = 0             # entries that failed their checks (checksum, header, identity): misses, removed
    errors: int = 0              # I/O or connection errors (each a miss or a dropped write)


@dataclass(frozen=True)
class TransferStats:
    """Block copies between the GPU and its tiers (kvserve/worker/kv_transfer.py), totals since start."""
    bytes_to_device: int
    bytes_to_host: int
    loads: int                   # loads and swap-ins that landed
    load_seconds: float          # their summed transfer time (CUDA events on a GPU)
    load_buckets: tuple[tuple[float, int], ...]    # (upper bound in seconds, loads in that bucket alone)
    write_back_blocks_dropped: int   # blocks not written back under back-pressure (too many write-back bytes in flight)
    copy_failures: int           # copies that raised: a load recomputes, a write-back is forgotten
    loads_by_copy_engine: int = 0    # loads issued as memcpys + scatters where the block-copy kernel runs
    loads_inline: int = 0        # loads issued inline in their request's step (BlockCopy.inline), landed or not


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    usage: float                 # fraction of blocks in use (held by requests or cached)
    capacity_tokens: int         # num_blocks x block_size: what the cache holds in tokens
    host: Optional[HostTierStats] = None     # None: no host tier
    transfers: Optional[TransferStats] = None   # None: no host tier
    cold: tuple[ColdStoreStats, ...] = ()       # the tiers below the host, in lookup order
    cold_writes_dropped: int = 0                # blocks not sent down: the write queue was full
    cold_hit_tokens: dict[str, int] = field(default_factory=dict)   # tier -> prompt tokens it supplied (checked)
    # Prefetches on arrival by outcome: found (some blocks came up), missed (none), timed_out (the
    # request stopped waiting), skipped (reading measured slower than computing).
    cold_prefetches: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AdaptivePolicyStats:
    """The adaptive eviction policy's state (kvcache/policies/adaptive.py)."""
    active: str                                       # the arm in force
    num_switches: int
    shadow_hit_rates: dict[str, float]                # discounted, per arm label
    recent_decisions: tuple[str, ...] = ()


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache (kvcache/prefix_cache.py); policy "off" when prefix caching is off."""
    policy: str                                       # configured policy name
    active_policy: str                                # the ranking in force (adaptive: the chosen arm)
    lookups: int = 0
    query_tokens: int = 0                             # prompt tokens looked up
    hit_tokens: int = 0                               # of those, served from the cache
    cached_blocks: int = 0                            # blocks addressable by prefix hash
    evictable_blocks: int = 0                         # cached blocks no request holds
    pinned_blocks: int = 0                            # cached blocks under an active pin
    num_pins: int = 0
    evictions: dict[str, int] = field(default_factory=dict)     # by the policy that chose them
    adaptive: Optional[AdaptivePolicyStats] = None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True)
class ExpertLoadStats:
    """Token-expert assignments per MoE layer since the last reset (each token counts once for each
    of its top-k experts; model/moe.py)."""
    layers: tuple[int, ...]                           # decoder layer index of each MoE layer
    tokens_per_expert: tuple[tuple[int, ...], ...]    # per MoE layer, per expert
    top_k: int = 1

    @property
    def num_experts(self) -> int:
        return len(self.tokens_per_expert[0]) if self.tokens_per_expert else 0

    def as_dict(self) -> dict:
        return {"layers": list(self.layers), "top_k": self.top_k,
                "tokens_per_expert": [list(c) for c in self.tokens_per_expert],
                "imbalance_max_over_mean": list(self.imbalance())}

    def imbalance(self) -> tuple[float, ...]:
        """Per layer: the busiest expert's load over the mean load (1.0 = perfectly even; 0.0 before
        any token). Under expert parallelism the busiest expert sets the step time."""
        return tuple(round(max(counts) * len(counts) / sum(counts), 4) if sum(counts) else 0.0
                     for counts in self.tokens_per_expert)


@dataclass(frozen=True)
class LatencyTargetStats:
    """The latency controls (--slo-ttft / --slo-tpot; sched/slo.py)."""
    max_running: int                                  # the running limit the TPOT target sets
    step_time_s: Optional[float]                      # the smoothed step time it is held by
    rejected_at_arrival: int                          # shed on arrival by the engine (the server adds its own)
    rejected_in_queue: int                            # shed at their deadline in the queue
    step_cost: Optional[StepCoefficients]             # the step-cost model (None before any data)
    step_token_budget: int                            # tokens the next step may hold
    ttft_target_s: Optional[float] = None             # the targets themselves (None: not set)
    tpot_target_s: Optional[float] = None


@dataclass(frozen=True)
class ClassLatencyStats:
    """One request class (sched/qos_classes.py): its targets, measured p99s and counts since start."""
    name: str
    priority: int
    ttft_target_s: Optional[float]
    tpot_target_s: Optional[float]
    ttft_p99_s: Optional[float]          # None: too few samples in the window
    tpot_p99_s: Optional[float]
    requests_finished: int
    requests_shed: int
    requests_met: int                    # finished within both targets
    holding_lower_classes: bool          # it misses a target with work pending: lower classes wait
    kv_reserved_blocks: int = 0          # its KV reservation (--qos-config; 0: none)
    kv_blocks: int = 0                   # GPU blocks its running and loading requests hold


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's requests that have left the engine, since start (Engine.make_stats; the tenant
    None: requests without one). Counted per request, as its response's usage reports it."""
    requests: dict[str, int] = field(default_factory=dict)   # by finish reason
    prompt_tokens: int = 0          # once per request: its samples share the prompt
    cached_prompt_tokens: int = 0   # of those, whose KV came from the prefix cache or a KV tier
    generation_tokens: int = 0      # summed over the request's samples, as the engine generated them

    def plus(self, reason: str, prompt_tokens: int, cached_prompt_tokens: int,
             generation_tokens: int) -> "TenantUsage":
        """These totals with one more request that left for `reason`."""
        return TenantUsage({**self.requests, reason: self.requests.get(reason, 0) + 1},
                           self.prompt_tokens + prompt_tokens, self.cached_prompt_tokens + cached_prompt_tokens,
                           self.generation_tokens + generation_tokens)

    def merged(self, other: "TenantUsage") -> "TenantUsage":
        """Both tenants' totals in one (tenants that share a metrics label)."""
        requests = dict(self.requests)
        for reason, count in other.requests.items():
            requests[reason] = requests.get(reason, 0) + count
        return TenantUsage(requests, self.prompt_tokens + other.prompt_tokens,
                           self.cached_prompt_tokens + other.cached_prompt_tokens,
                           self.generation_tokens + other.generation_tokens)


def tenant_sort_key(tenant: Optional[str]) -> tuple[bool, str]:
    """Per-tenant listings' order: no tenant first, then by name."""
    return tenant is not None, tenant or ""


@dataclass(frozen=True)
class TenantShareStats:
    """One tenant's fair-share state (--scheduling-policy fair; sched/fair_share.py)."""
    weight: float
    counter: float     # the virtual token counter: served over the weight, lifted when it comes back from idle
    served: float      # weighted tokens served: a prompt token 1, a generated token 2


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions_total: int
    latency: Optional[LatencyTargetStats] = None      # None without latency targets
    num_loading: int = 0         # admitted, waiting for their KV to arrive from a tier
    # GPU KV blocks held by each tenant's running and loading requests (None: requests without one).
    kv_blocks_by_tenant: dict[Optional[str], int] = field(default_factory=dict)
    classes: tuple[ClassLatencyStats, ...] = ()       # request classes (--qos-config), by name
    # Tenants with a KV quota (--qos-config): (GPU blocks resident, running plus cached; the quota).
    kv_quotas: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class PressStats:
    """One press's counts since start (engine/press_control.py): requests it pruned, those it left
    whole (too short, or keeping everything), KV tokens removed (per layer and head: each head drops
    the same count) and blocks given back to the pool; in tier mode, KV tokens demoted to the host
    tier and recalled from it (engine/kv_tiering.py)."""
    press: str
    applied: int
    skipped: int
    tokens_pruned: int
    blocks_freed: int
    tokens_demoted: int = 0
    tokens_recalled: int = 0


@dataclass(frozen=True)
class ConfigEvent:
    """A change of the engine's configuration at run time: an operator's (the admin config API,
    server/admin_config.py) or the engine's own (the adaptive eviction policy switching arms, a
    retuning loop). The dashboard and the log show them; /metrics counts them by field."""
    time: float                  # time.time() (wall clock: the page shows it to people)
    source: str                  # "admin" (the config API), "adaptive" (the eviction policy), "auto" (retuning)
    field: str                   # the option that changed, by its flag's field name (e.g. "eviction_policy")
    old: str                     # its value before, as text
    new: str                     # and after


@dataclass(frozen=True)
class RuntimeConfigStats:
    """The settings the admin config API may change (engine/runtime_config.py), as they are now, and
    how often each changed since start (config_events keeps only the latest changes)."""
    # Numeric settings by field ("qos_classes.<class>.<target>" for a class's targets); unset ones absent.
    values: dict[str, float] = field(default_factory=dict)
    choices: dict[str, str] = field(default_factory=dict)    # named settings (eviction_policy, kv_press, ...)
    changes: dict[str, dict[str, int]] = field(default_factory=dict)   # field -> source -> changes since start


@dataclass(frozen=True)
class BandwidthStats:
    """What engine steps read from memory against what the memory can deliver (obs/bandwidth.py):
    weights (by dtype) plus the KV the attention read (by format), over each step's time."""
    peak_bytes_per_s: float      # the machine's copy bandwidth, measured once at start
    peak_source: str             # how it was measured (e.g. "cuda copy 1 GiB", "cpu copy 256 MiB")
    steps: int                   # steps measured since start
    bytes_read_total: int        # weights + KV bytes those steps read
    weight_bytes_per_step: int   # the weights one forward reads (every layer's, the active experts' for MoE)
    last_bytes_read: int         # the latest step's bytes
    last_step_s: float           # and its time
    recent_utilization: float    # over the steps of the last second: their bytes / their time / peak_bytes_per_s
    # (upper bound, steps in that bucket alone) of per-step utilization since start
    utilization_buckets: tuple[tuple[float, int], ...] = ()
    utilization_sum: float = 0.0  # summed per-step utilization (the histogram's _sum)
    seconds_total: float = 0.0   # the measured steps' summed time (bytes_read_total over it: the mean rate)


@dataclass(frozen=True)
class EngineStats:
    scheduler: SchedulerStats
    kv_cache: KVCacheStats
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: dict[str, int] = field(default_factory=dict)   # by finish reason
    prefix_cache: Optional[PrefixCacheStats] = None   # None: an engine without a prefix-cache control
    expert_load: Optional[ExpertLoadStats] = None     # None: a model without MoE layers
    presses: tuple[PressStats, ...] = ()              # one per press that has run
    decode_kv_bytes_total: int = 0                    # KV bytes decode attention read (engine.EngineCounters)
    tenant_usage: dict[Optional[str], TenantUsage] = field(default_factory=dict)   # per tenant seen since start
    fair_share: Optional[dict[Optional[str], TenantShareStats]] = None   # None: not the fair policy
    bandwidth: Optional[BandwidthStats] = None        # None: before the first measured step
    config_events: tuple[ConfigEvent, ...] = ()       # the latest run-time config changes, oldest first (bounded)
    runtime_config: Optional[RuntimeConfigStats] = None   # None: an engine without run-time reconfiguration


# --- the KV map (Engine.make_kv_map; the dashboard draws it: server/dashboard.py) ------------------
# What a block of a tier can be doing; KVMapTier.states holds indices into this tuple.
KV_BLOCK_STATES = (
    "free",        # empty: no request holds it and it keeps no KV worth finding
    "running",     # held by a running request, private to it (not in the prefix cache)
    "shared",      # held by running requests and in the prefix cache (others may hit it)
    "loading",     # held by a request that waits for its KV to be copied in from a tier (not its prefix hits)
    "cached",      # no request holds it; the prefix cache keeps it until its policy evicts it
    "pinned",      # in the prefix cache under an active pin (evicted after every unpinned block)
    "held",        # host tier: held outside the index for a swapped-out or tiered request
    "offline",     # host tier: above the size memory pressure holds it to (memory given back)
)


@dataclass(frozen=True)
class KVMapTier:
    """One tier's blocks as a grid of at most `max_cells` cells: with more blocks than that, each
    cell stands for `blocks_per_cell` consecutive blocks (its majority state, the request and tenant
    of the first block in that state, the hottest block's heat; on the host, the heat of that
    first block), so the payload is bounded whatever the pool's size."""
    name: str                    # "gpu" or "host"
    num_blocks: int              # blocks of the tier (the host's configured size)
    blocks_per_cell: int         # consecutive blocks each cell stands for (1: a cell a block)
    states: tuple[int, ...]      # per cell: index into KV_BLOCK_STATES
    requests: tuple[int, ...]    # per cell: index into KVMapSnapshot.requests of a holder (-1: none, or not listed)
    tenants: tuple[int, ...]     # per cell: index into KVMapSnapshot.tenants (-1: a free cell, or none known)
    heat: tuple[int, ...]        # per cell: 0-100, recent uses u as 100 u / (u + 1) (the page's heat colours)
    state_counts: tuple[int, ...]   # exact blocks per state of KV_BLOCK_STATES (cells round)
    kv_format: str               # the format its blocks are stored in (KVCacheSpec.describe())


@dataclass(frozen=True)
class KVMapRequest:
    """A request in the engine and the KV it holds (Scheduler.make_request_map)."""
    request_id: str
    state: str                   # "running", "loading" (KV coming from a tier), "waiting", "swapped", "prefetching"
    tenant: Optional[str]
    qos_class: Optional[str]
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_kv_tokens: int           # tokens its KV holds now (computed less those a press removed)
    num_cached_tokens: int       # prompt tokens served from a cache at admission (0: none, or not admitted)
    gpu_blocks: int              # GPU blocks in its table, shared ones included
    host_blocks: int             # host blocks held for it (swapped out, or tiered KV)
    arrival_time: float          # time.monotonic() (KVMapSnapshot.monotonic_time gives the age)


@dataclass(frozen=True)
class PrefixTreeNode:
    """A run of cached blocks of a prefix tree in which no block branches (a segment)."""
    parent: int                  # index of the parent segment in PrefixTree.nodes (-1: the tree's root)
    depth: int                   # chain index of its first block
    num_blocks: int
    hits: int                    # uses of its first block (every use of the segment uses it)
    pinned_blocks: int
    held_blocks: int             # of its blocks, those running requests hold now
    last_use: Optional[float]    # the prefix cache's clock (time.monotonic()) at its newest use (None: never)


@dataclass(frozen=True)
class PrefixTree:
    """Cached blocks that continue one another (PrefixCache.make_prefix_trees): a system prompt
    and the conversations on it. A root is a block whose parent is not cached."""
    tenant: Optional[str]        # the namespace's tenant or share group (None: requests without a tenant)
    num_blocks: int
    max_depth: int               # chain index of its deepest block
    num_branches: int            # blocks continued by more than one cached block
    hits: int                    # uses of its root block
    pinned_blocks: int
    held_blocks: int
    nodes: tuple[PrefixTreeNode, ...]   # its segments, parents first, the largest subtrees when bounded
    num_nodes: int               # segments it has (more than `nodes` when bounded)


@dataclass(frozen=True)
class KVMapPin:
    """An active pin (PrefixCache.pin)."""
    pin_id: int
    tenant: Optional[str]
    num_blocks: int
    num_cached_blocks: int       # of those, cached on the GPU now
    expires_in_s: float


@dataclass(frozen=True)
class KVMapSnapshot:
    """What the KV cache holds, block by block and bounded (Engine.make_kv_map), made on the engine
    thread between steps when a reader asks. The gauges (hit rates, evictions, loads) travel in
    EngineSnapshot; this is the per-block picture they summarise."""
    time: float                  # time.time() when made (the page shows it)
    monotonic_time: float        # time.monotonic() then: ages of KVMapRequest / PrefixTreeNode times
    block_size: int              # tokens per block
    kv_bytes_per_block: int      # bytes a block takes in its format (footprints in bytes)
    eviction_policy: str         # the prefix cache's ranking in force ("off": no prefix caching)
    tiers: tuple[KVMapTier, ...]             # "gpu" first, then "host" when there is one
    tenants: tuple[Optional[str], ...]       # what KVMapTier.tenants index (None: no tenant)
    requests: tuple[KVMapRequest, ...]       # what KVMapTier.requests index: running and loading, then waiting
    num_requests: int                        # requests in the engine (more than listed when bounded)
    # The largest, by blocks (None: not made this time; a reader that polls asks for them less often).
    prefix_trees: Optional[tuple[PrefixTree, ...]]
    num_prefix_trees: int
    pins: tuple[KVMapPin, ...] = ()
    build_seconds: float = 0.0   # what making it took the engine thread: readers pace their polling by it

    def as_dict(self) -> dict:
        """Plain JSON-ready data (what the engine clients return and the dashboard's events carry)."""
        return {"time": self.time, "monotonic_time": self.monotonic_time, "block_size": self.block_size,
                "kv_bytes_per_block": self.kv_bytes_per_block, "eviction_policy": self.eviction_policy,
                "block_states": list(KV_BLOCK_STATES),
                "tiers": [{"name": t.name, "num_blocks": t.num_blocks, "blocks_per_cell": t.blocks_per_cell,
                           "states": list(t.states), "requests": list(t.requests), "tenants": list(t.tenants),
                           "heat": list(t.heat), "state_counts": dict(zip(KV_BLOCK_STATES, t.state_counts)),
                           "kv_format": t.kv_format} for t in self.tiers],
                "tenants": list(self.tenants),
                "requests": [_fields(r) for r in self.requests], "num_requests": self.num_requests,
                "prefix_trees": None if self.prefix_trees is None else [
                    {**_fields(t, skip="nodes"), "nodes": [_fields(n) for n in t.nodes]} for t in self.prefix_trees],
                "num_prefix_trees": self.num_prefix_trees, "pins": [_fields(p) for p in self.pins],
                "build_seconds": self.build_seconds}


def _fields(obj, skip: str = "") -> dict:
    """A flat dataclass's fields as a dict (dataclasses.asdict copies deeply, which these need not)."""
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__ if name != skip}
