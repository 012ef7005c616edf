"""The QoS config file (`--qos-config qos.yaml|qos.json`): request classes with their latency
targets (kvserve/sched/qos_classes.py), and per tenant a scheduling weight for the fair-share policy
(kvserve/sched/fair_share.py), a default class and the classes it may use. Read and checked once at
start: an unknown key or class, a class without targets, a weight that is not a positive number,
or a file that does not parse is a ValueError naming it.

    classes:
      gold:   {priority: 0, ttft_p99: 1.0, tpot_p99: 0.1, on_miss: shed, kv_reservation_fraction: 0.2}
      silver: {priority: 1, ttft_p99: 4.0, on_miss: shed}
      bronze: {priority: 2, ttft_p99: 60}        # on_miss: queue (the default)
    default_class: bronze  # requests that name none, of tenants without a default
    tenants:
      alice: {weight: 3, default_class: gold}
      bob: {weight: 1, classes: [silver, bronze]}  # the classes bob's requests may name
      carol: {kv_quota_fraction: 0.25}             # at most a quarter of the GPU KV blocks resident
      dave: {kv_quota_blocks: 2048}                # or a number of blocks
    default_weight: 1      # tenants not listed, and requests without a tenant
"""

from __future__ import annotations

import json
import os
from typing import Optional

import msgspec


SHED, QUEUE = "shed", "queue"


class QoSClassForbidden(ValueError):
    """A request names a class its tenant may not use (HTTP 403)."""


