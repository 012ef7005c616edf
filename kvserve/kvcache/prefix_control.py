"""The engine's handle on prefix caching: namespaces (tenant isolation), pins, stats.

The engine builds one `PrefixControl` beside its KV manager. It maps a request's tenant and
cache_salt to the namespace its blocks are cached in, pins and unpins prefixes on behalf of a
tenant (a tenant sees and removes only its own pins), and makes the prefix cache's
`PrefixCacheStats` for `Engine.make_stats` (which /metrics reads through the engine's snapshot).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.policies import EvictionPolicy
from kvserve.kvcache.prefix_cache import make_namespace, parse_share_groups
from kvserve.stats import PrefixCacheStats


@dataclass(frozen=True)
class PinInfo:
    pin_id: int
    num_tokens: int                     # tokens covered (whole blocks)
    num_blocks: int
    num_cached_blocks: int              # of those, cached right now
    expires_in_s: float

    def as_dict(self) -> dict:
        return {"id": self.pin_id, "object": "prefix_pin", "num_tokens": self.num_tokens,
                "num_blocks": self.num_blocks, "num_cached_blocks": self.num_cached_blocks,
                "expires_in": round(self.expires_in_s, 3), "expires_at": round(time.time() + self.expires_in_s, 3)}


class PrefixControl:
    def __init__(self, kv_manager: KVCacheManager, policy_name: str, sharing: str = "tenant",
                 share_groups: Optional[str] = None) -> None:
        self.kv_manager = kv_manager
        self.cache = kv_manager.prefix_cache
        self.policy_name = policy_name if self.cache is not None else "off"
        self.sharing = sharing
        self.share_groups = parse_share_groups(share_groups)

    @property
    def enabled(self) -> bool:
        return self.cache is not None

    def namespace(self, tenant: Optional[str], cache_salt: Optional[str]) -> str:
        return make_namespace(tenant, cache_salt, self.sharing, self.share_groups)

    def _owns(self, tenant: Optional[str], namespace: str) -> bool:
        scope = self.namespace(tenant, None)
        return namespace == scope or namespace.startswith(scope + "\0salt:")

    def pin(self, token_ids: Sequence[int], ttl_s: float, tenant: Optional[str] = None,
            cache_salt: Optional[str] = None) -> PinInfo:
        """Pins the full blocks of `token_ids`; raises ValueError (caching off, no full block,
        bad ttl, or over the pinned-blocks limit)."""
        if not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise ValueError(f"pin ttl must be a positive number of seconds, got {ttl_s!r}")
        pin, cached = self.kv_manager.pin_prefix(token_ids, self.namespace(tenant, cache_salt), float(ttl_s))
        block_size = self.kv_manager.block_size
        return PinInfo(pin.pin_id, len(pin.block_hashes) * block_size, len(pin.block_hashes), cached,
                       pin.expires_at - self.cache.clock())

    def unpin(self, pin_id: int, tenant: Optional[str] = None) -> bool:
        if self.cache is None:
            return False
        pin = next((p for p in self.cache.pins() if p.pin_id == pin_id), None)
        if pin is None or not self._owns(tenant, pin.namespace):
            return False
        self.cache.unpin(pin_id)
        return True

    def pins(self, tenant: Optional[str] = None) -> list[PinInfo]:
        if self.cache is None:
            return []
        now, block_size = self.cache.clock(), self.kv_manager.block_size
        return [PinInfo(p.pin_id, len(p.block_hashes) * block_size, len(p.block_hashes),
                        self.cache.num_cached_of(p.block_hashes), p.expires_at - now)
                for p in self.cache.pins() if self._owns(tenant, p.namespace)]

    def set_policy(self, policy_name: str, policy: EvictionPolicy) -> None:
        """The eviction policy changed at run time (the admin config API): the cache ranks by
        `policy` from now on, and the stats name it."""
        if self.cache is None:
            raise ValueError("eviction_policy: prefix caching is off (--no-prefix-caching), so no eviction "
                             "policy runs")
        self.cache.set_policy(policy)
        self.policy_name = policy_name

    def make_stats(self) -> PrefixCacheStats:
        if self.cache is None:
            return PrefixCacheStats("off", "off")
        return self.cache.make_stats(self.policy_name)

    @property
    def stats(self) -> PrefixCacheStats:
        """The stats now (engine thread); other threads read them from the engine's snapshot."""
        return self.make_stats()
