"""Sessions, the replica's side: open them on the group's rank 0, hear of them, report them live.

A client (a lane, a cohort, or the opener of a session of independent peers: ``deployments.client``)
asks a replica for a session of ``peers`` peers sending up to ``max_tokens`` rows each per layer.
:class:`GroupSessions` admits it or says why not, and opens it on rank 0 (``dataplane.host``); the
answer carries that group's part of the session's ticket. Nothing else happens on the replica
while the session lives:

* **Shared.** A group serves every open session and the Serve path at once (rank 0 runs their
  ready layers in arrival order, same-layer parts as one forward). Nothing is held, nothing is
  revoked because others wait.
* **Admission.** Refused at open, with the arithmetic: ``peers x max_tokens`` over the rows one
  forward takes (``max_tokens_per_request``), more open sessions than ``max_sessions``, or
  ``lanes: false``.
* **Lasting.** No term, no renewal: a session ends when its opener closes it (on rank 0, by its
  number), or ``linger_s`` after its last peer left, or when the group fails.
* **Pushed, not polled.** Rank 0 pushes each session's end and its changed counts (at most every
  ``EVENTS_PUSH_S``, nothing while idle) on the replica's watch connection (``serve.group``);
  they feed the replica's counters, metrics and the autoscaler's tokens/s.
* **Live.** :meth:`GroupSessions.status` reads rank 0 at the moment of the call: every open
  session's peers, layers, forwards, rows and the group's busy fraction, exact; a session rank 0
  has ended is in the history at that read, even while its pushed end is still on its way.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from .. import logger
from ..cluster import moves
from ..common.errors import ServeInputError, TooLargeError, error_message
from ..config.timeouts import MAX_LINGER_S, RANK_POLL_S
from ..dataplane.errors import Failure
from ..dataplane.steps import check_idle_after

MOVES_ON = (Failure.GROUP_FAILED.value, Failure.GROUP_TIMEOUT.value)  # its peers take it elsewhere
MAX_PEERS = 256  # peers of one session (each is a connection to rank 0)
HISTORY = 16  # ended sessions kept for status()


def _positive_int(name: str, value: Any, upper: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper and value > upper):
        bound = f"[1, {upper}]" if upper else ">= 1"
        raise ServeInputError(f"{name} must be an integer {bound}, got {value!r}")
    return value


class GroupSessions:
    """The replica's sessions (see the module doc). ``group``: the replica's ``TPGroup``;
    ``spec``: returns the live deployment spec; ``stats``: the replica's ``ReplicaStats``."""

    def __init__(self, group: Any, spec: Callable[[], Any], stats: Any, replica: str):
        self.group, self.spec, self.stats, self.replica = group, spec, stats, replica
        self.open_now: dict[int, dict[str, Any]] = {}  # session number -> what the replica knows
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.opened = 0
        self._ids = itertools.count(1)
        self._last: dict[str, Any] = {}  # the clients' sessions' counts (``served``) last accounted
        self._joined: dict[int, int] = {}  # open session -> its peers connected, as last heard
        self._busy = 0.0

    # -- open -----------------------------------------------------------------------------

    async def open(self, client: str, max_tokens: Any, peers: Any = 1, idle_after_s: Any = None,
                   linger_s: Any = None, workers: list[str] | None = None) -> dict[str, Any]:
        """A session for ``client`` of ``peers`` peers sending up to ``max_tokens`` rows each per
        layer (``workers``: a cohort's attention workers, for ``status()``; ``idle_after_s``: an
        elastic session; ``linger_s``: its own linger, default the spec's): ``{"granted": True,
        ...}`` with the session's ticket for this group, or ``{"granted": False, "reason": ...}``."""
        spec = self.spec()
        if not isinstance(client, str) or not client.strip():
            raise ServeInputError(f"client must be a non-empty string, got {client!r}")
        workers = list(workers or [])
        if not all(isinstance(w, str) for w in workers):
            raise ServeInputError(f"workers must be a list of names, got {workers!r}")
        max_tokens = _positive_int("max_tokens", max_tokens)
        peers = _positive_int("peers", peers, MAX_PEERS)
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
        linger = spec.session_linger_s if linger_s is None else linger_s
        number = isinstance(linger, int | float) and not isinstance(linger, bool)
        if not number or not 0 < linger <= MAX_LINGER_S:
            raise ServeInputError(f"linger_s must be seconds in (0, {MAX_LINGER_S:.0f}], got {linger_s!r}")
        if not spec.lanes:
            return self._refused(f"deployment {spec.name!r} has lanes: false (the Serve path only)")
        self.group.check_usable()
        session_id = f"{self.replica}:{next(self._ids)}:{uuid.uuid4().hex[:8]}"
        try:
            ticket = await asyncio.wait_for(self.group.workers[0].session_open.remote(
                peers, None, session_id, idle_after_s, float(linger), spec.max_sessions), RANK_POLL_S)
        except ValueError as e:  # over max_sessions: rank 0 counts them exactly
            return self._refused(f"{error_message(e)} (deployment {spec.name!r})")
        kind = "cohort" if workers else "lane" if peers == 1 else "session"
        self.open_now[ticket["session"]] = {
            "session": ticket["session"], "id": session_id, "client": client, "kind": kind, "peers": peers,
            "workers": workers, "max_tokens": max_tokens, "elastic": idle_after_s is not None,
            "linger_s": float(linger), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.opened += 1
        self._gauges()
        logger.info("replica %s of %r opened %s %s for client %s (%d peer(s) x %d rows, linger %g s)",
                    self.replica, spec.name, kind, session_id, client, peers, max_tokens, linger)
        return {
            "granted": True, "session_id": session_id, "replica": self.replica, "deployment": spec.name,
            "ranks": list(self.group.workers), "world": self.group.world, "peers": peers,
            "hidden_size": self.group.infos[0]["hidden_size"],
            "layers": list(self.group.resolved.layers), "dtype": spec.dtype, "max_tokens": max_tokens,
            "linger_s": float(linger), "call_timeout_s": spec.bounds.call_s,
            "device": self.group.infos[0]["device"], **ticket,
        }

    def _refused(self, reason: str) -> dict[str, Any]:
        return {"granted": False, "replica": self.replica, "reason": reason}

    # -- events (serve.group.Watcher) ------------------------------------------------------

    def on_event(self, event: dict[str, Any]) -> None:
        """Rank 0's pushed counts and ends (on the replica's event loop)."""
        kind = event["event"]
        if kind == "counts":
            self._account(event["served"])
            self._joined.update({int(n): st["joined"] for n, st in event["sessions"].items()})
            self._busy = event["busy_fraction"]
        elif kind == "ended":
            self._ended(event["session"], event["state"])
        self._gauges()

    def _ended(self, number: int, state: dict[str, Any]) -> None:
        """Session ``number`` ended on rank 0 with ``state``: into the history (once: its pushed end
        and a status read that saw it ended first may both bring it)."""
        known = self.open_now.pop(number, None)
        self._joined.pop(number, None)
        if known is not None:
            self.history.append({**known, **_public(state),
                                 "ended_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            if state.get("failure") not in MOVES_ON:  # over for good: no move finds it
                asyncio.get_running_loop().run_in_executor(
                    None, moves.forget, known["client"], self.spec().name, known["id"])

    def _gauges(self) -> None:
        joined = sum(n for number, n in self._joined.items() if number in self.open_now)
        self.stats.sessions(len(self.open_now), joined, self._busy)

    def _account(self, served: dict[str, Any]) -> None:
        """The growth of the clients' sessions' counts (each forward once, however many sessions
        shared it) since the last account, into the replica's counters."""
        before = self._last
        if served["forwards"] > before.get("forwards", 0):
            grown = {key: _increase(before.get(key, {}), served[key])
                     for key in ("tails", "layer_forwards", "layer_parts", "layer_rows", "batches")}
            grew = {key: served[key] - before.get(key, 0)
                    for key in ("forwards", "steps", "parts", "rows", "busy_s")}
            self.stats.session_forwards(forwards=grew["forwards"], steps=grew["steps"],
                                        requests=grew["parts"], tokens=grew["rows"], seconds=grew["busy_s"],
                                        **grown)
            self._last = served

    # -- reads ----------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """Every open session as rank 0 has it now (exact), the group's counters and busy fraction,
        and the last ended sessions."""
        snap = await asyncio.wait_for(self.group.workers[0].sessions_snapshot.remote(), RANK_POLL_S)
        self._account(snap["served"])  # the replica's counters exact at this read too
        for number, state in snap["ended"].items():  # ended, its pushed end not here yet
            self._ended(int(number), state)
        sessions = [{**self.open_now[int(n)], **_public(state)} for n, state in snap["sessions"].items()
                    if int(n) in self.open_now]
        self._joined = {int(n): state["joined"] for n, state in snap["sessions"].items()}
        self._busy = snap["group"]["busy_fraction"]
        self._gauges()
        group = snap["group"]
        return {"open": sessions, "opened": self.opened, "max_sessions": self.spec().max_sessions,
                "group": {"forwards": group["forwards"], "rows": group["rows"], "busy_s": group["busy_s"],
                          "recent_ms": group["recent_ms"],
                          "rows_per_forward": round(group["rows"] / group["forwards"], 2) if group["forwards"]
                          else None, "busy_fraction": group["busy_fraction"]},
                "history": list(self.history)}

    def rows_per_step(self) -> int:
        """The rows the open sessions may send per layer: the load a new session's choice of
        replica and the router weigh."""
        return sum(s["peers"] * s["max_tokens"] for s in self.open_now.values())


def _public(state: dict[str, Any]) -> dict[str, Any]:
    """A session's state as ``status()`` shows it."""
    keys = ("joined", "layers", "forwards", "steps", "parts", "rows", "busy_s", "waiting_for", "active",
            "parked", "idled", "ended", "failure")
    out = {k: state[k] for k in keys if k in state}
    out["rows_per_forward"] = round(state["rows"] / state["forwards"], 2) if state.get("forwards") else None
    return out


def _increase(before: dict, after: dict) -> dict:
    """Per-key growth of a counter between two reads."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
