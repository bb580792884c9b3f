"""The ranks' side of the data plane: rank 0 gathers every session's peers, the group forwards.

Rank 0 of a TP group runs a :class:`GroupHost`: one listening socket on its node's address, one
thread that waits in ``select`` (a blocking wait: an idle host costs no CPU) and a short-lived
thread per new connection for its handshake (``frames.admit``). The other ranks each keep one
connection to rank 0 (:class:`RankLink`), admitted with the group's own secret when the group
starts; rank 0 sends them every batch in the order it runs them, so the group's collectives see
one call order whoever the batches came from.

A *session* is opened on rank 0 by the replica (for a client, or for its own Serve-path batches):
a fresh secret and a fixed number of peers. Each peer connects once, admitted by the session's
secret and its index, and sends each MoE layer's rows. Every open session is served at once;
nothing holds the group.

**Rules apart from sockets.** What a layer waits for, when it is ready, which ready layers share
a forward, and when a peer is parked, dropped or its session ended -- strict and elastic
sessions, admission, stall and linger timers, the fairness rule -- are ``steps.StepRules``, a
pure object (its module doc says the rules). The loop here only feeds it: it reads frames, passes
them and the time in, and performs what comes back (answer, tell, close); it also checks each
part (``Compute.check``), runs the forward on every rank and counts.

**Liveness without calls:** while no batch runs, rank 0 pings every other rank after
``HEARTBEAT_S``; a rank that does not answer within the rest of the call bound breaks the group
(``GROUP_TIMEOUT``), one whose link closed breaks it at once (``GROUP_FAILED``). A broken group
ends every session and refuses new ones. **Push:** the replica connects as a *watcher* (the
group's secret) and hears every session's end, the group's failure, and changed session counts
at most every ``EVENTS_PUSH_S``; nothing is sent while idle.

Pure: no Ray, no torch (the rank's ``compute`` object brings the forward).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..common.wire import VIEW_AS, DeviceRows, Rows, WireTensor, concat_rows, join_rank_outputs
from ..config.timeouts import DRAIN_S, EVENTS_PUSH_S, HEARTBEAT_S
from . import frames
from .errors import Failure
from .frames import Frame, Kind, Role
from .steps import Effect, End, Part, SessionSteps, StepRules, Taken, check_open

logger = logging.getLogger(__name__)

ACCEPT_BACKLOG = 64
ENDED_KEPT = 64  # ended sessions whose last state rank 0 still answers for
RECENT_FORWARDS = 256  # group forwards whose times rank 0 keeps (status: forward_ms.recent)


class Compute(Protocol):
    """What a rank brings: the checks and the forward (``serve.worker.TPWorker``)."""

    def check(self, layer: int, x: WireTensor, logits: np.ndarray | None, max_tokens: int | None,
              what: str) -> tuple[int, WireTensor, np.ndarray | None]:
        """The checked part (ValueError naming what is wrong); ``max_tokens``: the session's limit
        per part, None: the rank's own (live) limit."""

    def run(self, layer: int, x: WireTensor, logits: np.ndarray | None) -> tuple[WireTensor | None, str]:
        """One forward on this rank: ``(out, tail)`` (``out`` None on ranks > 0 unless sequence
        parallel)."""

    def forward_limit(self) -> int:
        """The most rows one forward may take (the deployment's live limit): ready layers of
        several sessions share a forward only within it."""


@dataclass
class Counts:
    """A session's (or the whole group's) forwards so far, as rank 0 counted them."""

    forwards: int = 0  # forwards its rows took part in (a layer whose parts all had 0 rows: none)
    steps: int = 0  # forwards that started a step (every part marked ``frames.NEW_STEP``)
    parts: int = 0  # peers' parts in them
    rows: int = 0
    busy_s: float = 0.0  # the forwards' time (a shared forward counts whole for each session in it)
    tails: Counter[str] = field(default_factory=Counter)
    layer_forwards: Counter[int] = field(default_factory=Counter)
    layer_parts: Counter[int] = field(default_factory=Counter)
    layer_rows: Counter[int] = field(default_factory=Counter)
    batches: Counter[str] = field(default_factory=Counter)  # "layer:rows" of each forward -> forwards

    def add(self, layer: int, sizes: list[int], tail: str, seconds: float, new_step: bool,
            batch_rows: int | None = None) -> None:
        """One forward: ``sizes`` the counted parts' rows; ``batch_rows``: the whole forward's rows
        (other sessions' too; default: these parts')."""
        rows = sum(sizes)
        self.forwards += 1
        self.steps += new_step
        self.parts += len(sizes)
        self.rows += rows
        self.busy_s += seconds
        self.tails[tail] += 1
        self.layer_forwards[layer] += 1
        self.layer_parts[layer] += len(sizes)
        self.layer_rows[layer] += rows
        self.batches[f"{layer}:{rows if batch_rows is None else batch_rows}"] += 1

    def to_dict(self) -> dict[str, Any]:
        return {"forwards": self.forwards, "steps": self.steps, "parts": self.parts, "rows": self.rows,
                "busy_s": round(self.busy_s, 6), "tails": dict(self.tails),
                "layer_forwards": dict(self.layer_forwards), "layer_parts": dict(self.layer_parts),
                "layer_rows": dict(self.layer_rows), "batches": dict(self.batches)}


