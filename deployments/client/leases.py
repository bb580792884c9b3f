"""Sessions on TP groups, the client side: how lanes, cohorts and sessions get their groups.

A :class:`GroupLease` asks one deployment for a session on one of its replicas' TP groups
through the Serve path (the control plane: ``open_session`` on the deployment,
``deployments.serve.sessions`` on the replica; the router sends it to the least-loaded healthy
replica) for some number of peers, reports a call that outlived its bound, and closes it. The
session has no term to renew: it lasts until closed, or until its peers have been gone its
``linger_s``. The grant carries that group's part of the session's ticket (:func:`endpoint`): the
peers then talk to the group's rank 0 over the data plane (``deployments.dataplane``), never
through Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import ray

from ..common.errors import GroupTimeoutError, GroupUnavailableError, error_message
from ..common.retry import resend_after
from ..config.timeouts import LEASE_ATTEMPT_S, RELEASE_S
from ..dataplane.errors import Failure, SessionError
from .errors import raise_for

logger = logging.getLogger(__name__)


def default_client_name() -> str:
    return f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def group_failure(exc: SessionError, lease: GroupLease, what: str) -> GroupUnavailableError:
    """A leased group's failure as the retry rule sees it: the group is broken (the replica
    breaks it: a rank died or failed, or, reported here, the call outlived its bound)."""
    reason = f"{what} failed: {exc.message}"
    if exc.failure is Failure.GROUP_TIMEOUT:
        lease.report_timeout(reason)
        return GroupTimeoutError(reason, lease.replica)
    return GroupUnavailableError(reason, lease.replica)


def check_seconds(**values: Any) -> None:
    for what, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
            raise ValueError(f"{what} must be a number of seconds >= 0, got {v!r}")


def served_layers(client: Any, layers: Iterable[int] | None) -> tuple[int, ...]:
    """``layers`` (None: every layer the app serves), each checked against the routing table."""
    served = {x for ls in client.layer_routes().layers.values() for x in ls}
    wanted = sorted(served) if layers is None else sorted({int(x) for x in layers})
    unknown = [x for x in wanted if x not in served]
    if unknown:
        raise ValueError(f"layer(s) {unknown} are not served by app {client.app_name!r} "
                         f"(it serves {sorted(served)})")
    return tuple(wanted)


def layers_by_deployment(client: Any, layers: Iterable[int] | None) -> tuple[tuple[int, ...], dict[int, str]]:
    """The layers a session serves (None: every layer of the client's app, or of its deployment for
    a client bound to one: ``MoEClient.direct``) and the deployment serving each."""
    if client.deployment is None:
        chosen = served_layers(client, layers)
        routes = client.layer_routes()
        return chosen, {x: routes.choose(x, None) for x in chosen}
    status = client.group_handle(client.deployment).status.remote().result(timeout_s=client.timeout_s)
    served = tuple(status["layers"])
    chosen = served if layers is None else tuple(sorted({int(x) for x in layers}))
    unknown = sorted(set(chosen) - set(served))
    if unknown:
        raise ValueError(f"layer(s) {unknown} are not served by deployment {client.deployment!r} "
                         f"(it serves {list(served)})")
    return chosen, dict.fromkeys(chosen, client.deployment)


class GroupLease:
    """One deployment's session for an owner (a lane, a cohort or a session): the grant, or why not.

    ``client``: the owner's ``MoEClient`` (its Serve handles); ``owner``: the owner's name
    (shown by the replica); ``max_tokens``: the most rows a peer sends per layer; ``peers``:
    the session's number of peers; ``workers``: a cohort's worker names (for ``status()``);
    ``idle_after_s``: an elastic session (``dataplane.host``).
    """

    def __init__(self, client: Any, deployment: str, owner: str, max_tokens: int, retry_s: float,
                 workers: Sequence[str] = (), peers: int = 1, idle_after_s: float | None = None,
                 linger_s: float | None = None):
        self.client, self.deployment, self.owner = client, deployment, owner
        self.max_tokens, self.retry_s, self.workers, self.peers = max_tokens, retry_s, list(workers), peers
        self.idle_after_s, self.linger_s = idle_after_s, linger_s
        self.grant: dict[str, Any] | None = None
        self.next_try = 0.0  # when a lease may be asked for again
        self.next_wait = 0.0  # how long the next due lease request waits for the group
        self.why_not = "not leased yet"
        self.leases = 0

    @property
    def held(self) -> bool:
        return self.grant is not None

    @property
    def replica(self) -> str | None:
        return None if self.grant is None else self.grant["replica"]

    def due(self) -> bool:
        return self.grant is None and time.monotonic() >= self.next_try

    def acquire(self, wait_s: float, avoid_replica: str | None = None) -> bool:
        """Open a session, asking again for up to ``wait_s`` while replicas refuse it (full, or
        ``lanes: false``; never ``avoid_replica``'s)."""
        handle = self.client.group_handle(self.deployment)
        deadline = time.monotonic() + wait_s
        asked_elsewhere = False
        while True:
            try:
                grant = handle.open_session.remote(self.owner, self.max_tokens, self.workers,
                                                   avoid_replica=avoid_replica, peers=self.peers,
                                                   idle_after_s=self.idle_after_s,
                                                   linger_s=self.linger_s).result(
                    timeout_s=self.client.timeout_s)
            except Exception as e:
                # The replica asked has a known-broken group, or died, and the router has not
                # steered around it yet: ask once more, elsewhere (common.retry's rule; not when
                # the failed replica is unknown), then take the Serve path. A broken group is
                # never the caller's error when another can serve.
                again = resend_after(e)
                if again is None:
                    raise_for(e)
                if asked_elsewhere or again.avoid_replica in (None, avoid_replica):
                    self.refused(f"opening a session failed: {error_message(e)}")
                    return False
                asked_elsewhere, avoid_replica = True, again.avoid_replica
                continue
            if grant["granted"] or time.monotonic() >= deadline:
                break
            # Full or refusing: a session may end, or the router's view of the replicas' load
            # (it lags by up to its stats period) may send the next ask elsewhere.
            time.sleep(min(LEASE_ATTEMPT_S, max(0.0, deadline - time.monotonic())))
        if not grant["granted"]:
            self.refused(f"session refused by replica {grant['replica']}: {grant['reason']}")
            return False
        self.grant = grant
        self.leases += 1
        self.why_not = ""
        logger.info("%s: %s opened session %s on replica %s (TP %d)", self.owner, self.deployment,
                    grant["session_id"], grant["replica"], grant["world"])
        return True

    def refused(self, why: str, retry_s: float | None = None) -> None:
        """No lease (``why``); ask again after ``retry_s`` (default: the owner's)."""
        self.why_not = why
        self.next_try = time.monotonic() + (self.retry_s if retry_s is None else retry_s)
        logger.info("%s: %s: %s; Serve path until it is asked again", self.owner, self.deployment, why)

    def report_timeout(self, reason: str) -> None:
        """Tell the replica (rank 0's main thread answers while its data plane is stuck) that a
        call outlived its bound: its health check breaks the group. A rank that cannot even
        answer this is stalled, which the replica finds out by itself."""
        with contextlib.suppress(Exception):
            rank0 = self.grant["ranks"][0]
            ray.get(rank0.dataplane_report.remote(reason), timeout=RELEASE_S)

    def take(self, why: str) -> dict[str, Any] | None:
        """Forget the grant (to close) and say why; the Serve path until asked again."""
        grant, self.grant = self.grant, None
        self.refused(why)
        return grant

    @staticmethod
    def release(grant: dict[str, Any], why: str = "closed by its opener") -> None:
        """Close the grant's session on its rank 0 (its peers are told ``why``)."""
        with contextlib.suppress(Exception):  # ranks gone: the session ended with them
            ray.get(grant["ranks"][0].session_close.remote(grant["session"], why), timeout=RELEASE_S)

    def status(self) -> dict[str, Any]:
        grant = self.grant
        return {"path": "session" if grant is not None else "serve",
                "replica": None if grant is None else grant["replica"],
                "session_id": None if grant is None else grant["session_id"],
                "why_serve": self.why_not or None, "leases": self.leases}


class LeaseHolder:
    """What a lane or a cohort holds while it lives: its sessions by deployment, one lock for its
    calls and whether it is closing. The public object (``Lane``, ``Cohort``) keeps this and a
    ``weakref.finalize`` that closes it, so an unclosed lane or cohort that its owner drops is
    collected and its sessions closed. Subclasses say how to close (:meth:`close`)."""

    def __init__(self, name: str, leases: dict[str, GroupLease]):
        self.name, self.leases = name, leases
        self.lock = threading.Lock()
        self.closing = False

    def close(self) -> None:
        raise NotImplementedError
