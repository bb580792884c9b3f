"""Leases of TP groups, the client side: the one lease mechanism and graph builder of lanes and
cohorts.

A :class:`GroupLease` asks one deployment for a lease of one of its replicas' TP groups through
the Serve path (the control plane: ``lease_lane`` on the deployment, ``deployments.serve.lanes``
on the replica), renews it every half term while its owner calls (and, through
:func:`kept_renewed`, while the owner leases its other groups or compiles), reports a call that outlived
its bound, and releases it. Its owner -- a lane (one graph per leased group) or a cohort (one
graph over its attention workers and every leased group) -- binds each group forward of its
graph with :func:`bind_group_forward` (every rank's ``lane_forward``: the parts' rows as one
batch), and tears its graph down before the release (:func:`teardown_then`).

Ray's limits that shape this (Ray 2.60): only the process that compiles a graph executes it; an
actor runs one graph loop at a time per concurrency group (the ranks host several, see
``serve.lanes``); every graph loop polls its channels and keeps a core busy while the graph
exists (hence idle owners drop their leases); an actor's death tears the whole graph down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import ray

from ..common.errors import GroupTimeoutError, GroupUnavailableError, error_message, root_cause
from ..common.retry import resend_after
from ..config.timeouts import LEASE_ATTEMPT_S, RELEASE_S
from .errors import raise_for

logger = logging.getLogger(__name__)

DEFAULT_WAIT_S = 5.0  # a lane's or cohort's wait for its leases before it takes the Serve path
DEFAULT_RETRY_S = 5.0  # and how often it asks again


def default_client_name() -> str:
    return f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def lease_ended(exc: BaseException) -> bool:
    """The rank's ``LaneLeaseError`` (``serve.lanes``), by name: clients import no servers."""
    return type(root_cause(exc)).__name__ == "LaneLeaseError"


def group_failure(exc: BaseException, lease: GroupLease, what: str) -> GroupUnavailableError:
    """A leased group's failure as the retry rule sees it: the group is broken (the replica
    breaks it: a rank died or failed, or, reported here, the call outlived its bound)."""
    cause = root_cause(exc)
    if isinstance(cause, ray.exceptions.GetTimeoutError | TimeoutError):
        reason = f"{what} outlived the group's call bound {lease.grant['call_timeout_s']:.0f} s"
        lease.report_timeout(reason)
        return GroupTimeoutError(reason, lease.replica)
    reason = f"{what} failed: {type(cause).__name__}: {error_message(cause)}"
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


class GroupLease:
    """One deployment's lease for an owner (a lane or a cohort): the grant, or why not.

    ``client``: the owner's ``MoEClient`` (its Serve handles); ``owner``: the owner's name
    (shown by the replica); ``max_tokens``: the largest forward the owner sends;
    ``workers``: a cohort's worker names (for the replica's ``status()``).
    """

    def __init__(self, client: Any, deployment: str, owner: str, max_tokens: int, retry_s: float,
                 workers: Sequence[str] = ()):
        self.client, self.deployment, self.owner = client, deployment, owner
        self.max_tokens, self.retry_s, self.workers = max_tokens, retry_s, list(workers)
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
                                                 avoid_replica=avoid_replica).result(
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
            ok = ray.get(grant["ranks"][0].lane_renew.remote(grant["lease_id"]),
                         timeout=self.client.timeout_s)
            why = f"lease {grant['lease_id']} not renewed (others wait for the group, or it ended)"
        except Exception as e:
            ok, why = False, f"lease renewal failed: {error_message(e)}"
        if ok:
            self.renewed_at = sent
        else:
            self.why_not = why
        return ok

    def report_timeout(self, reason: str) -> None:
        """Tell the replica (rank 0's main thread answers while its graph loop is stuck) that a call
        outlived its bound: it breaks the group. A rank that cannot even answer this is stalled,
        which the replica finds out by itself."""
        with contextlib.suppress(Exception):
            rank0 = self.grant["ranks"][0]
            ray.get(rank0.lane_fail.remote(self.grant["lease_id"], reason), timeout=RELEASE_S)

    def take(self, why: str) -> dict[str, Any] | None:
        """Forget the grant (to release once the graph is down) and say why; the Serve path until
        asked again."""
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
    own: an owner leasing its other groups (each may wait for its group) or compiling its graph
    (which starts a Ray process: seconds on a loaded node) makes no call, and a lease is
    ended one term after its last renewal. A renewal refused here leaves the lease due, so the
    owner's next renewal finds it ended and drops it."""
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

    threading.Thread(target=keep, name="renew-leases", daemon=True).start()
    try:
        yield
    finally:
        done.set()  # not joined: a renewal under way ends within its own timeout


class LeaseHolder:
    """What a lane or a cohort holds while it lives: its leases by deployment, one lock for its
    calls, the time of its last call, and a thread that drops its leases once idle.

    The public object (``Lane``, ``Cohort``) keeps this and a ``weakref.finalize`` that closes
    it; the idle thread holds only this, never the public object, so an unclosed lane or cohort
    that its owner drops is collected, and its leases released, instead of polling for ever.
    Subclasses say how to drop their graphs (:meth:`drop_idle`) and close (:meth:`close`).
    """

    def __init__(self, name: str, leases: dict[str, GroupLease]):
        self.name, self.leases = name, leases
        self.lock = threading.Lock()
        self.last_call = time.monotonic()
        self.closing = False

    def watch_idle(self) -> None:
        threading.Thread(target=self._drop_when_idle, name=f"idle-{self.name}", daemon=True).start()

    def _drop_when_idle(self) -> None:
        """An idle compiled graph's loops poll their channels, a core per actor: an owner not
        called for half a lease term tears its graphs down and releases its groups (the next
        call leases again, waiting up to ``LEASE_ATTEMPT_S``) rather than burn those cores
        until its leases expire."""
        while not self.closing:
            held = [lease for lease in self.leases.values() if lease.held]
            if not held:  # nothing to drop: look again a lease attempt later
                time.sleep(LEASE_ATTEMPT_S)
                continue
            term = min(lease.grant["term_s"] for lease in held)  # the replicas' lane_lease_s
            time.sleep(term / 4)
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


def bind_group_forward(grant: dict[str, Any], layer: Any, router_logits: Any, parts: Sequence[Any],
                       after: Sequence[Any] | None = None) -> list[Any]:
    """Every rank's node of one group forward of ``parts`` (graph nodes giving each part's rows;
    ``layer``, ``router_logits``: constants or input nodes), in rank order. ``after``: each
    rank's previous node in the same graph (a cohort's earlier layer), which this one follows."""
    after = list(after) if after is not None else [None] * len(grant["ranks"])
    return [rank.lane_forward.bind(grant["lease_id"], layer, router_logits, prev, *parts)
            for rank, prev in zip(grant["ranks"], after, strict=True)]


def teardown_then(dag: Any, then: Callable[[], None], wait_s: float, what: str) -> None:
    """Tear ``dag`` down, then run ``then`` (a release), aside: teardown waits for every actor's
    graph loop, and a stalled rank must not block the caller longer than ``wait_s``."""

    def run() -> None:
        with contextlib.suppress(Exception):  # actors gone: their loops ended with them
            dag.teardown()
        then()

    thread = threading.Thread(target=run, name=f"teardown-{what}", daemon=True)
    thread.start()
    thread.join(timeout=wait_s)