@dataclass(eq=False)
class HostedSession:
    """Rank 0's side of one session: its step rules' state (``steps``) and what the socket loop
    keeps for it (connections, device channels, counts)."""

    steps: SessionSteps
    secret: str
    max_tokens: int | None  # rows per part; None: the rank's own limit
    sockets: list[socket.socket | None] = field(default_factory=list)
    channels: dict[int, Any] = field(default_factory=dict)  # peer -> its device channel (``channel``)
    counts: Counts = field(default_factory=Counts)
    layers: int = 0  # layers answered

    @property
    def number(self) -> int:
        return self.steps.number

    @property
    def name(self) -> str:
        return self.steps.name

    @property
    def ended(self) -> str | None:
        return self.steps.ended

    @property
    def held(self) -> dict[int, Part]:
        return self.steps.held

    def state(self) -> dict[str, Any]:
        steps = self.steps
        return {"session": steps.number, "name": steps.name, "peers": steps.peers, "joined": steps.joined(),
                "layers": self.layers, "waiting_for": steps.waiting_for(), "elastic": steps.elastic,
                "active": sorted(steps.active) if steps.elastic else None, "parked": steps.parked,
                "idled": steps.idled, "ended": steps.ended,
                "failure": None if steps.failure is None else steps.failure.value,
                "max_tokens": self.max_tokens, "linger_s": steps.linger_s, **self.counts.to_dict()}


@dataclass
class Prepared:
    """A ready layer of one session, checked: the parts that run and what each peer is answered."""

    session: HostedSession
    layer: int
    peers: list[int]
    parts: dict[int, Part]
    checked: dict[int, Any]  # peer -> (layer, rows, logits), or the Exception that refused it
    good: list[tuple[int, Any]]  # (peer, checked part) with rows
    new_step: bool


