"""How a TP group's rank actors are named: the replica names them (``serve.group``) and the
observers of a running app find them by these names (``cluster.observe``).

Pure: no Ray import.
"""

from __future__ import annotations

from typing import NamedTuple

WORKER_NAMESPACE = "latent_moe_serve"  # the Ray namespace of every rank actor


class WorkerName(NamedTuple):
    deployment: str
    replica: str
    rank: int


def worker_name(deployment: str, replica: str, rank: int) -> str:
    """The actor name of ``rank`` of the TP group of ``replica`` of ``deployment``."""
    return f"{deployment}:{replica}:rank{rank}"


def parse_worker_name(name: str) -> WorkerName | None:
    """The parts of a name :func:`worker_name` made; None for any other actor's name."""
    group, _, rank = name.rpartition(":rank")
    deployment, _, replica = group.partition(":")
    if not rank.isdigit() or not replica:
        return None
    return WorkerName(deployment, replica, int(rank))
