"""Serve request router of the TP-group deployments: power of two choices among healthy replicas.

Each replica reports ``{"healthy": bool}`` through Serve's ``record_routing_stats`` hook (every
``common.layer_routing.ROUTING_STATS_PERIOD_S``; ``control.options`` names this class in each
deployment's ``request_router_config``). A replica whose TP group broke stays in Serve's replica
set until its health check fails a few times; meanwhile this router sends requests only to
replicas that report a usable group (all of them when none does, so the caller gets the
broken replica's clear 503 rather than a hang), and among those to replicas not leased to a
lane (``{"leased": bool}``, ``deployments.serve.lanes``) while any is free.
"""

from __future__ import annotations

import random

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica


def healthy(replica: RunningReplica) -> bool:
    return bool(replica.routing_stats.get("healthy", True))


def leased(replica: RunningReplica) -> bool:
    return bool(replica.routing_stats.get("leased", False))


class HealthyReplicaRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        usable = [r for r in candidate_replicas if healthy(r)]
        # A replica leased to a lane runs nothing else until the lease ends (serve.lanes).
        free = [r for r in usable if not leased(r)]
        usable = free or usable
        if not usable or len(usable) == len(candidate_replicas):
            return await super().choose_replicas(candidate_replicas, pending_request)
        # Two random usable replicas; Serve then takes the one with the shorter queue.
        return [random.sample(usable, min(2, len(usable)))]
