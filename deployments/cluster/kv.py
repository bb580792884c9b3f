"""Cluster-wide records in Ray's GCS key-value store: measured tail plans (reused by every
replica whose plan key matches) and each starting replica's warm-up progress (read by the
ingress's ``status()`` while the replica cannot answer yet). JSON values, one namespace.
"""

from __future__ import annotations

import json
from typing import Any

NAMESPACE = "latent_moe_serve"
PLAN_PREFIX = "tail_plan:"
PROGRESS_PREFIX = "warmup:"


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


def put_json(key: str, value: dict[str, Any]) -> None:
    _kv()._internal_kv_put(key, json.dumps(value), overwrite=True, namespace=NAMESPACE)


def get_json(key: str) -> dict[str, Any] | None:
    raw = _kv()._internal_kv_get(key, namespace=NAMESPACE)
    return None if raw is None else json.loads(raw)


def entries(prefix: str) -> dict[str, dict[str, Any]]:
    """Every record whose key starts with ``prefix``, by key."""
    kv = _kv()
    keys = kv._internal_kv_list(prefix, namespace=NAMESPACE)
    found = {}
    for key in keys:
        value = get_json(key.decode() if isinstance(key, bytes) else key)
        if value is not None:
            found[key.decode() if isinstance(key, bytes) else key] = value
    return found


def delete(key: str) -> None:
    _kv()._internal_kv_del(key, namespace=NAMESPACE)
