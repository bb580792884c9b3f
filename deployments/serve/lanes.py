"""Leases, the group side: a replica leases its TP group to one client at a time, a lane or a
cohort.

A lane (``deployments.client.lane``) is a client's own Ray Compiled Graph over the ranks of a
leased group: client -> every rank -> client through shared-memory channels, no Serve router,
proxy or replica event loop per call. A cohort (``deployments.client.cohort``) is one graph over
many attention workers and the ranks of every group serving its layers: per layer the ranks
gather every worker's rows into one forward. Both call the same rank method
(``TPWorker.lane_forward``: the parts' rows concatenated, one forward, each part's token count
back). Ray lets only the compiling process execute a graph, and the ranks run collectives that
must see one call order, so a group serves one lease at a time and nothing else meanwhile:

* :class:`LaneLeases` (the replica) grants a lease by taking the group's call lock: Serve
  forwards, the health collective and warm-up wait while it is held, and the replica's own
  compiled graph is torn down (an idle graph's loops poll their channels, a core per rank; it is
  compiled again at the next Serve forward). It polls the ranks every
  ``LANE_POLL_S``: the lease's forwards, callers' parts and tokens feed the replica's counters
  (``status()``, the autoscaler's tokens/s; waiting lease requests count as queued tokens), a
  dead rank, a rank whose forward failed, or a client's report that a call outlived its bound
  breaks the group (Serve replaces the replica), and the lease ends when the client releases
  it, or one term (``lane_lease_s``) after its last renewal -- a dead client holds nothing for
  longer.
  While a Serve request or another lease waits, a lease held a whole term is no longer renewed:
  the client then tears its graph down and takes the Serve path, so waits stay bounded.
* :class:`LaneSeat` (each rank) records the lease: the lane's calls carry its id and are
  refused on any other; rank 0 counts calls, tokens and renewals.

A client that dies without tearing its graph down leaves that graph's loop waiting on every
rank until the replica ends (Ray cannot cancel it from another process), and an idle loop polls
its channel, using CPU; the workers therefore host up to
``LANE_GRAPH_SLOTS`` graph loops, and a replica refuses leases once the abandoned ones leave
fewer than two free (its own graph and one lane), saying so.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import logger
from ..common.errors import ServeInputError, TooLargeError, actor_died, error_message
from ..config.timeouts import LANE_POLL_S, RANK_POLL_S

LANE_GRAPH_SLOTS = 16  # compiled-graph loops a worker can run at once (its _ray_system threads)
MAX_LEASE_WAIT_S = 600.0
HISTORY = 16  # ended leases kept for status()


class LaneLeaseError(RuntimeError):
    """A lane call carried a lease this rank does not hold (ended, or never granted)."""


@dataclass
class LaneSeat:
    """One rank's record of its group's lease (at most one)."""

    lease_id: str | None = None
    client: str = ""
    revoked: bool = False
    released: bool = False
    renewed_at: float = 0.0  # time.monotonic() of the grant or the last renewal
    calls: int = 0  # graph executions that reached this rank (every rank counts the same)
    forwards: int = 0  # of them: forwards run (a call whose parts all had 0 rows runs none)
    requests: int = 0  # callers' parts with rows in those forwards (a cohort: one per worker)
    tokens: int = 0
    busy_s: float = 0.0
    in_flight_tokens: int = 0
    failed: str | None = None  # why this rank's lease call failed (not its input): the group breaks
    tails: Counter[str] = field(default_factory=Counter)  # tail -> lane forwards that ran it
    layer_forwards: Counter[int] = field(default_factory=Counter)
    layer_requests: Counter[int] = field(default_factory=Counter)
    layer_tokens: Counter[int] = field(default_factory=Counter)
    batch_tokens: Counter[str] = field(default_factory=Counter)  # "layer:tokens" of a forward -> forwards
    # Leases that expired without a release: their client died or stalled without tearing its
    # graph down, whose loop may then block one graph slot (a late release clears it).
    expired: set[str] = field(default_factory=set)

    def open(self, lease_id: str, client: str) -> None:
        self.lease_id, self.client = lease_id, client
        self.revoked = self.released = False
        self.renewed_at = time.monotonic()
        self.calls = self.forwards = self.requests = self.tokens = self.in_flight_tokens = 0
        self.busy_s = 0.0
        self.failed = None
        self.tails, self.layer_forwards, self.layer_tokens = Counter(), Counter(), Counter()
        self.layer_requests = Counter()
        self.batch_tokens = Counter()

    def close(self, lease_id: str) -> None:
        if self.lease_id == lease_id:
            self.lease_id = None

    def check(self, lease_id: str) -> None:
        if lease_id != self.lease_id:
            raise LaneLeaseError(
                f"lane call with lease {lease_id!r} on a rank whose lease is {self.lease_id!r}: "
                "the lease ended; lease the group again"
            )

    def renew(self, lease_id: str) -> bool:
        """True when ``lease_id`` is held and not revoked (its term starts again)."""
        if lease_id != self.lease_id or self.revoked or self.released:
            return False
        self.renewed_at = time.monotonic()
        return True

    def expire(self, lease_id: str, term_s: float) -> bool:
        """End ``lease_id`` if it went a whole term without a renewal and no call runs here;
        atomic with :meth:`renew` (both run on the actor's main thread), so a renewal that
        arrives later is refused and its client never calls again."""
        if lease_id != self.lease_id or self.in_flight_tokens or time.monotonic() - self.renewed_at <= term_s:
            return False
        self.expired.add(lease_id)
        self.lease_id = None
        return True

    def release(self, lease_id: str) -> None:
        """The client tore its graph down (also after its lease expired)."""
        if lease_id == self.lease_id:
            self.released = True
        self.expired.discard(lease_id)

    def revoke(self, lease_id: str) -> None:
        if lease_id == self.lease_id:
            self.revoked = True

    def fail(self, lease_id: str, reason: str) -> None:
        """The client saw a call of this lease outlive its bound: the group is broken."""
        if lease_id == self.lease_id and self.failed is None:
            self.failed = reason

    def state(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "client": self.client, "revoked": self.revoked,
                "released": self.released, "renew_age_s": time.monotonic() - self.renewed_at,
                "calls": self.calls, "forwards": self.forwards, "requests": self.requests,
                "tokens": self.tokens, "busy_s": self.busy_s, "failed": self.failed,
                "in_flight_tokens": self.in_flight_tokens, "abandoned": len(self.expired),
                "tails": dict(self.tails), "layer_forwards": dict(self.layer_forwards),
                "layer_requests": dict(self.layer_requests),
                "layer_tokens": dict(self.layer_tokens), "batch_tokens": dict(self.batch_tokens)}


@dataclass
class Lease:
    """The replica's view of the lease it granted."""

    lease_id: str
    client: str
    max_tokens: int
    since: float  # time.time() of the grant
    granted_at: float  # time.monotonic() of the grant
    workers: list[str] = field(default_factory=list)  # a cohort's attention workers (a lane: none)
    revoked: bool = False
    calls: int = 0
    forwards: int = 0
    requests: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    in_flight_tokens: int = 0
    renew_age_s: float = 0.0
    counts: dict[str, dict] = field(default_factory=dict)  # rank 0's per-tail / per-layer counters
    watcher: asyncio.Task | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"client": self.client, "kind": "cohort" if self.workers else "lane",
                "workers": list(self.workers), "lease_id": self.lease_id, "max_tokens": self.max_tokens,
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
                "calls": self.calls, "forwards": self.forwards, "requests": self.requests,
                "tokens": self.tokens, "busy_s": round(self.busy_s, 3),
                "revoked": self.revoked, "renew_age_s": round(self.renew_age_s, 2)}


