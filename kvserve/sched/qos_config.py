"""The QoS config file (`--qos-config qos.yaml|qos.json`): per-tenant scheduling weights for the
fair-share policy (kvserve/sched/fair_share.py). Read and checked once at start: an unknown key,
a weight that is not a positive number, or a file that does not parse is a ValueError naming it.

    tenants:
      alice: {weight: 3}
      bob: {weight: 1}
    default_weight: 1      # tenants not listed, and requests without a tenant
"""

from __future__ import annotations

import json
import os
from typing import Optional

import msgspec


class TenantPolicy(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    weight: float = 1.0


class QoSConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    tenants: dict[str, TenantPolicy] = {}
    default_weight: float = 1.0

    def weight_of(self, tenant: Optional[str]) -> float:
        policy = self.tenants.get(tenant) if tenant is not None else None
        return policy.weight if policy is not None else self.default_weight


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
    for name, weight in [("default_weight", config.default_weight)] + [
            (f"tenants.{tenant}.weight", policy.weight) for tenant, policy in config.tenants.items()]:
        if not weight > 0:
            raise ValueError(f"--qos-config {path}: {name} must be a positive number, got {weight}")
    return config