class GroupHost:
    """Rank 0's data plane (see the module doc). ``bind_ip``: the node's address; ``world``: the
    group's ranks; ``call_s``: the group's call bound (a layer's peers, and a forward)."""

    def __init__(self, bind_ip: str, group_secret: str, world: int, compute: Compute, call_s: float,
                 hidden_size: int, dtype: str, name: str = "group", channel_device: str | None = None,
                 heartbeat_s: float = HEARTBEAT_S):
        self.group_secret, self.world, self.compute, self.call_s = group_secret, world, compute, call_s
        self.heartbeat_s = heartbeat_s
        self.channel_device, self.channel_backend, self.store_port = channel_device, "", 0
        self._store: Any = None
        if channel_device is not None:  # peers may send rows over device channels (``channel``)
            from .channel import ChannelStore, backend_for, check_backend

            backend = backend_for(channel_device)
            with contextlib.suppress(ValueError):  # a torch without NCCL: no channel is offered
                check_backend(backend)
                self._store = ChannelStore(bind_ip, call_s)
                self.channel_backend, self.store_port = backend, self._store.port
        self.hidden_size, self.dtype, self.name = hidden_size, dtype, name
        self.rules = StepRules(call_s)  # what runs when, and who is told what (``steps``)
        self.sessions: dict[int, HostedSession] = {}
        self.ended: dict[int, dict[str, Any]] = {}  # ended sessions' last states, by number
        self.by_secret: dict[str, HostedSession] = {}
        self.ended_secrets: dict[str, int] = {}  # ended sessions' secrets: a late join is told "ended"
        self.links: dict[int, socket.socket] = {}
        self.watchers: list[socket.socket] = []
        self.group = Counts()  # every forward the group ran
        self.served = Counts()  # clients' sessions' parts (not the replica's own), each forward once
        self.recent_ms: deque[float] = deque(maxlen=RECENT_FORWARDS)
        self.started_at = time.monotonic()
        self.forward_since: float | None = None  # a forward runs since (time.monotonic())
        self._done_owed = False  # the other ranks' DONEs of the last batch are still to be read
        self._beat_at = time.monotonic() + heartbeat_s
        self._dirty: set[int] = set()  # sessions whose counts changed since the last push
        self._pushed_at = 0.0
        self.linked = threading.Event()
        if world == 1:
            self.linked.set()
        self._numbers = iter(range(1, 1 << 30))
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._closing: dict[socket.socket, float] = {}  # ended sessions' sockets -> drain deadline
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self.listener = socket.create_server((bind_ip, 0), backlog=ACCEPT_BACKLOG)
        self.address: tuple[str, int] = (bind_ip, self.listener.getsockname()[1])
        self._threads = [threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True),
                         threading.Thread(target=self._loop, name=f"{name}-dataplane", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def failed(self) -> str | None:
        """Why the group's data plane broke (None: it did not)."""
        return self.rules.failed

    @property
    def failure(self) -> Failure | None:
        return self.rules.failure

    # -- called from other threads --------------------------------------------------------

    def wait_ranks(self, timeout_s: float) -> None:
        if not self.linked.wait(timeout_s):
            raise TimeoutError(f"{len(self.links)} of {self.world - 1} other rank(s) linked to rank 0 "
                               f"within {timeout_s:.0f} s")

    def open(self, peers: int, max_tokens: int | None, name: str, idle_after_s: float | None = None,
             linger_s: float | None = None, max_sessions: int | None = None) -> tuple[int, str]:
        """A new session of ``peers`` peers: its number and secret (the peers' ticket).
        ``idle_after_s``: None, every peer takes part in every layer; a number, an elastic
        session (``steps``). ``linger_s``: it ends once no peer was connected this long
        (None: only when closed). ``max_sessions``: refuse it when that many are open (None: the
        replica's own session, never refused or counted)."""
        check_open(peers, idle_after_s, linger_s, self.call_s)
        steps = SessionSteps(next(self._numbers), peers, name, self.call_s, idle_after_s, linger_s,
                             internal=max_sessions is None, alone_since=time.monotonic())
        session = HostedSession(steps, frames.new_secret(), max_tokens, [None] * peers)
        self._call(lambda: self._add(session, max_sessions))
        return session.number, session.secret

    def close(self, number: int, reason: str, wait_s: float) -> dict[str, Any] | None:
        """End session ``number`` (its peers get ``reason`` as SESSION_ENDED); its last state."""
        return self._call(lambda: self._end_number(number, Failure.SESSION_ENDED, reason), wait_s)

    def fail(self, reason: str, wait_s: float) -> None:
        """Break the group on purpose (its replica is stopping): every session ends as
        ``GROUP_FAILED`` with ``reason``, so its peers move. On the loop thread, between batches:
        every peer of the last forward has its answer, and the moved peers meet on one layer."""
        self._call(lambda: self._fail_group(Failure.GROUP_FAILED, reason), wait_s)

    def state(self, number: int) -> dict[str, Any] | None:
        session = self.sessions.get(number)
        return session.state() if session is not None else self.ended.get(number)

    def snapshot(self, wait_s: float) -> dict[str, Any]:
        """Every open session's state, the last ended ones', and the group's counters, read on the
        loop thread between forwards: exact at the moment of reading."""
        return self._call(self._snapshot, wait_s)

    def health(self) -> dict[str, Any]:
        """Why the group's data plane broke (None: it did not), and how long the forward under
        way has run (a stuck forward stops the loop thread, so this reads without it)."""
        since = self.forward_since
        return {"failed": self.failed, "failure": None if self.failure is None else self.failure.value,
                "forward_running_s": None if since is None else round(time.monotonic() - since, 3)}

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        with contextlib.suppress(OSError):
            self.listener.close()
        self._wake()
        for t in self._threads:
            t.join(timeout=DRAIN_S)

    def _call(self, fn: Callable[[], Any], wait_s: float | None = None) -> Any:
        """Run ``fn`` on the loop thread (which owns every socket and session) and return its value."""
        wait_s = self.call_s if wait_s is None else wait_s
        done, out = threading.Event(), {}

        def run() -> None:
            try:
                out["value"] = fn()
            except BaseException as e:  # handed back to the caller
                out["error"] = e
            finally:
                done.set()

        self._commands.put(run)
        self._wake()
        if not done.wait(wait_s):
            raise TimeoutError(f"the data plane of {self.name} did not answer within {wait_s:.0f} s")
        if "error" in out:
            raise out["error"]
        return out.get("value")

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    # -- admission ------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock,), name=f"{self.name}-admit", daemon=True).start()

    def _admit(self, sock: socket.socket) -> None:
        try:
            role, index, secret = frames.admit(sock, self._secrets)
        except PermissionError:
            frames.refuse(sock, "secret")  # a wrong ticket: it joins nothing, and is told so
            return
        except (OSError, ValueError, frames.ConnectionLost):
            sock.close()  # a stray connection: it joins nothing
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._commands.put(lambda: self._attach(role, index, secret, sock))
        self._wake()

    def _secrets(self) -> list[str]:
        return [self.group_secret, *list(self.by_secret), *list(self.ended_secrets)]

    def _attach(self, role: Role, index: int, secret: str, sock: socket.socket) -> None:
        rank_ok = secret == self.group_secret and 0 < index < self.world and index not in self.links
        if role is Role.RANK and rank_ok:
            frames.welcome(sock)
            sock.settimeout(self.call_s)  # a batch's send and its DONE: within the call bound
            self.links[index] = sock
            if len(self.links) == self.world - 1:
                self.linked.set()
            return
        if role is Role.WATCH and secret == self.group_secret:
            frames.welcome(sock)
            sock.settimeout(self.call_s)
            self.watchers.append(sock)
            self._selector.register(sock, selectors.EVENT_READ, "watcher")
            if self.failed is not None:
                self._push({"event": "failed", "failure": self.failure.value, "reason": self.failed})
            return
        session = self.by_secret.get(secret)
        if role is not Role.PEER or session is None or session.ended:
            frames.refuse(sock, "ended" if secret in self.ended_secrets or session is not None else "secret")
            return
        refused = self.rules.join(session.steps, index)
        if refused is not None:
            frames.refuse(sock, refused)
            return
        frames.welcome(sock)
        sock.settimeout(self.call_s)  # a peer stopped half-way through a message stalls nothing longer
        session.sockets[index] = sock
        self._selector.register(sock, selectors.EVENT_READ, (session, index))

    # -- the loop -------------------------------------------------------------------------

    def _add(self, session: HostedSession, max_sessions: int | None) -> None:
        self.rules.admit(session.steps, max_sessions)
        self.sessions[session.number] = session
        self.by_secret[session.secret] = session

    def _busy_fraction(self) -> float:
        elapsed = time.monotonic() - self.started_at
        return round(self.group.busy_s / elapsed, 4) if elapsed > 0 else 0.0

    def _snapshot(self) -> dict[str, Any]:
        # "ended": the last ended sessions' states, so that a reader whose pushed end is still on its
        # way sees the session ended, not gone
        return {"sessions": {n: s.state() for n, s in self.sessions.items()}, "ended": dict(self.ended),
                "served": self.served.to_dict(),
                "group": {**self.group.to_dict(), "recent_ms": list(self.recent_ms),
                          "busy_fraction": self._busy_fraction()},
                **self.health()}

    def _loop(self) -> None:
        try:
            self._serve()
        except Exception as e:  # a bug here must not leave peers waiting: everyone hears of it
            logger.exception("data plane of %s failed", self.name)
            with contextlib.suppress(Exception):
                self._fail_group(Failure.GROUP_FAILED,
                                 f"the data plane's thread on rank 0 failed: {type(e).__name__}: {e}")

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0 if self.rules.ready else self._next_deadline()):
                if key.data is None:
                    self._drain_wake()
                elif key.data == "closing":
                    self._drain_closed(key.fileobj)
                elif key.data == "watcher":
                    self._drop_watcher(key.fileobj)
                else:
                    session, index = key.data
                    if session.sockets[index] is key.fileobj:
                        self._read(session, index)
                    else:  # its session ended earlier in this round
                        self._drain_closed(key.fileobj)
            if self.rules.ready:
                self._run_ready()
            self._check_stalls()
            self._check_ranks()
            self._push_counts()
        for session in list(self.sessions.values()):
            self._end(session, Failure.SESSION_ENDED, "the rank is shutting down")

    def _next_deadline(self) -> float | None:
        now = time.monotonic()
        deadlines = list(self._closing.values())
        rules_at = self.rules.next_deadline()
        if rules_at is not None:
            deadlines.append(rules_at)
        if self.world > 1 and self.failed is None:
            deadlines.append(self._beat_at)
        if self._dirty and self.watchers:
            deadlines.append(self._pushed_at + EVENTS_PUSH_S)
        return None if not deadlines else max(0.0, min(deadlines) - now)

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _read(self, session: HostedSession, index: int) -> None:
        sock = session.sockets[index]
        try:
            frame = frames.recv(sock)
            logits = frames.recv(sock) if frame.flags & frames.WITH_LOGITS else None
        except TimeoutError:
            self._fault(session, index, Failure.PEER_STALLED, f"peer {index} of session {session.name!r} "
                        f"stopped half-way through a message for {self.call_s:.0f} s")
            return
        except (frames.ConnectionLost, OSError) as e:
            self._fault(session, index, Failure.PEER_GONE, f"peer {index} of session {session.name!r} "
                        f"closed its connection ({e})")
            return
        if frame.kind is Kind.CHANNEL and index not in session.channels:
            self._open_channel(session, index, frame)
            return
        if frame.channel is not None and not self._pull(session, index, frame):
            return
        self._perform(self.rules.receive(session.steps, index, (frame, logits), time.monotonic()))

    def _open_channel(self, session: HostedSession, index: int, frame: Frame) -> None:
        """Rank 0's side of peer ``index``'s device channel (the peer builds its own meanwhile)."""
        from .channel import Channel

        try:
            if self._store is None:
                raise ValueError("this group offers no device channel")
            prefix = f"{session.number}/{index}/{frame.meta()['key']}"
            session.channels[index] = Channel(self.channel_backend, "", 0, prefix, 0, self.channel_device,
                                              self.call_s, self._store)
        except (ValueError, KeyError, RuntimeError) as e:
            self._fault(session, index, Failure.PEER_FAILED, f"peer {index} of session {session.name!r}: "
                        f"its device channel could not be opened ({e})")

    def _pull(self, session: HostedSession, index: int, frame: Frame) -> bool:
        """A FORWARD's rows from its peer's device channel into ``frame.data``; False: the peer was
        dropped (no channel, or the channel failed)."""
        channel = session.channels.get(index)
        try:
            if channel is None:
                raise RuntimeError("it opened no device channel")
            frame.data = channel.recv(*frame.channel)
            return True
        except RuntimeError as e:
            self._fault(session, index, Failure.PEER_GONE, f"peer {index} of session {session.name!r} sent "
                        f"layer {frame.layer}'s rows on its device channel, which failed: {e}")
            return False

    def _fault(self, session: HostedSession, index: int, failure: Failure, reason: str) -> None:
        """A peer's own fault: a strict session ends for all; an elastic one drops that peer alone."""
        self._perform(self.rules.fault(session.steps, index, failure, reason, time.monotonic()))

    def _perform(self, effects: list[Effect]) -> None:
        """Carry out what the step rules decided, in their order."""
        for effect in effects:
            session = self.sessions[effect.number]
            if isinstance(effect, End):
                self._finish(session, effect)
                continue
            sock = session.sockets[effect.peer]
            if sock is not None:
                self._close_peer(sock, frames.error_text(effect.failure.value, effect.reason, effect.peer))
                session.sockets[effect.peer] = None
            self._close_channel(session, effect.peer)
            logger.info("data plane of %s: %s", self.name, effect.reason)

    def _check_stalls(self) -> None:
        now = time.monotonic()
        self._perform(self.rules.tick(now))
        for sock, deadline in list(self._closing.items()):
            if now >= deadline:
                self._forget(sock)

    # -- liveness and events ---------------------------------------------------------------

    def _check_ranks(self) -> None:
        """Heartbeat: with no batch for ``heartbeat_s``, every other rank must answer a PING within
        the rest of the call bound; else the group is broken (with no layer in flight)."""
        if self.world == 1 or self.failed is not None or not self.linked.is_set() \
                or time.monotonic() < self._beat_at:
            return
        rank = 0
        try:
            self._collect_done()
            for rank in range(1, self.world):
                frames.send(self.links[rank], Kind.PING)
            for rank in range(1, self.world):
                link = self.links[rank]
                link.settimeout(max(self.call_s - self.heartbeat_s, 0.1))
                try:
                    pong = frames.recv(link)
                finally:
                    link.settimeout(self.call_s)
                if pong.kind is not Kind.PONG:
                    raise RuntimeError(f"it answered a heartbeat with a {pong.kind.name} message")
        except TimeoutError:
            self._fail_group(Failure.GROUP_TIMEOUT, f"rank {rank} did not answer rank 0's heartbeat within "
                             f"{self.call_s - self.heartbeat_s:.0f} s: it is stalled")
            return
        except (frames.ConnectionLost, OSError, RuntimeError) as e:
            self._fail_group(Failure.GROUP_FAILED, f"rank {rank} is gone: its link to rank 0 broke ({e})")
            return
        self._beat_at = time.monotonic() + self.heartbeat_s

    def _fail_group(self, failure: Failure, reason: str) -> None:
        """The group is broken: every session ends with ``failure``, new ones are refused, and the
        replica hears it (it turns unhealthy; Serve replaces it)."""
        first = self.failed is None
        if first:
            logger.error("data plane of %s: the group is broken: %s", self.name, reason)
        self._perform(self.rules.fail_group(failure, reason))
        if first:
            self._push({"event": "failed", "failure": failure.value, "reason": reason})

    def _push(self, event: dict[str, Any]) -> None:
        text = json.dumps(event)
        for sock in list(self.watchers):
            try:
                frames.send(sock, Kind.EVENT, text=text)
            except OSError:
                self._drop_watcher(sock)

    def _push_counts(self) -> None:
        """Changed sessions' counts, at most every ``EVENTS_PUSH_S`` (nothing while idle)."""
        now = time.monotonic()
        if not self._dirty or now < self._pushed_at + EVENTS_PUSH_S:
            return
        if self.watchers:
            states = {n: self.sessions[n].state() for n in self._dirty if n in self.sessions}
            self._push({"event": "counts", "sessions": states, "served": self.served.to_dict(),
                        "busy_fraction": self._busy_fraction()})
        self._dirty.clear()
        self._pushed_at = now

    def _drop_watcher(self, sock: Any) -> None:
        with contextlib.suppress(ValueError):
            self.watchers.remove(sock)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()

    # -- running ready layers ----------------------------------------------------------------

    def _run_ready(self) -> None:
        """One forward: the layers the step rules take together (``StepRules.take``), each checked;
        a layer they settled without running (a strict session's FAIL, peers out of step) is
        answered or ended here, in its turn."""
        batch = []
        for taken in self.rules.take(self.compute.forward_limit()):
            session = self.sessions[taken.session.number]
            if taken.end is not None:
                self._perform([taken.end])
            elif taken.failure is not None:
                peer, reason = taken.failure
                error = (Kind.ERROR, frames.error_text(Failure.PEER_FAILED.value, reason, peer), None)
                session.layers += 1
                self._answer_all(session, taken.peers, lambda _i, error=error: error, taken.layer)
                self.rules.answered(session.steps, taken.parts, time.monotonic())
            else:
                batch.append(self._check(session, taken))
        if batch:
            self._run_batch(batch)

    def _check(self, session: HostedSession, taken: Taken) -> Prepared:
        """A taken layer's parts, each checked by the rank (``Compute.check``) or refused alone."""
        layer = taken.layer
        checked: dict[int, Any] = {}
        for i, (frame, logits) in taken.parts.items():
            what = "hidden_states" if session.steps.peers == 1 else f"hidden_states of peer {i}"
            try:
                if frame.kind is Kind.FAIL:
                    checked[i] = RuntimeError(f"peer {i} failed layer {layer}: {frame.text}")
                    continue
                if frame.data is None:
                    raise ValueError(f"{what}: the message carried no rows")
                if logits is not None and session.steps.peers > 1:
                    raise ValueError("router_logits go with a session of one peer (a lane), not a cohort's")
                checked[i] = self.compute.check(layer, frame.data, None if logits is None else
                                                logits.data.array, session.max_tokens, what)
            except ValueError as e:
                checked[i] = e
        good = [(i, c) for i, c in checked.items() if not isinstance(c, Exception) and c[1].shape[0]]
        return Prepared(session, layer, taken.peers, taken.parts, checked, good, taken.new_step)

    def _run_batch(self, batch: list[Prepared]) -> None:
        """One forward of every prepared layer's good parts; each peer answered its slice."""
        if self.failed is not None:
            for prep in batch:
                self._end(prep.session, self.failure or Failure.GROUP_FAILED, self.failed)
            return
        good = [c for prep in batch for c in prep.good]
        try:
            out, tail, seconds = self._forward(batch[0].layer, good)
        except Exception as e:
            # a rank that stopped answering makes a collective time out (gloo says "Timed out"): a stall
            timeout = isinstance(e, TimeoutError) or "timed out" in str(e).lower()
            self._fail_group(Failure.GROUP_TIMEOUT if timeout else Failure.GROUP_FAILED,
                             f"the layer {batch[0].layer} forward failed on the group: {e}")
            return
        if good:
            layer, total, new_step = batch[0].layer, sum(part[1].shape[0] for _, part in good), \
                all(p.new_step for p in batch)
            self.group.add(layer, [part[1].shape[0] for _, part in good], tail, seconds, new_step)
            clients = [part[1].shape[0] for p in batch if not p.session.steps.internal for _, part in p.good]
            if clients:
                self.served.add(layer, clients, tail, seconds, new_step, total)
            self.recent_ms.append(round(seconds * 1e3, 3))
        start = 0
        for prep in batch:
            session = prep.session
            sizes = {i: (0 if isinstance(c, Exception) else c[1].shape[0]) for i, c in prep.checked.items()}
            starts, at = {}, start
            for i in prep.peers:
                if not isinstance(prep.checked[i], Exception) and sizes[i]:
                    starts[i] = at
                    at += sizes[i]
            start = at

            def answer(i: int, prep: Prepared = prep, starts: dict = starts, sizes: dict = sizes
                       ) -> tuple[Kind, str, WireTensor | None]:
                error = prep.checked[i]
                if isinstance(error, Exception):
                    failure = Failure.INPUT if isinstance(error, ValueError) else Failure.PEER_FAILED
                    text = frames.error_text(failure.value, str(error), i, type(error).__name__)
                    return Kind.ERROR, text, None
                if not sizes[i]:
                    return Kind.RESULT, tail, out.part(0, 0)
                return Kind.RESULT, tail, out.part(starts[i], starts[i] + sizes[i])

            # Counted before the answers go: a peer that reads the counts after its result sees them.
            session.layers += 1
            if prep.good:
                session.counts.add(prep.layer, [c[1].shape[0] for _, c in prep.good], tail, seconds,
                                   prep.new_step)
                self._dirty.add(session.number)
            self._answer_all(session, prep.peers, answer, prep.layer)
            self.rules.answered(session.steps, prep.parts, time.monotonic())

    def _forward(self, layer: int, good: list[tuple[int, Any]]) -> tuple[WireTensor, str, float]:
        """One forward of the good parts' rows on every rank: the batch's output and tail.

        Rank 0 answers as soon as its own output is the group's (every tail but sequence
        parallel, whose rows come from every rank): the other ranks' DONEs of this batch are read
        before the next batch is sent, off the peers' wait."""
        if not good:
            code = np.dtype(VIEW_AS.get(self.dtype, self.dtype))
            return WireTensor(np.empty((0, self.hidden_size), code), self.dtype), "none", 0.0
        start = time.perf_counter()
        self.forward_since = time.monotonic()
        try:
            self._collect_done()
            x = concat_rows([c[1] for _, c in good])
            logits = good[0][1][2] if len(good) == 1 else None
            flags = frames.WITH_LOGITS if logits is not None else 0
            wire = x.to_wire() if isinstance(x, DeviceRows) and self.world > 1 else x
            for rank in range(1, self.world):
                link = self.links[rank]
                frames.send(link, Kind.BATCH, flags=flags, layer=layer, data=wire)
                if logits is not None:
                    frames.send(link, Kind.LOGITS, data=WireTensor(logits, "float32"))
            self._done_owed = self.world > 1
            results = [self.compute.run(layer, x, logits)]
            if results[0][1] == "sequence_parallel":
                results += self._collect_done()
        finally:
            self.forward_since = None
            self._beat_at = time.monotonic() + self.heartbeat_s
        out, tail = join_rank_outputs(results)
        return out, tail, time.perf_counter() - start

    def _collect_done(self) -> list[tuple[WireTensor | None, str]]:
        """The other ranks' answers to the last batch (``(out, tail)`` each), if not read yet."""
        if not self._done_owed:
            return []
        self._done_owed = False
        results = []
        for rank in range(1, self.world):
            try:
                done = frames.recv(self.links[rank])
            except TimeoutError:
                raise TimeoutError(f"rank {rank} did not finish within the call bound {self.call_s:.0f} s"
                                   ) from None
            except (frames.ConnectionLost, OSError) as e:
                raise RuntimeError(f"rank {rank} is gone ({e})") from None
            meta = done.meta()
            if meta.get("error"):
                raise RuntimeError(f"rank {rank}: {meta['error']}")
            results.append((done.data, meta["tail"]))
        return results

    def _answer_all(self, session: HostedSession, peers: list[int],
                    answer: Callable[[int], tuple[Kind, str, Rows | None]], layer: int) -> None:
        sends = []  # device channels' sends in flight: waited once every header went
        for i in peers:
            sock = session.sockets[i]
            if sock is None:  # dropped while answering the ones before it (elastic)
                continue
            kind, text, data = answer(i)
            channel = session.channels.get(i)
            if data is not None and channel is not None and not isinstance(data, DeviceRows):
                data = DeviceRows(data.to_torch(writable=False), data.dtype)
            elif isinstance(data, DeviceRows) and channel is None:
                data = data.to_wire()
            try:
                frames.send(sock, kind, layer=layer, text=text, data=data)
                if isinstance(data, DeviceRows):
                    sends.append((i, channel.send(data)))
            except OSError as e:
                self._fault(session, i, Failure.PEER_GONE, f"peer {i} of session {session.name!r} closed its "
                            f"connection ({e})")
                if session.ended:
                    return
        for i, sent in sends:
            try:
                sent.wait()
            except RuntimeError as e:
                self._fault(session, i, Failure.PEER_GONE, f"peer {i} of session {session.name!r} did not "
                            f"take layer {layer}'s rows from its device channel ({e})")
                if session.ended:
                    return

    # -- ending ---------------------------------------------------------------------------

    def _end_number(self, number: int, failure: Failure, reason: str) -> dict[str, Any] | None:
        session = self.sessions.get(number)
        if session is None:
            return self.ended.get(number)
        self._end(session, failure, reason)
        return session.state()

    def _end(self, session: HostedSession, failure: Failure, reason: str, peer: int | None = None) -> None:
        self._perform(self.rules.end(session.steps, failure, reason, peer))

    def _finish(self, session: HostedSession, end: End) -> None:
        """An ended session: tell every peer why (answering a layer they wait on as the same
        failure), close, and keep its last state."""
        failure, reason = end.failure, end.reason
        text = frames.error_text(failure.value, reason, end.peer)
        for i, sock in enumerate(session.sockets):
            if sock is not None:
                self._close_peer(sock, text)
                session.sockets[i] = None
        for i in list(session.channels):
            self._close_channel(session, i)
        self.by_secret.pop(session.secret, None)
        self.ended_secrets[session.secret] = session.number
        while len(self.ended_secrets) > ENDED_KEPT:
            del self.ended_secrets[next(iter(self.ended_secrets))]
        self.sessions.pop(session.number, None)
        self._dirty.discard(session.number)
        self.ended[session.number] = state = session.state()
        while len(self.ended) > ENDED_KEPT:  # the oldest first (dicts keep insertion order)
            del self.ended[next(iter(self.ended))]
        if not session.steps.internal:
            logger.info("data plane of %s: session %s (%r) ended (%s): %s; %d forward(s), %d row(s)",
                        self.name, session.number, session.name, failure.value, reason,
                        session.counts.forwards, session.counts.rows)
        self._push({"event": "ended", "session": session.number, "state": state})

    def _close_channel(self, session: HostedSession, index: int) -> None:
        channel = session.channels.pop(index, None)
        if channel is not None:
            channel.close()

    def _close_peer(self, sock: socket.socket, text: str) -> None:
        """Send a peer its BYE (``text``: why) and read until it closes, at most DRAIN_S (a close
        with unread data would reset the connection and could lose the BYE on its way)."""
        with contextlib.suppress(OSError):
            frames.send(sock, Kind.BYE, text=text)
            sock.shutdown(socket.SHUT_WR)
        self._selector.modify(sock, selectors.EVENT_READ, "closing")
        self._closing[sock] = time.monotonic() + DRAIN_S

    def _drain_closed(self, sock: Any) -> None:
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._forget(sock)

    def _forget(self, sock: socket.socket) -> None:
        self._closing.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()


