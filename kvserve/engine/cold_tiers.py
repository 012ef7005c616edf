"""The engine's side of the tiers below host RAM (disk, remote): what goes down, what comes up.

Down: every block the host tier receives is also written to the cold stores, once its bytes have
landed in host memory (a fence on the write stream, checked at the next steps without waiting)
and only if the host block still holds it then (a write-back dropped under back-pressure, or a host
block reused since, is skipped: a cold store never gets bytes that are not the block's). Writing
on arrival rather than on host eviction costs the same bytes (each block is written once, ever)
and is what lets a restarted server find blocks its host tier held.

Up: when a request arrives, its prompt's full blocks beyond what the GPU cache and the host tier
hold are looked up in the cold stores on a worker thread (`ColdTiers.prefetch`) while the request
is held out of the waiting queue. What comes back, chunk by chunk as it is read, is placed in
host-tier blocks at the next step (the copy overlaps the later chunks' reads), so the request's
lookup then finds it there and the host tier's own load path moves it to the GPU, overlapped with
other requests' steps. A request waits at most `kv_cold_max_wait` seconds; a read that would take
longer than recomputing those tokens (each store's measured read rate, once the stores holding the
blocks are known, against the measured prefill rate) is not started.

Identity: blocks are keyed and checked by the model fingerprint (its config, dtype, load format and
weight files' names, sizes and first and last MiB), the KV format, the block size and the namespace
(tenant or share group, plus cache_salt), so no other model, format or tenant can hit them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import xxhash

from kvserve.kvcache.host_tier import HostBlock, HostTier
from kvserve.kvcache.prefix_cache import chain_hashes, namespace_root
from kvserve.sched import phases
from kvserve.kvstore.cold_block import BlockIdentity
from kvserve.kvstore.cold_tier import ColdRead, ColdTiers
from kvserve.kvstore.disk_store import DiskStore

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.kvcache.manager import KVCacheManager
    from kvserve.kvstore.store import KVCacheStore
    from kvserve.sched.preemption_cost import PreemptionCost
    from kvserve.sched.request import Request
    from kvserve.sched.scheduler import Scheduler
    from kvserve.worker.kv_transfer import KVTransfers

logger = logging.getLogger(__name__)

_FINGERPRINT_PROBE = 1 << 20        # bytes hashed at each end of a weight file


def model_fingerprint(config: "EngineConfig", hf_config_dict: dict, path: str) -> str:
    """What decides whether stored KV fits this model: the model's config, the dtype, the load
    format (random weights differ from the checkpoint's), and the weight files (name, size and
    the first and last MiB of each: a changed checkpoint changes them, and hashing that much stays
    fast for hundreds of GB)."""
    model = config.model_config
    digest = xxhash.xxh3_128()
    digest.update(json.dumps(hf_config_dict, sort_keys=True, default=str).encode())
    digest.update(f"|{model.dtype}|{model.load_format}|{model.seed}|".encode())
    files = []
    if os.path.isdir(path):
        files = sorted(os.path.join(path, name) for name in os.listdir(path)
                       if name.endswith((".safetensors", ".bin", ".gguf", ".pt")))
    elif os.path.isfile(path):
        files = [path]
    if model.load_format != "dummy":
        for name in files:
            size = os.path.getsize(name)
            digest.update(f"{os.path.basename(name)}:{size}|".encode())
            with open(name, "rb") as f:
                digest.update(f.read(_FINGERPRINT_PROBE))
                if size > 2 * _FINGERPRINT_PROBE:
                    f.seek(size - _FINGERPRINT_PROBE)
                    digest.update(f.read(_FINGERPRINT_PROBE))
    return digest.hexdigest()[:24]


@dataclass
class _Held:
    request: "Request"
    deadline: float
    num_tokens: int


class ColdTierBridge:
    def __init__(self, tiers: ColdTiers, fingerprint: str, kv_format: str, block_size: int,
                 kv_manager: "KVCacheManager", host_tier: HostTier, host_store: "KVCacheStore",
                 transfers: "KVTransfers", scheduler: "Scheduler", max_wait_s: float,
                 preemption_cost: Optional["PreemptionCost"] = None) -> None:
        self.tiers = tiers
        self.fingerprint, self.kv_format, self.block_size = fingerprint, kv_format, block_size
        self.kv_manager, self.host_tier, self.host_store = kv_manager, host_tier, host_store
        self.transfers, self.scheduler = transfers, scheduler
        self.max_wait_s = max_wait_s
        self.preemption_cost = preemption_cost
        host_tier.record_writes = True
        self._held: dict[str, _Held] = {}
        # Host writes waiting for their bytes to land: (fence, blocks); blocks stored since the last step.
        self._landing: list[tuple[Optional[torch.cuda.Event], list[HostBlock]]] = []
        self.blocks_installed = self.prefetch_timeouts = 0
        self.hit_tokens: dict[str, int] = {}           # tier name -> prompt tokens it supplied

    # --- up: prefetch on arrival --------------------------------------------------------------------
    def admit(self, request: "Request") -> bool:
        """Starts the prefetch of the request's blocks that no upper tier holds; True when it did
        (the caller then adds the request held, `Scheduler.add_request(prefetching=True)`)."""
        hit = self.kv_manager.find_cached_prefix(request)
        first = hit.num_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size      # leave a token to compute
        if last <= first:
            return False
        num_tokens = (last - first) * self.block_size
        identities = self.identities(request.cache_namespace, request.prompt_token_ids, request.block_hashes,
                                     first, last)
        # The tiers weigh each store's measured read rate against this, once they know which
        # stores hold the blocks (a read slower than recomputing is not started).
        self.tiers.prefetch(request.request_id, identities, self._compute_seconds(num_tokens, first * self.block_size))
        self._held[request.request_id] = _Held(request, time.monotonic() + self.max_wait_s, num_tokens)
        return True

    def identities(self, namespace: str, token_ids: Sequence[int], hashes: Optional[Sequence[bytes]] = None,
                   first: int = 0, last: Optional[int] = None) -> list[BlockIdentity]:
        """What full blocks `first` .. `last` (default: all) of `token_ids` are stored as in the
        cold tiers; `hashes`: their chained hashes where known (computed otherwise)."""
        root = namespace_root(namespace)
        if hashes is None:
            hashes = chain_hashes(root, token_ids, self.block_size)
        last = len(hashes) if last is None else last
        bs = self.block_size
        return [BlockIdentity(self.fingerprint, self.kv_format, bs, namespace, hashes[index],
                              hashes[index - 1] if index else root, tuple(token_ids[index * bs:(index + 1) * bs]))
                for index in range(first, last)]

    def _compute_seconds(self, num_tokens: int, context_tokens: int) -> Optional[float]:
        """Computing these tokens after `context_tokens` cached ones, at the measured prefill rate
        (None before one is measured)."""
        return None if self.preemption_cost is None else self.preemption_cost.recompute_seconds(num_tokens, context_tokens)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def has_pending_writes(self) -> bool:
        """Host blocks not yet handed down (their copies queued, issued, or landing)."""
        return bool(self._landing) or self.host_tier.has_unhanded_blocks

    def step(self, wait: bool = False) -> None:
        """At the start of each engine step: places finished prefetches in the host tier and
        releases their requests (and those past their wait); copies landed host writes down.
        With `wait` (nothing else can run) it first waits for a prefetch, up to the nearest deadline."""
        if wait and self._held:
            timeout = max(0.0, min(h.deadline for h in self._held.values()) - time.monotonic())
            reads = self.tiers.wait(timeout)
        else:
            reads = self.tiers.poll()
        for read in reads:
            self._install(read)
        now = time.monotonic()
        for request_id in [rid for rid, held in self._held.items() if held.deadline <= now]:
            self.prefetch_timeouts += 1
            logger.info("request %s: its prefix did not come up from the cold KV tiers within %.1f s; computing it",
                        request_id, self.max_wait_s)
            self._release(request_id)
        self._persist_landed()

    def _install(self, read: ColdRead) -> None:
        if read.payloads:
            host_ids, payloads = [], []
            request = self.scheduler.requests.get(read.request_id)
            recorder = request.phases if request is not None else None
            for identity, payload, source in zip(read.identities, read.payloads, read.sources):
                host_id = self.host_tier.store(identity.block_hash, identity.parent_hash, identity.token_ids,
                                               identity.namespace, from_below=True)
                if host_id is None:
                    continue                # already there (another request brought it), or no room
                host_ids.append(host_id)
                payloads.append(payload)
                self.hit_tokens[source] = self.hit_tokens.get(source, 0) + self.block_size
                if recorder is not None:
                    recorder.annotate(phases.KV_PREFETCH, **{f"{source}_blocks": 1, f"{source}_bytes": len(payload)})
            if host_ids:
                # A host block just taken may be the target of a copy still in flight.
                self.transfers.synchronize()
                self.host_store.write_block_bytes(host_ids, payloads)
                self.blocks_installed += len(host_ids)
        if read.final:
            self._release(read.request_id)

    def prefetch_outcomes(self) -> dict[str, int]:
        tiers = self.tiers
        return {"found": tiers.prefetch_hits,
                "missed": tiers.prefetches_done - tiers.prefetch_hits - tiers.prefetches_skipped,
                "timed_out": self.prefetch_timeouts, "skipped": tiers.prefetches_skipped}

    def _release(self, request_id: str) -> None:
        if self._held.pop(request_id, None) is not None:
            self.scheduler.end_prefetch(request_id)

    def forget(self, request_id: str) -> None:
        """An aborted request: nothing to release (its read's result is still placed when it comes)."""
        self._held.pop(request_id, None)

    # --- down: landed host writes ---------------------------------------------------------------
    def _persist_landed(self) -> None:
        # Their copies were issued with an earlier step's copies: a fence now covers them.
        new = self.host_tier.take_issued_blocks()
        if new:
            self._landing.append((self.transfers.fence(), new))
        still = []
        ready: list[HostBlock] = []
        for fence, blocks in self._landing:
            if fence is not None and not fence.query():
                still.append((fence, blocks))
            else:
                ready += [b for b in blocks if self.host_tier.holds_at(b.host_id, b.block_hash)]
        self._landing = still
        if not ready:
            return
        index = torch.tensor([b.host_id for b in ready], dtype=torch.long, device=self.host_store.device)
        data = self.host_store.gather_bytes(index).cpu().numpy()
        self.tiers.persist([(BlockIdentity(self.fingerprint, self.kv_format, self.block_size, b.namespace,
                                           b.block_hash, b.parent_hash, b.token_ids), memoryview(data[i]))
                            for i, b in enumerate(ready)])

    def close(self) -> None:
        """Hands what has landed down and waits for the writes (`Engine.flush_tiers` first issues
        the copies still queued)."""
        self.transfers.synchronize()
        self._persist_landed()
        self._landing = [(None, blocks) for _, blocks in self._landing]     # landed: synchronized
        self._persist_landed()
        self.tiers.close()


def build_cold_tiers(config: "EngineConfig", payload_nbytes: int) -> Optional[ColdTiers]:
    """The configured stores (disk, then remote), or None when neither is set."""
    cache = config.cache_config
    stores = []
    if cache.kv_disk_path:
        stores.append(DiskStore(cache.kv_disk_path, cache.kv_disk_size))
    if cache.kv_remote_url:
        from kvserve.kvstore.redis_store import RedisStore
        stores.append(RedisStore(cache.kv_remote_url, ttl_s=cache.kv_remote_ttl,
                                 tenant_quota_bytes=cache.kv_remote_tenant_quota))
    return ColdTiers(stores, payload_nbytes) if stores else None
