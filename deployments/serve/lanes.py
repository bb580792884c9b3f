"""Leases, the group side: a replica leases its TP group to one client at a time, a lane, a
cohort or the owner of a session, and opens the lease's data-plane session on its rank 0.

The per-layer path is the data plane (``deployments.dataplane``): the lease's peers connect to
rank 0 with the session's secret, send their rows per layer, and rank 0 runs one forward over
all of them on every rank (design section 9.2). The ranks run collectives that must see one call
order, so a group serves one lease at a time and nothing else meanwhile:

* :class:`LaneLeases` (the replica) grants a lease by taking the group's call lock: Serve
  forwards, the health collective and warm-up wait while it is held. It opens a session of the
  lease's number of peers on rank 0 and hands its ticket (address, secret, session number) out
  with the grant. It polls the ranks every ``LANE_POLL_S``: the lease's forwards, parts and
  tokens feed the replica's counters (``status()``, the autoscaler's tokens/s; waiting lease
  requests count as queued tokens); a dead rank, a failed forward, or a client's report that a
  call outlived its bound breaks the group (Serve replaces the replica); the lease ends when the
  client releases it, when its session ends (a peer died or stalled: every peer was told), or
  one term (``lane_lease_s``) after its last renewal. While a Serve request or another lease
  waits, a lease held a whole term is no longer renewed: its owner then takes the Serve path, so
  waits stay bounded.
* :class:`LaneSeat` (each rank) records the lease; rank 0 counts its forwards, tokens and
  renewals.
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
from ..dataplane.host import check_idle_after

MAX_LEASE_WAIT_S = 600.0
MAX_PEERS = 256  # peers of one session (each is a connection to rank 0)
HISTORY = 16  # ended leases kept for status()
RECENT_FORWARDS = 256  # a lease's last forwards' times, for status() (as the Serve path's)


@dataclass
class LaneSeat:
    """One rank's record of its group's lease (at most one)."""

    lease_id: str | None = None
    client: str = ""
    session: int | None = None  # the lease's data-plane session on rank 0
    revoked: bool = False
    released: bool = False
    renewed_at: float = 0.0  # time.monotonic() of the grant or the last renewal
    forwards: int = 0  # the session's forwards (rank 0; a layer whose peers all sent 0 rows runs none)
    steps: int = 0  # those forwards that started a step of the group (every part marked its step's start)
    requests: int = 0  # peers' parts with rows in those forwards (a cohort: one per worker)
    tokens: int = 0
    busy_s: float = 0.0
    in_flight_tokens: int = 0
    failed: str | None = None  # why this rank's lease call failed (not its input): the group breaks
    tails: Counter[str] = field(default_factory=Counter)  # tail -> lane forwards that ran it
    layer_forwards: Counter[int] = field(default_factory=Counter)
    layer_requests: Counter[int] = field(default_factory=Counter)
    layer_tokens: Counter[int] = field(default_factory=Counter)
    batch_tokens: Counter[str] = field(default_factory=Counter)  # "layer:tokens" of a forward -> forwards
    recent_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_FORWARDS))  # per forward

    def open(self, lease_id: str, client: str, session: int | None) -> None:
        self.lease_id, self.client, self.session = lease_id, client, session
        self.revoked = self.released = False
        self.renewed_at = time.monotonic()
        self.forwards = self.steps = self.requests = self.tokens = self.in_flight_tokens = 0
        self.busy_s = 0.0
        self.failed = None
        self.tails, self.layer_forwards, self.layer_tokens = Counter(), Counter(), Counter()
        self.layer_requests = Counter()
        self.batch_tokens = Counter()
        self.recent_ms.clear()

    def close(self, lease_id: str) -> None:
        if self.lease_id == lease_id:
            self.lease_id = self.session = None

    def count(self, session: int, layer: int, sizes: list[int], tail: str, seconds: float,
              new_step: bool) -> None:
        """Rank 0: a forward of ``session`` ran (counted when it is the lease's)."""
        if session != self.session:
            return
        tokens = sum(sizes)
        self.forwards += 1
        self.steps += new_step
        self.requests += len(sizes)
        self.tokens += tokens
        self.busy_s += seconds
        self.tails[tail] += 1
        self.layer_forwards[layer] += 1
        self.layer_requests[layer] += len(sizes)
        self.layer_tokens[layer] += tokens
        self.batch_tokens[f"{layer}:{tokens}"] += 1
        self.recent_ms.append(round(seconds * 1e3, 3))

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
        self.lease_id = self.session = None
        return True

    def release(self, lease_id: str) -> None:
        """The client is done with the lease."""
        if lease_id == self.lease_id:
            self.released = True

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
                "forwards": self.forwards, "steps": self.steps, "requests": self.requests,
                "tokens": self.tokens, "busy_s": self.busy_s, "failed": self.failed,
                "in_flight_tokens": self.in_flight_tokens,
                "tails": dict(self.tails), "layer_forwards": dict(self.layer_forwards),
                "layer_requests": dict(self.layer_requests),
                "layer_tokens": dict(self.layer_tokens), "batch_tokens": dict(self.batch_tokens),
                "recent_ms": list(self.recent_ms)}


