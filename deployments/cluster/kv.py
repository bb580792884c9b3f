"""Cluster-wide records in Ray's GCS key-value store: measured tail plans (one per plan key,
the latest measurement; reused by every replica whose key matches) and each replica's warm-up
record (read by the ingress's ``status()`` while a replica cannot answer yet). JSON values, one
namespace.

Warm-up records stay bounded: each names its replica's actor; a replica deletes its own when it
ends, and :func:`live_progress` (the ingress's read, and every replica's start) deletes those
whose actor is gone (a replica that was killed never ran its own clean-up).
"""

from __future__ import annotations

import json
from typing import Any

from ..common.private_api import kv_delete, kv_get, kv_keys, kv_put

NAMESPACE = "latent_moe_serve"
PLAN_PREFIX = "tail_plan:"
PROGRESS_PREFIX = "warmup:"


def put_json(key: str, value: dict[str, Any]) -> None:
    kv_put(key, json.dumps(value), NAMESPACE)


def get_json(key: str) -> dict[str, Any] | None:
    raw = kv_get(key, NAMESPACE)
    return None if raw is None else json.loads(raw)


def entries(prefix: str) -> dict[str, dict[str, Any]]:
    """Every record whose key starts with ``prefix``, by key."""
    found = {key: get_json(key) for key in kv_keys(prefix, NAMESPACE)}
    return {key: value for key, value in found.items() if value is not None}


def delete(key: str) -> None:
    kv_delete(key, NAMESPACE)


def progress_key(deployment: str, replica: str) -> str:
    return f"{PROGRESS_PREFIX}{deployment}:{replica}"


def actor_alive(name: str | None, namespace: str | None) -> bool:
    """Whether the named actor still exists (a record without a name counts as alive)."""
    if not name:
        return True
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:  # no such actor (any more)
        return False
    return True


def live_progress() -> list[dict[str, Any]]:
    """Every warm-up record whose replica's actor exists; the others are deleted (blocking: GCS
    calls, so callers in an event loop run it in a thread)."""
    live = []
    for key, record in entries(PROGRESS_PREFIX).items():
        if actor_alive(record.get("actor"), record.get("namespace")):
            live.append(record)
        else:
            delete(key)
    return live
