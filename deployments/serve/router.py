"""Serve request router of the TP-group deployments: power of two choices among healthy replicas.

Each replica reports ``{"healthy": bool}`` through Serve's ``record_routing_stats`` hook (every
``config.timeouts.ROUTING_STATS_PERIOD_S``; ``control.serve_options`` names this class in each
deployment's ``request_router_config``). A replica whose TP group broke stays in Serve's replica
set until its health check fails a few times; meanwhile this router sends requests only to
replicas that report a usable group (all of them when none does, so the caller gets the
broken replica's clear 503 rather than a hang). A new session (``open_session``) goes to the
healthy replica whose open sessions send the fewest rows per layer (``{"session_rows": int}``,
``deployments.serve.sessions``). A call re-sent under the retry rule (``common.retry``) names the
replica that failed it (``avoid_replica``): it goes to any other replica, even before that one
reports itself broken.
"""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, LocalityMixin, PendingRequest, RequestRouter, RunningReplica


def healthy(replica: RunningReplica) -> bool:
    return bool(replica.routing_stats.get("healthy", True))


def session_rows(replica: RunningReplica) -> int:
    return int(replica.routing_stats.get("session_rows", 0))


def opens_session(pending_request: PendingRequest | None) -> bool:
    return pending_request is not None and pending_request.metadata.call_method == "open_session"


def avoided(pending_request: PendingRequest | None) -> str | None:
    return None if pending_request is None else pending_request.kwargs.get("avoid_replica")


def steer(candidates: list[RunningReplica], avoid: str | None, new_session: bool = False
          ) -> list[RunningReplica] | None:
    """The replicas a request may go to, or None when there is nothing to steer around (then
    Serve's own choice among every replica). ``new_session``: only the least-loaded ones."""
    pool = candidates
    if avoid is not None:
        # The replica refuses a call that names it, so only others are worth a try.
        pool = [r for r in pool if r.replica_id.unique_id != avoid] or pool
    usable = [r for r in pool if healthy(r)] or pool
    if new_session:
        least = min(session_rows(r) for r in usable)
        usable = [r for r in usable if session_rows(r) == least]
    return None if len(usable) == len(candidates) else usable


class HealthyReplicaRouter(FIFOMixin, LocalityMixin, RequestRouter):
    """Power of two choices (Serve's default, built here on its public router API) among the
    replicas :func:`steer` leaves, or among Serve's locality preference when it leaves them all."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        pool = steer(candidate_replicas, avoided(pending_request), opens_session(pending_request))
        if pool is None:  # same node first, then same zone, then any (Serve's LocalityMixin)
            near = self.apply_locality_routing(pending_request)
            pool = [r for r in candidate_replicas if r.replica_id in near] or candidate_replicas
        # Two random replicas; Serve then takes the one with the shorter queue.
        return [random.sample(pool, min(2, len(pool)))]
