"""GET /v1/usage: the operator's summary per tenant (docs/qos.md#usage-per-tenant-get-v1usage).

Everything comes from the engine's snapshot, the totals /metrics also shows, so both always
agree; here without the label cap of /metrics, every tenant under its own name (null: requests
without a tenant). Through the engine core process the snapshot is the core's, the same in
every front end.
"""

from __future__ import annotations

from typing import Any, Optional

from kvserve.engine.client import EngineSnapshot
from kvserve.stats import TenantShareStats, TenantUsage, tenant_sort_key


def usage_summary(snapshot: EngineSnapshot) -> dict[str, Any]:
    fair = snapshot.fair_share
    tenants = set(snapshot.tenant_usage) | set(snapshot.kv_blocks_by_tenant) | set(snapshot.kv_quotas) | set(fair or ())
    rows = []
    for tenant in sorted(tenants, key=tenant_sort_key):
        usage = snapshot.tenant_usage.get(tenant, TenantUsage())
        row: dict[str, Any] = {
            "tenant": tenant, "requests": dict(sorted(usage.requests.items())),
            "prompt_tokens": usage.prompt_tokens, "cached_prompt_tokens": usage.cached_prompt_tokens,
            "generation_tokens": usage.generation_tokens,
            "kv_blocks": snapshot.kv_blocks_by_tenant.get(tenant, 0)}
        if tenant in snapshot.kv_quotas:
            row["kv_resident_blocks"], row["kv_quota_blocks"] = snapshot.kv_quotas[tenant]
        if fair is not None:
            row["fair_share"] = _share(fair.get(tenant))
        rows.append(row)
    return {"object": "usage", "kv_blocks_total": snapshot.num_blocks, "data": rows}


def _share(share: Optional[TenantShareStats]) -> Optional[dict[str, float]]:
    """A tenant the fair policy has not seen yet (its requests were all refused before admission): null."""
    if share is None:
        return None
    return {"weight": share.weight, "virtual_token_counter": share.counter, "served_weighted_tokens": share.served}
