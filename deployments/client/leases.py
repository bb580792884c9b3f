"""Leases of TP groups, the client side: the one lease mechanism of lanes, cohorts and sessions.

A :class:`GroupLease` asks one deployment for a lease of one of its replicas' TP groups through
the Serve path (the control plane: ``lease_lane`` on the deployment, ``deployments.serve.lanes``
on the replica) for a session of some number of peers, renews it every half term while its owner
calls (and, through :func:`kept_renewed`, while the owner leases its other groups), reports a
call that outlived its bound, and releases it. The grant carries that group's part of the
session's ticket (:func:`endpoint`): the peers then talk to the group's rank 0 over the data
plane (``deployments.dataplane``), never through Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import ray

from ..common.errors import GroupTimeoutError, GroupUnavailableError, error_message
from ..common.retry import resend_after
from ..config.timeouts import LEASE_ATTEMPT_S, PROBE_S, RELEASE_S
from ..dataplane.errors import Failure, SessionError
from ..dataplane.peer import GroupEndpoint
from .errors import raise_for

logger = logging.getLogger(__name__)

DEFAULT_WAIT_S = 5.0  # a lane's or cohort's wait for its leases before it takes the Serve path
DEFAULT_RETRY_S = 5.0  # and how often it asks again


def default_client_name() -> str:
    return f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def group_failure(exc: SessionError, lease: GroupLease, what: str) -> GroupUnavailableError:
    """A leased group's failure as the retry rule sees it: the group is broken (the replica
    breaks it: a rank died or failed, or, reported here, the call outlived its bound)."""
    reason = f"{what} failed: {exc}"
    if exc.failure is Failure.GROUP_TIMEOUT:
        lease.report_timeout(reason)
        return GroupTimeoutError(reason, lease.replica)
    return GroupUnavailableError(reason, lease.replica)


def endpoint(grant: dict[str, Any], layers: Iterable[int]) -> GroupEndpoint:
    """A grant's group as a session ticket names it (``layers``: the session's layers it serves)."""
    return GroupEndpoint(grant["deployment"], grant["replica"], grant["lease_id"], grant["host"],
                         grant["port"], grant["secret"], grant["session"], tuple(layers),
                         grant["hidden_size"], grant["dtype"], grant["call_timeout_s"], grant["max_tokens"],
                         grant["store_port"], grant["channel"])


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


class GroupLease:
    """One deployment's lease for an owner (a lane or a cohort): the grant, or why not.

    ``client``: the owner's ``MoEClient`` (its Serve handles); ``owner``: the owner's name
    (shown by the replica); ``max_tokens``: the most rows a peer sends per layer; ``peers``:
    the session's number of peers; ``workers``: a cohort's worker names (for ``status()``);
    ``idle_after_s``: an elastic session (``dataplane.host``).
    """

    def __init__(self, client: Any, deployment: str, owner: str, max_tokens: int, retry_s: float,
                 workers: Sequence[str] = (), peers: int = 1, idle_after_s: float | None = None):
        self.client, self.deployment, self.owner = client, deployment, owner
        self.max_tokens, self.retry_s, self.workers, self.peers = max_tokens, retry_s, list(workers), peers
        self.idle_after_s = idle_after_s
        self.grant: dict[str, Any] | None = None
        self.renewed_at = 0.0  # time.monotonic() when the last granted renewal was *sent*
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
        """Ask for a lease, waiting up to ``wait_s`` for a group (never ``avoid_replica``'s)."""
        handle = self.client.group_handle(self.deployment)
        deadline = time.monotonic() + wait_s
        asked_elsewhere = False
        while True:
            # Short waits, asked again: the router's view of which replicas are leased lags by
            # up to its stats period, so a later ask may reach a free replica.
            attempt_s = min(max(0.0, deadline - time.monotonic()), LEASE_ATTEMPT_S)
            sent = time.monotonic()
            try:
                grant = handle.lease_lane.remote(self.owner, self.max_tokens, attempt_s, self.workers,
                                                 avoid_replica=avoid_replica, peers=self.peers,
                                                 idle_after_s=self.idle_after_s).result(
                    timeout_s=attempt_s + self.client.timeout_s)
            except Exception as e:
                # The replica asked has a known-broken group, or died, and the router has not
                # steered around it yet: ask once more, elsewhere (common.retry's rule; not when
                # the failed replica is unknown), then take the Serve path. A broken group is
                # never the caller's error when another can serve.
                again = resend_after(e)
                if again is None:
                    raise_for(e)
                if asked_elsewhere or again.avoid_replica in (None, avoid_replica):
                    self.refused(f"lease failed: {error_message(e)}")
                    return False
                asked_elsewhere, avoid_replica = True, again.avoid_replica
                continue
            if grant["granted"] or time.monotonic() >= deadline:
                break
        if not grant["granted"]:
            self.refused(f"lease refused by replica {grant['replica']}: {grant['reason']}")
            return False
        self.grant, self.renewed_at = grant, sent
        self.leases += 1
        self.why_not = ""
        logger.info("%s: %s leased replica %s (TP %d, lease %s, term %.1f s)", self.owner, self.deployment,
                    grant["replica"], grant["world"], grant["lease_id"], grant["term_s"])
        return True

    def refused(self, why: str, retry_s: float | None = None) -> None:
        """No lease (``why``); ask again after ``retry_s`` (default: the owner's)."""
        self.why_not = why
        self.next_try = time.monotonic() + (self.retry_s if retry_s is None else retry_s)
        logger.info("%s: %s: %s; Serve path until it is asked again", self.owner, self.deployment, why)

    def renew_due(self) -> bool:
        grant = self.grant
        return grant is not None and time.monotonic() - self.renewed_at >= grant["term_s"] / 2

    def renew(self) -> bool:
        """Renew the lease (True), or say why not: the owner then drops it."""
        sent, grant = time.monotonic(), self.grant  # read once: a keeper thread may renew too
        if grant is None:
            return False
        try:
            # Bounded well under a step: a renewal runs between an owner's calls.
            ok = ray.get(grant["ranks"][0].lane_renew.remote(grant["lease_id"]), timeout=PROBE_S)
            why = f"lease {grant['lease_id']} not renewed (others wait for the group, or it ended)"
        except Exception as e:
            ok, why = False, f"lease renewal failed: {error_message(e)}"
        if ok:
            self.renewed_at = sent
        else:
            self.why_not = why
        return ok

    def report_timeout(self, reason: str) -> None:
        """Tell the replica (rank 0's main thread answers while its data plane is stuck) that a
        call outlived its bound: it breaks the group. A rank that cannot even answer this is
        stalled, which the replica finds out by itself."""
        with contextlib.suppress(Exception):
            rank0 = self.grant["ranks"][0]
            ray.get(rank0.lane_fail.remote(self.grant["lease_id"], reason), timeout=RELEASE_S)

    def take(self, why: str) -> dict[str, Any] | None:
        """Forget the grant (to release) and say why; the Serve path until asked again."""
        grant, self.grant = self.grant, None
        self.refused(why)
        return grant

    @staticmethod
    def release(grant: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # ranks gone: the lease ends on the replica anyway
            ray.get(grant["ranks"][0].lane_release.remote(grant["lease_id"]), timeout=RELEASE_S)

    def status(self) -> dict[str, Any]:
        grant = self.grant
        return {"path": "lane" if grant is not None else "serve",
                "replica": None if grant is None else grant["replica"],
                "lease_id": None if grant is None else grant["lease_id"],
                "why_serve": self.why_not or None, "leases": self.leases}


@contextlib.contextmanager
def kept_renewed(leases: Iterable[GroupLease]) -> Iterator[None]:
    """Renew every held lease of ``leases`` when due while the block runs, from a thread of its
    own: an owner leasing its other groups (each may wait for its group) makes no call, and a
    lease is ended one term after its last renewal. A renewal refused here leaves the lease due,
    so the owner's next renewal finds it ended and drops it. The thread stops with the block
    and is joined."""
    leases = list(leases)
    done = threading.Event()
    refused: set[str] = set()

    def keep() -> None:
        while True:
            grants = [lease.grant for lease in leases]
            if done.wait(min((g["term_s"] for g in grants if g is not None), default=LEASE_ATTEMPT_S) / 8):
                return
            for lease, grant in zip(leases, grants, strict=True):
                if grant is not None and grant["lease_id"] not in refused and lease.renew_due() \
                        and not lease.renew():
                    refused.add(grant["lease_id"])

    thread = threading.Thread(target=keep, name="renew-leases", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()  # a renewal under way ends within its own timeout


class LeaseHolder:
    """What a lane or a cohort holds while it lives: its leases by deployment, one lock for its
    calls, the time of its last call, and a thread that drops its leases once idle (a held
    lease keeps the group from every other caller).

    The public object (``Lane``, ``Cohort``) keeps this and a ``weakref.finalize`` that closes
    it; the idle thread holds only this, never the public object, so an unclosed lane or cohort
    that its owner drops is collected, and its leases released, instead of polling for ever.
    Subclasses say how to drop their leases (:meth:`drop_idle`) and close (:meth:`close`).
    """

    def __init__(self, name: str, leases: dict[str, GroupLease]):
        self.name, self.leases = name, leases
        self.lock = threading.Lock()
        self.last_call = time.monotonic()
        self.closing = False
        self.stopped = threading.Event()  # ends the idle thread
        self.idle_thread: threading.Thread | None = None

    def watch_idle(self) -> None:
        self.idle_thread = threading.Thread(target=self._drop_when_idle, name=f"idle-{self.name}",
                                            daemon=True)
        self.idle_thread.start()

    def stop_watching(self) -> None:
        """End the idle thread and join it (closing)."""
        self.stopped.set()
        thread = self.idle_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _drop_when_idle(self) -> None:
        """An owner not called for half a lease term releases its groups (the next call leases
        again, waiting up to ``LEASE_ATTEMPT_S``) rather than keep them from the Serve path
        and other clients until its leases expire."""
        while not self.stopped.is_set():
            held = [lease for lease in self.leases.values() if lease.held]
            if not held:  # nothing to drop: look again a lease attempt later
                self.stopped.wait(LEASE_ATTEMPT_S)
                continue
            term = min(lease.grant["term_s"] for lease in held)  # the replicas' lane_lease_s
            if self.stopped.wait(term / 4):
                return
            if time.monotonic() - self.last_call < term / 2:
                continue
            with self.lock:
                if self.closing or time.monotonic() - self.last_call < term / 2:
                    continue
                self.drop_idle("idle for half a lease term")
                for lease in held:
                    # the next call leases again at once, waiting up to one attempt for the group
                    # (free a moment ago; a health check or the release may still hold it)
                    lease.next_try, lease.next_wait = 0.0, LEASE_ATTEMPT_S

    def drop_idle(self, why: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