class LaneLeases:
    """The replica's leases of its TP group (one at a time); see the module docstring.

    ``group``: the replica's ``TPGroup``; ``spec``: returns the current deployment spec (live
    ``user_config`` changes); ``stats``: the replica's ``ReplicaStats``; ``demand``: the number
    of Serve requests waiting at this replica.
    """

    def __init__(self, group: Any, spec: Callable[[], Any], stats: Any, demand: Callable[[], int],
                 replica: str):
        self.group, self.spec, self.stats, self.demand, self.replica = group, spec, stats, demand, replica
        self.active: Lease | None = None
        self.waiting = 0  # lease requests waiting for the group
        self.waiting_tokens = 0
        self.abandoned = 0  # graph loops left waiting on the ranks by clients that died
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.granted = 0
        self._ids = itertools.count(1)

    # -- grant ----------------------------------------------------------------------------

    async def grant(self, client: str, max_tokens: Any, wait_s: Any,
                    workers: list[str] | None = None) -> dict[str, Any]:
        """Lease the group to ``client`` (waiting up to ``wait_s`` for it; ``workers``: a cohort's
        attention workers, for ``status()``); a dict saying ``granted`` and, if so, what the
        client needs to build its graph; else the reason."""
        spec = self.spec()
        if not isinstance(client, str) or not client.strip():
            raise ServeInputError(f"client must be a non-empty string, got {client!r}")
        workers = list(workers or [])
        if not all(isinstance(w, str) for w in workers):
            raise ServeInputError(f"workers must be a list of names, got {workers!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ServeInputError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if max_tokens > spec.max_tokens_per_request:
            what = f"a cohort of {len(workers)} workers" if workers else "a lane"
            raise TooLargeError(
                f"{what} of max_tokens {max_tokens} per forward exceeds max_tokens_per_request = "
                f"{spec.max_tokens_per_request} of deployment {spec.name!r}"
            )
        number = isinstance(wait_s, int | float) and not isinstance(wait_s, bool)
        if not number or not 0 <= wait_s <= MAX_LEASE_WAIT_S:
            raise ServeInputError(
                f"wait_s must be a number of seconds in [0, {MAX_LEASE_WAIT_S:.0f}], got {wait_s!r}"
            )
        if not spec.lanes:
            return self._refused(f"deployment {spec.name!r} has lanes: false")
        self.group.check_usable()
        rank0 = await asyncio.wait_for(self.group.workers[0].lane_state.remote(), RANK_POLL_S)
        self.abandoned = rank0["abandoned"]
        if self.abandoned > LANE_GRAPH_SLOTS - 2:
            return self._refused(
                f"{self.abandoned} lane graph(s) abandoned by clients that died hold the ranks' "
                f"graph slots ({LANE_GRAPH_SLOTS}); this replica serves the Serve path only until "
                "it is replaced"
            )
        self.waiting += 1
        self.waiting_tokens += max_tokens
        try:
            got = await self.group.hold(float(wait_s))
        finally:
            self.waiting -= 1
            self.waiting_tokens -= max_tokens
        if not got:
            who = self.active.client if self.active is not None else "a Serve forward"
            return self._refused(f"the group is held by {who} (waited {float(wait_s):.1f} s)")
        lease = Lease(f"{self.replica}:{next(self._ids)}:{uuid.uuid4().hex[:8]}", client, max_tokens,
                      time.time(), time.monotonic(), workers)
        try:
            await self.group.drop_graph()
            await asyncio.wait_for(
                asyncio.gather(*(w.lane_open.remote(lease.lease_id, client) for w in self.group.workers)),
                RANK_POLL_S,
            )
        except BaseException:
            self.group.unhold()
            raise
        self.active = lease
        self.granted += 1
        lease.watcher = asyncio.get_running_loop().create_task(self._watch(lease))
        logger.info("replica %s of %r leased its TP group to %s client %s (lease %s, term %.1f s)",
                    self.replica, spec.name, lease.to_dict()["kind"], client, lease.lease_id,
                    spec.lane_lease_s)
        return {
            "granted": True, "lease_id": lease.lease_id, "replica": self.replica, "deployment": spec.name,
            "ranks": list(self.group.workers), "world": self.group.world,
            "sequence_parallel": spec.sequence_parallel, "hidden_size": self.group.infos[0]["hidden_size"],
            "layers": list(self.group.resolved.layers), "dtype": spec.dtype, "max_tokens": max_tokens,
            "term_s": spec.lane_lease_s, "call_timeout_s": spec.bounds.call_s,
            "device": self.group.infos[0]["device"],
        }

    def _refused(self, reason: str) -> dict[str, Any]:
        return {"granted": False, "replica": self.replica, "reason": reason}

    # -- while leased ---------------------------------------------------------------------

    async def _watch(self, lease: Lease) -> None:
        term = self.spec().lane_lease_s
        silent_since: float | None = None
        how = "ended"
        try:
            while True:
                await asyncio.sleep(LANE_POLL_S)
                states = await asyncio.gather(
                    *(asyncio.wait_for(w.lane_state.remote(), RANK_POLL_S) for w in self.group.workers),
                    return_exceptions=True)
                dead = [r for r, st in enumerate(states) if isinstance(st, BaseException) and actor_died(st)]
                if dead:
                    how = "a rank died"
                    self.group.mark_broken(f"rank {dead[0]} died while leased to client {lease.client}: "
                                           f"{error_message(states[dead[0]])}")
                    return
                failed = [(r, st["failed"]) for r, st in enumerate(states)
                          if isinstance(st, dict) and st["failed"]]
                if failed:
                    # A forward failed on a rank (not on its input), or the client saw a call
                    # outlive its bound: the group's ranks may disagree on where they are.
                    how = "a call failed"
                    self.group.mark_broken(f"rank {failed[0][0]}: {failed[0][1]} (leased to client "
                                           f"{lease.client})")
                    return
                if isinstance(states[0], dict):
                    self._account(lease, states[0])
                    if states[0]["released"]:  # the client tore its graph down
                        how = "released"
                        return
                silent = [r for r, st in enumerate(states) if not isinstance(st, dict)]
                if silent:
                    # A stalled rank: the client's own calls time out; once a rank has not
                    # answered for a call bound, the group is unusable for everyone.
                    call_s = self.spec().bounds.call_s
                    silent_since = silent_since or time.monotonic()
                    if time.monotonic() - silent_since > call_s:
                        how = "a rank stopped answering"
                        self.group.mark_broken(f"rank {silent[0]} did not answer for {call_s:.0f} s while "
                                               f"leased to client {lease.client}")
                        return
                    continue
                silent_since = None
                # Nothing half-way: every rank finished the same calls and none is running one.
                idle = len({st["calls"] for st in states}) == 1 and not any(
                    st["in_flight_tokens"] for st in states)
                if states[0]["renew_age_s"] > term and idle and await self._expire(lease, term):
                    # The client renews every half term while it calls: it is gone or stuck.
                    # Its graph may still block one loop on every rank.
                    how = "expired"
                    return
                held_s = time.monotonic() - lease.granted_at
                if not lease.revoked and held_s >= term and (self.demand() or self.waiting):
                    lease.revoked = True
                    await asyncio.wait_for(
                        asyncio.gather(*(w.lane_revoke.remote(lease.lease_id) for w in self.group.workers)),
                        RANK_POLL_S,
                    )
                    logger.info("lane lease %s of %s not renewed: %s wait(s) for the group",
                                lease.lease_id, lease.client, self.demand() + self.waiting)
        except asyncio.CancelledError:
            how = "replica shutting down"
            raise
        except Exception as e:
            # The client may still be calling: the ranks are no longer exclusively its, so the
            # group cannot be trusted with anyone else's calls either.
            how = f"watcher failed: {error_message(e)}"
            logger.exception("lane lease %s: watcher failed", lease.lease_id)
            self.group.mark_broken(f"the lane lease watcher failed: {error_message(e)}")
        finally:
            await self._end(lease, how)

    async def _expire(self, lease: Lease, term: float) -> bool:
        # Rank 0 decides (atomically with renewals); the other ranks follow at close.
        return await asyncio.wait_for(self.group.workers[0].lane_expire.remote(lease.lease_id, term),
                                      RANK_POLL_S)

    def _account(self, lease: Lease, rank0: dict[str, Any]) -> None:
        new = {key: _increase(lease.counts.get(key, {}), rank0[key])
               for key in ("tails", "layer_forwards", "layer_requests", "layer_tokens", "batch_tokens")}
        if rank0["calls"] > lease.calls:
            self.stats.lease_forwards(
                forwards=rank0["forwards"] - lease.forwards, requests=rank0["requests"] - lease.requests,
                tokens=rank0["tokens"] - lease.tokens, seconds=rank0["busy_s"] - lease.busy_s, **new)
        lease.counts = {key: dict(rank0[key]) for key in new}
        lease.calls, lease.forwards, lease.requests = rank0["calls"], rank0["forwards"], rank0["requests"]
        lease.tokens, lease.busy_s = rank0["tokens"], rank0["busy_s"]
        lease.in_flight_tokens, lease.renew_age_s = rank0["in_flight_tokens"], rank0["renew_age_s"]
        self.abandoned = rank0["abandoned"]

    async def _end(self, lease: Lease, how: str) -> None:
        # Every rank must close the lease before the group serves anyone else: a rank that
        # does not answer within the collective timeout is stalled, and the group is broken
        # (the Serve path then answers 503 and retries elsewhere instead of running into it).
        bound_s = self.spec().bounds.close_s
        try:
            states = await asyncio.gather(
                *(asyncio.wait_for(w.lane_close.remote(lease.lease_id), bound_s) for w in self.group.workers),
                return_exceptions=True)
            if isinstance(states[0], dict):
                self._account(lease, states[0])
            silent = [r for r, st in enumerate(states) if not isinstance(st, dict)]
            if silent:
                self.group.mark_broken(f"rank {silent[0]} did not close lane lease {lease.lease_id} within "
                                       f"{bound_s:.0f} s: {error_message(states[silent[0]]) or 'timeout'}")
        finally:
            self.active = None
            self.history.append({**lease.to_dict(), "ended": how,
                                 "ended_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            self.group.unhold()
            logger.info("lane lease %s of %s ended (%s): %d call(s), %d token(s)",
                        lease.lease_id, lease.client, how, lease.calls, lease.tokens)

    # -- reads ----------------------------------------------------------------------------

    def queued_tokens(self) -> int:
        """Lane demand the autoscaler counts as queued: the call running now and every waiting
        lease request's tokens (a lane waiting for a group is unmet demand)."""
        running = self.active.in_flight_tokens if self.active is not None else 0
        return running + self.waiting_tokens

    def status(self) -> dict[str, Any]:
        return {
            "active": None if self.active is None else self.active.to_dict(),
            "waiting": self.waiting,
            "granted": self.granted,
            "term_s": self.spec().lane_lease_s,
            "abandoned_graphs": self.abandoned,
            "history": list(self.history),
        }

    def shutdown(self) -> None:
        if self.active is not None and self.active.watcher is not None:
            self.active.watcher.cancel()


def _increase(before: dict, after: dict) -> dict:
    """Per-key growth of a counter between two reads."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
