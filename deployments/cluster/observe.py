"""Observation of a running app: where each live TP group's ranks run (needs ``ray.init``)."""

from __future__ import annotations

import contextlib
from typing import Any

from ..common.workers import WORKER_NAMESPACE, parse_worker_name


def tp_group_placement(deployment: str | None = None, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """Where every live TP group's ranks run, from the named worker actors (needs ``ray.init``).

    Returns ``{replica_id: {"deployment": name, "nodes": [node id of rank 0, rank 1, ...]}}``;
    a rank that does not answer (its node is gone) shows as None.
    """
    import ray

    ranks: dict[str, dict[int, str]] = {}
    owners: dict[str, str] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != WORKER_NAMESPACE:
            continue
        worker = parse_worker_name(entry["name"])
        if worker is None or (deployment is not None and worker.deployment != deployment):
            continue
        owners[worker.replica] = worker.deployment
        ranks.setdefault(worker.replica, {})[worker.rank] = entry["name"]

    def node_of(actor_name: str):
        with contextlib.suppress(Exception):  # gone between the listing and the lookup
            handle = ray.get_actor(actor_name, namespace=WORKER_NAMESPACE)
            return handle.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id())
        return None

    refs = {(rep, r): node_of(n) for rep, by_rank in ranks.items() for r, n in by_rank.items()}
    live = [ref for ref in refs.values() if ref is not None]
    ready, _ = ray.wait(live, num_returns=len(live), timeout=timeout_s) if live else ([], [])
    ready_set = set(ready)
    placement: dict[str, dict[str, Any]] = {}
    for replica, by_rank in sorted(ranks.items()):
        nodes = []
        for r in range(max(by_rank) + 1):
            ref = refs.get((replica, r))
            node = None
            if ref is not None and ref in ready_set:
                with contextlib.suppress(Exception):
                    node = ray.get(ref)
            nodes.append(node)
        placement[replica] = {"deployment": owners[replica], "nodes": nodes}
    return placement