class RankLink:
    """A rank > 0's link to rank 0: runs every batch rank 0 sends, in order, on its own thread
    (blocking reads: idle costs nothing). ``failed`` says why it stopped, if it did."""

    def __init__(self, address: tuple[str, int], group_secret: str, rank: int, compute: Compute,
                 timeout_s: float):
        self.rank, self.compute = rank, compute
        self.failed: str | None = None
        self.sock = frames.connect(address, group_secret, Role.RANK, rank, timeout_s)
        self._thread = threading.Thread(target=self._serve, name=f"rank{rank}-dataplane", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                batch = frames.recv(self.sock)
                if batch.kind is Kind.PING:  # rank 0's heartbeat while the group is idle
                    frames.send(self.sock, Kind.PONG)
                    continue
                logits = frames.recv(self.sock).data.array if batch.flags & frames.WITH_LOGITS else None
            except (frames.ConnectionLost, OSError) as e:
                if self.failed is None:
                    self.failed = f"rank 0's data-plane link closed ({e})"
                return
            try:
                out, tail = self.compute.run(batch.layer, batch.data, logits)
                frames.send(self.sock, Kind.DONE, text=json.dumps({"tail": tail}), data=out)
            except Exception as e:
                self.failed = f"the layer {batch.layer} forward failed on rank {self.rank}: {e}"
                with contextlib.suppress(OSError):
                    frames.send(self.sock, Kind.DONE, text=json.dumps({"error": self.failed}))

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=DRAIN_S)