class QoSClass(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A request class: its scheduling priority (lower first, as the `priority` field) and the p99
    latency targets its requests are held to. `on_miss`: shed (503 for a request that cannot get
    its first token in time) or queue (served late)."""
    priority: int = 0
    ttft_p99: Optional[float] = None
    tpot_p99: Optional[float] = None
    on_miss: str = QUEUE
    # GPU KV blocks no other class may take while this class has work (kvserve/sched/kv_reservations.py),
    # as a count or a fraction of the pool.
    kv_reservation_blocks: Optional[int] = None
    kv_reservation_fraction: Optional[float] = None


class TenantPolicy(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    weight: float = 1.0
    default_class: Optional[str] = None
    classes: Optional[list[str]] = None       # the classes it may name; None: any
    # Its KV quota: GPU blocks resident at once, running plus cached prefixes (kvcache/manager.py),
    # as a count or a fraction of the pool; none: no quota.
    kv_quota_blocks: Optional[int] = None
    kv_quota_fraction: Optional[float] = None


class QoSConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    classes: dict[str, QoSClass] = {}
    default_class: Optional[str] = None
    tenants: dict[str, TenantPolicy] = {}
    default_weight: float = 1.0

    def kv_quotas(self, num_blocks: int) -> dict[str, int]:
        """Tenant -> the GPU KV blocks it may hold, for a pool of `num_blocks` (tenants with a quota)."""
        return _blocks_by_name({tenant: (policy.kv_quota_blocks, policy.kv_quota_fraction)
                                for tenant, policy in self.tenants.items()}, num_blocks)

    def kv_reservations(self, num_blocks: int) -> dict[str, int]:
        """Class -> the GPU KV blocks reserved for it, for a pool of `num_blocks` (classes with one)."""
        return _blocks_by_name({name: (cls.kv_reservation_blocks, cls.kv_reservation_fraction)
                                for name, cls in self.classes.items()}, num_blocks)

    def weight_of(self, tenant: Optional[str]) -> float:
        policy = self.tenants.get(tenant) if tenant is not None else None
        return policy.weight if policy is not None else self.default_weight

    def class_for(self, tenant: Optional[str], requested: Optional[str]) -> Optional[str]:
        """The class a request runs in: the one it names, else its tenant's default, else the
        config's; None without classes. ValueError (the first word is the field) for a class not
        in the config, QoSClassForbidden for one its tenant may not use."""
        policy = self.tenants.get(tenant) if tenant is not None else None
        if requested is None:
            return policy.default_class if policy is not None and policy.default_class else self.default_class
        if requested not in self.classes:
            known = ", ".join(sorted(self.classes)) if self.classes else "none are configured (--qos-config)"
            raise ValueError(f"qos_class {requested!r} is not a class; classes: {known}")
        if policy is not None and policy.classes is not None and requested not in policy.classes:
            raise QoSClassForbidden(f"qos_class {requested!r} is not open to tenant {tenant!r} "
                                    f"(its classes: {', '.join(policy.classes)})")
        return requested


def _blocks_by_name(given: dict[str, tuple[Optional[int], Optional[float]]], num_blocks: int) -> dict[str, int]:
    """Name -> blocks, from a count or a fraction of the pool (at least 1); names with neither left out."""
    blocks = {}
    for name, (count, fraction) in given.items():
        if count is not None:
            blocks[name] = count
        elif fraction is not None:
            blocks[name] = max(1, int(fraction * num_blocks))
    return blocks


def load_qos_config(path: Optional[str]) -> QoSConfig:
    if not path:
        return QoSConfig()
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--qos-config {path}: cannot read it ({exc.strerror})") from None
    try:
        if os.path.splitext(path)[1].lower() in (".yaml", ".yml"):
            import yaml
            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
    except Exception as exc:
        raise ValueError(f"--qos-config {path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'} "
                         f"({exc})") from None
    try:
        config = msgspec.convert(raw if raw is not None else {}, QoSConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--qos-config {path}: {exc}") from None
    _check_classes(path, config)
    for name, weight in [("default_weight", config.default_weight)] + [
            (f"tenants.{tenant}.weight", policy.weight) for tenant, policy in config.tenants.items()]:
        if not weight > 0:
            raise ValueError(f"--qos-config {path}: {name} must be a positive number, got {weight}")
    for tenant, policy in config.tenants.items():
        where = f"--qos-config {path}: tenants.{tenant}"
        if policy.kv_quota_blocks is not None and policy.kv_quota_fraction is not None:
            raise ValueError(f"{where} has both kv_quota_blocks and kv_quota_fraction; give one")
        if policy.kv_quota_blocks is not None and policy.kv_quota_blocks < 1:
            raise ValueError(f"{where}.kv_quota_blocks must be at least 1, got {policy.kv_quota_blocks}")
        if policy.kv_quota_fraction is not None and not 0 < policy.kv_quota_fraction <= 1:
            raise ValueError(f"{where}.kv_quota_fraction must be in (0, 1], got {policy.kv_quota_fraction}")
    return config


def check_class(where: str, cls: QoSClass) -> None:
    """One class's rules, at start (`where` = "--qos-config FILE: classes.NAME") and when the admin
    config API changes its targets ("qos_classes.NAME"): a ValueError naming the field otherwise."""
    if cls.ttft_p99 is None and cls.tpot_p99 is None:
        raise ValueError(f"{where} has no target (ttft_p99 or tpot_p99)")
    for field, value in (("ttft_p99", cls.ttft_p99), ("tpot_p99", cls.tpot_p99)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{where}.{field} must be a positive number of seconds, got {value}")
    if cls.on_miss not in (SHED, QUEUE):
        raise ValueError(f"{where}.on_miss must be {SHED} or {QUEUE}, got {cls.on_miss!r}")
    if cls.on_miss == SHED and cls.ttft_p99 is None:
        raise ValueError(f"{where} sheds (on_miss: shed) but has no ttft_p99")
    if cls.kv_reservation_blocks is not None and cls.kv_reservation_fraction is not None:
        raise ValueError(f"{where} has both kv_reservation_blocks and kv_reservation_fraction; give one")
    if cls.kv_reservation_blocks is not None and cls.kv_reservation_blocks < 1:
        raise ValueError(f"{where}.kv_reservation_blocks must be at least 1, got {cls.kv_reservation_blocks}")
    if cls.kv_reservation_fraction is not None and not 0 < cls.kv_reservation_fraction < 1:
        raise ValueError(f"{where}.kv_reservation_fraction must be in (0, 1), got {cls.kv_reservation_fraction}")


def _check_classes(path: str, config: QoSConfig) -> None:
    for name, cls in config.classes.items():
        check_class(f"--qos-config {path}: classes.{name}", cls)
    named = [("default_class", config.default_class)]
    for tenant, policy in config.tenants.items():
        named.append((f"tenants.{tenant}.default_class", policy.default_class))
        named += [(f"tenants.{tenant}.classes", name) for name in policy.classes or ()]
    for field, name in named:
        if name is not None and name not in config.classes:
            raise ValueError(f"--qos-config {path}: {field} names class {name!r}, which is not in classes")