@dataclass
class Lease:
    """The replica's view of the lease it granted."""

    lease_id: str
    client: str
    max_tokens: int
    since: float  # time.time() of the grant
    granted_at: float  # time.monotonic() of the grant
    workers: list[str] = field(default_factory=list)  # a cohort's attention workers (a lane: none)
    peers: int = 1
    session: int | None = None  # its data-plane session on rank 0
    revoked: bool = False
    forwards: int = 0
    steps: int = 0
    requests: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    in_flight_tokens: int = 0
    renew_age_s: float = 0.0
    counts: dict[str, dict] = field(default_factory=dict)  # rank 0's per-tail / per-layer counters
    watcher: asyncio.Task | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        kind = "cohort" if self.workers else "lane" if self.peers == 1 else "session"
        return {"client": self.client, "kind": kind, "peers": self.peers,
                "workers": list(self.workers), "lease_id": self.lease_id, "max_tokens": self.max_tokens,
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
                "session": self.session, "forwards": self.forwards, "steps": self.steps,
                "requests": self.requests,
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
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.granted = 0
        self._ids = itertools.count(1)

    # -- grant ----------------------------------------------------------------------------

    async def grant(self, client: str, max_tokens: Any, wait_s: Any,
                    workers: list[str] | None = None, peers: Any = 1,
                    idle_after_s: Any = None) -> dict[str, Any]:
        """Lease the group to ``client`` for a session of ``peers`` peers sending up to
        ``max_tokens`` rows each per layer (waiting up to ``wait_s`` for it; ``workers``: a
        cohort's attention workers, for ``status()``; ``idle_after_s``: an elastic session,
        ``dataplane.host``); a dict saying ``granted`` and, if so, the session's ticket for this
        group; else the reason."""
        spec = self.spec()
        if not isinstance(client, str) or not client.strip():
            raise ServeInputError(f"client must be a non-empty string, got {client!r}")
        workers = list(workers or [])
        if not all(isinstance(w, str) for w in workers):
            raise ServeInputError(f"workers must be a list of names, got {workers!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ServeInputError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if isinstance(peers, bool) or not isinstance(peers, int) or not 1 <= peers <= MAX_PEERS:
            raise ServeInputError(f"peers must be an integer in [1, {MAX_PEERS}], got {peers!r}")
        if peers * max_tokens > spec.max_tokens_per_request:
            what = (f"a cohort of {len(workers)} workers" if workers else
                    "a lane" if peers == 1 else "a session")
            raise TooLargeError(
                f"{what} of {peers} peer(s) x max_tokens {max_tokens} = {peers * max_tokens} rows per "
                f"forward exceeds max_tokens_per_request = {spec.max_tokens_per_request} of deployment "
                f"{spec.name!r}"
            )
        try:
            check_idle_after(idle_after_s, spec.bounds.call_s)
        except ValueError as e:
            raise ServeInputError(str(e)) from None
        number = isinstance(wait_s, int | float) and not isinstance(wait_s, bool)
        if not number or not 0 <= wait_s <= MAX_LEASE_WAIT_S:
            raise ServeInputError(
                f"wait_s must be a number of seconds in [0, {MAX_LEASE_WAIT_S:.0f}], got {wait_s!r}"
            )
        if not spec.lanes:
            return self._refused(f"deployment {spec.name!r} has lanes: false")
        self.group.check_usable()
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
                      time.time(), time.monotonic(), workers, peers)
        rank0 = self.group.workers[0]
        try:
            # Each part is held to the deployment's live max_tokens_per_request, as a Serve
            # request is (max_tokens above only reserved the group for this many rows).
            opened = rank0.session_open.remote(peers, None, lease.lease_id, idle_after_s)
            ticket = await asyncio.wait_for(opened, RANK_POLL_S)
            lease.session = ticket["session"]
            await asyncio.wait_for(
                asyncio.gather(*(w.lane_open.remote(lease.lease_id, client, lease.session)
                                 for w in self.group.workers)),
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
            "ranks": list(self.group.workers), "world": self.group.world, "peers": peers,
            "hidden_size": self.group.infos[0]["hidden_size"],
            "layers": list(self.group.resolved.layers), "dtype": spec.dtype, "max_tokens": max_tokens,
            "term_s": spec.lane_lease_s, "call_timeout_s": spec.bounds.call_s,
            "device": self.group.infos[0]["device"], **ticket,
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
                    if states[0]["released"]:  # the client is done with it
                        how = "released"
                        return
                    session = states[0]["session"]
                    if session is not None and session["ended"]:  # every peer was told why
                        how = f"its session ended ({session['failure']}: {session['ended']})"
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
                # Nothing half-way: no rank is running a forward.
                idle = not any(st["in_flight_tokens"] for st in states)
                if states[0]["renew_age_s"] > term and idle and await self._expire(lease, term):
                    # The client renews every half term while it calls: it is gone or stuck.
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
        forwards = rank0["forwards"] - lease.forwards
        if forwards > 0:
            self.stats.lease_forwards(
                forwards=forwards, steps=rank0["steps"] - lease.steps,
                requests=rank0["requests"] - lease.requests, tokens=rank0["tokens"] - lease.tokens,
                seconds=rank0["busy_s"] - lease.busy_s,
                recent_ms=rank0["recent_ms"][-forwards:], **new)
        lease.counts = {key: dict(rank0[key]) for key in new}
        lease.forwards, lease.steps, lease.requests = rank0["forwards"], rank0["steps"], rank0["requests"]
        lease.tokens, lease.busy_s = rank0["tokens"], rank0["busy_s"]
        lease.in_flight_tokens, lease.renew_age_s = rank0["in_flight_tokens"], rank0["renew_age_s"]

    async def _end(self, lease: Lease, how: str) -> None:
        # Every rank must close the lease before the group serves anyone else: a rank that
        # does not answer within the collective timeout is stalled, and the group is broken
        # (the Serve path then answers 503 and retries elsewhere instead of running into it).
        bound_s = self.spec().bounds.close_s
        try:
            states = await asyncio.gather(
                *(asyncio.wait_for(w.lane_close.remote(lease.lease_id, f"the lease ended: {how}"), bound_s)
                  for w in self.group.workers),
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
            logger.info("lease %s of %s ended (%s): %d forward(s), %d token(s)",
                        lease.lease_id, lease.client, how, lease.forwards, lease.tokens)

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
            "history": list(self.history),
        }

    def shutdown(self) -> None:
        if self.active is not None and self.active.watcher is not None:
            self.active.watcher.cancel()


def _increase(before: dict, after: dict) -> dict:
    """Per-key growth of a counter between two reads."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
