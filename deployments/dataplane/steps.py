"""Rank 0's step rules as a pure object: which sessions' layers run, when, and who is told what.

:class:`StepRules` keeps every open session's step state (:class:`SessionSteps`) and the ready
queue. Its caller (``host.GroupHost``'s socket loop) tells it what happened -- a session asks to
open, a peer joins, a peer's frame came, a peer's connection failed, the time is now -- and gets
back what to do: :class:`Drop` one peer or :class:`End` a whole session, each with its failure
kind and words; ready layers come off the queue with :meth:`StepRules.take` and go back through
:meth:`StepRules.answered` once their peers have their answers. No sockets, threads or clock:
every method takes ``now`` from its caller, so the rules are tested against a scripted clock.

**Strict sessions.** A session has a fixed number of peers ``A``. Per MoE layer every peer sends
its rows (0 rows allowed) or a FAIL; once all ``A`` have, the layer is *ready*. A layer that some
peer has not sent within the call bound after the first part ends the session
(``Failure.PEER_STALLED``), as does a peer's own fault (its connection closed: ``PEER_GONE``;
peers sending different layers, a second part, a message that is no part: ``OUT_OF_STEP``). A
peer's FAIL fails the layer for every peer (the others' steps depend on it); the session stays.

**Elastic sessions** (``idle_after_s`` set; for independent engines such as vLLM's) let peers
come, go and idle without holding the others up. Peers mark the first and last layer of their
step (``frames.NEW_STEP``, ``END_STEP``). A layer waits only for the *active* peers: those that
took part in the group's current step. At a step's start, an active peer that has not sent within
``idle_after_s`` of the first sits the step out (it is *parked*: 0 rows, as a data-parallel
engine's dummy batch would send); a peer that says it is idle (``Kind.IDLE``, between its steps)
is parked at once, without that wait; a parked or newly joined peer's first layer is *held* until the
group's next step start, so the group never mixes steps. Mid-step, a peer silent for the call
bound, a peer whose connection closes and a peer out of step are dropped alone (told why); its
slot can be joined again. A FAIL fails only its own peer's layer.

**Lasting.** A session with ``linger_s`` ends once none of its peers has been connected that
long. **Admission:** a broken group opens nothing; a client's session is refused when
``max_sessions`` are open (the replica's own is never counted or refused).

**Fairness.** Ready layers run in the order they became ready; the oldest runs together with
every other ready layer of the same MoE layer without router logits (one forward over their
concatenated rows, up to the group's forward limit). A session has at most one ready layer (its
peers wait for the answer), so a ready layer waits for at most one forward of each session that
became ready before it.

Pure: no Ray, no torch, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .errors import Failure
from .frames import END_STEP, NEW_STEP, WITH_LOGITS, Frame, Kind

Part = tuple[Frame, Frame | None]  # a peer's FORWARD or FAIL, and the LOGITS that came with it


def check_idle_after(idle_after_s: float | None, call_s: float) -> None:
    """An elastic session's ``idle_after_s``: None, or seconds in (0, call_s] (an active peer is
    parked before a stalled one would be dropped)."""
    if idle_after_s is None:
        return
    number = isinstance(idle_after_s, int | float) and not isinstance(idle_after_s, bool)
    if not number or not 0 < idle_after_s <= call_s:
        raise ValueError(f"idle_after_s must be None or seconds in (0, call bound {call_s:g}], "
                         f"got {idle_after_s!r}")


def check_open(peers: int, idle_after_s: float | None, linger_s: float | None, call_s: float) -> None:
    """A session's own arguments (ValueError naming the wrong one); the group's room is
    :meth:`StepRules.admit`'s."""
    if isinstance(peers, bool) or not isinstance(peers, int) or peers < 1:
        raise ValueError(f"a session needs a positive number of peers, got {peers!r}")
    check_idle_after(idle_after_s, call_s)
    if linger_s is not None and not (isinstance(linger_s, int | float) and linger_s > 0):
        raise ValueError(f"linger_s must be None or seconds > 0, got {linger_s!r}")


@dataclass(frozen=True)
class Drop:
    """Close peer ``peer``'s connection, telling it why; its slot can be joined again (elastic)."""

    number: int
    peer: int
    failure: Failure
    reason: str


@dataclass(frozen=True)
class End:
    """Session ``number`` ended: every connected peer is told why (``peer``: the one at fault)."""

    number: int
    failure: Failure
    reason: str
    peer: int | None = None


Effect = Drop | End


@dataclass(eq=False)  # compared by identity: the ready queue holds the objects themselves
class SessionSteps:
    """One session's step state (see the module doc)."""

    number: int
    peers: int
    name: str
    call_s: float  # the group's call bound
    idle_after_s: float | None = None  # set: an elastic session
    linger_s: float | None = None  # set: the session ends once no peer was connected this long
    internal: bool = False  # the replica's own (Serve-path) session: not counted against the limit
    alone_since: float = 0.0  # when its last connected peer left (or it opened)
    connected: set[int] = field(default_factory=set)  # peers joined and not dropped
    pending: dict[int, Part] = field(default_factory=dict)  # the layer's parts so far
    held: dict[int, Part] = field(default_factory=dict)  # elastic: first layers waiting for a step
    active: set[int] = field(default_factory=set)  # elastic: the peers of the group's current step
    at_boundary: bool = True  # elastic: the group's next layer starts a step
    first_at: float = 0.0  # when the pending layer's first part came
    last_at: float = 0.0  # when the last layer was answered
    parked: int = 0  # elastic: peers parked after idle_after_s (the others waited that long)
    idled: int = 0  # elastic: peers that said they were idle at a step's start (parked without a wait)
    ended: str | None = None
    failure: Failure | None = None

    @property
    def elastic(self) -> bool:
        return self.idle_after_s is not None

    def expected(self) -> set[int]:
        """The peers the pending layer waits for."""
        return set(self.active) if self.elastic else set(range(self.peers))

    def complete(self) -> bool:
        """Every expected part of the pending layer came: the layer is ready to run."""
        return bool(self.pending) and not self.ended and self.expected() <= set(self.pending)

    def joined(self) -> int:
        return len(self.connected)

    def waiting(self) -> bool:
        """Some peer waits on the others: a layer's first part came, or (elastic) a peer is held
        for the step after the current one."""
        if self.ended or self.complete():
            return False
        return bool(self.pending or (self.held and not self.at_boundary))

    def waiting_for(self) -> list[int]:
        return sorted(self.expected() - set(self.pending)) if self.pending else []

    def deadline(self) -> float:
        """When a waiting layer stops waiting for its missing peers (a held peer: for the active
        ones' next layer)."""
        if not self.pending:
            return self.last_at + self.call_s
        wait_s = self.idle_after_s if self.elastic and self.at_boundary else self.call_s
        return self.first_at + wait_s

    def linger_deadline(self) -> float | None:
        """When the session ends for want of peers (None: a peer is connected, or no linger)."""
        if self.linger_s is None or self.ended or self.connected:
            return None
        return self.alone_since + self.linger_s

    def shape(self) -> tuple[int, int, bool]:
        """The pending layer, its rows (before checks; a device channel's from its header) and
        whether router logits came with it: what the merge rule reads."""
        layer = next(iter(self.pending.values()))[0].layer
        rows = 0
        for frame, _ in self.pending.values():
            if frame.data is not None:
                rows += frame.data.shape[0]
            elif frame.channel is not None:
                rows += frame.channel[0][0]
        return layer, rows, any(frame.flags & WITH_LOGITS for frame, _ in self.pending.values())


@dataclass
class Taken:
    """A ready layer taken off the queue: ``parts`` by peer (``peers`` in order).

    ``end`` set: its parts named different layers, the session ended and nothing runs.
    ``failure`` set (strict): ``(peer, reason)`` of a peer's FAIL; every peer is answered it,
    nothing runs, and the session stays. Neither: the parts run (``new_step``: all of them start
    a step)."""

    session: SessionSteps
    layer: int
    peers: list[int]
    parts: dict[int, Part]
    new_step: bool
    end: End | None = None
    failure: tuple[int, str] | None = None


class StepRules:
    """Every open session's step rules and the ready queue of a group (see the module doc).
    ``call_s``: the group's call bound."""

    def __init__(self, call_s: float):
        self.call_s = call_s
        self.sessions: dict[int, SessionSteps] = {}
        self.ready: deque[SessionSteps] = deque()  # sessions whose layer is ready, oldest first
        self.failed: str | None = None  # why the group broke (then every session ended)
        self.failure: Failure | None = None

    # -- sessions and peers ------------------------------------------------------------------

    def admit(self, session: SessionSteps, max_sessions: int | None) -> None:
        """Open ``session``, or say why not: RuntimeError (the group is broken), ValueError (the
        group holds ``max_sessions`` clients' sessions; None: the replica's own, never refused)."""
        if self.failed is not None:
            raise RuntimeError(f"the group's data plane is broken: {self.failed}")
        if max_sessions is not None:
            open_now = sum(not s.internal for s in self.sessions.values())
            if open_now >= max_sessions:
                raise ValueError(f"{open_now} session(s) are open on this group and max_sessions = "
                                 f"{max_sessions}: one more would make {open_now + 1}")
        self.sessions[session.number] = session

    def join(self, session: SessionSteps, index: int) -> str | None:
        """Peer ``index`` connects: None (it is in), or why not (``frames.REFUSED``'s words)."""
        if session.ended is not None or session.number not in self.sessions:
            return "ended"
        if not 0 <= index < session.peers or index in session.connected:
            return "taken"
        session.connected.add(index)
        return None

    def receive(self, session: SessionSteps, index: int, part: Part, now: float) -> list[Effect]:
        """Peer ``index`` sent ``part`` (any message other than its device channel's opening)."""
        frame = part[0]
        if frame.kind is Kind.IDLE:
            return self.idle(session, index)
        who = f"peer {index} of session {session.name!r}"
        twice = index in session.pending or index in session.held
        if frame.kind not in (Kind.FORWARD, Kind.FAIL) or twice:
            why = "sent twice for one layer" if twice else f"sent a {frame.kind.name} message"
            return self.fault(session, index, Failure.OUT_OF_STEP, f"{who} {why}", now)
        if session.elastic and index not in session.active:
            if not frame.flags & NEW_STEP:
                return self.fault(session, index, Failure.OUT_OF_STEP, f"{who} is not in the group's step "
                                  f"and sent layer {frame.layer}, not its step's first", now)
            session.held[index] = part
            if session.at_boundary:  # the group is at a step's start: it takes part now
                self._start_step(session, now)
            return []
        if session.elastic and bool(frame.flags & NEW_STEP) != session.at_boundary:
            where = "starts a step" if session.at_boundary else "is half-way through a step"
            return self.fault(session, index, Failure.OUT_OF_STEP,
                              f"{who} sent layer {frame.layer} while the group {where}", now)
        if not session.pending:
            session.first_at = now
        session.pending[index] = part
        self._queue_if_complete(session)
        return []

    def idle(self, session: SessionSteps, index: int) -> list[Effect]:
        """Peer ``index`` says it has no step to run (elastic): at a step's start it sits the group's
        steps out at once, as it would after ``idle_after_s``. Anywhere else it changes nothing: a
        strict session's peers all step, and a peer whose next layer came, or that is mid-step,
        is busy again (the notice was late)."""
        late = index in session.pending or index in session.held or not session.at_boundary
        if session.elastic and not late and index in session.active:
            session.active.discard(index)
            session.idled += 1
            self._queue_if_complete(session)
        return []

    def fault(self, session: SessionSteps, index: int, failure: Failure, reason: str,
              now: float) -> list[Effect]:
        """Peer ``index``'s own fault: a strict session ends for all; an elastic one drops that peer
        alone (the layer it was part of goes on without it)."""
        if session.ended is not None:
            return []
        if not session.elastic:
            return self.end(session, failure, reason, peer=index)
        if index in session.connected:
            session.connected.discard(index)
            if not session.connected:
                session.alone_since = now
        session.active.discard(index)
        session.pending.pop(index, None)
        session.held.pop(index, None)
        effects: list[Effect] = [Drop(session.number, index, failure, reason)]
        if not session.active:  # nobody is mid-step: the held peers need not wait for a boundary
            session.at_boundary = True
            if session.held:
                self._start_step(session, now)
                return effects
        self._queue_if_complete(session)
        return effects

    def end(self, session: SessionSteps, failure: Failure, reason: str,
            peer: int | None = None) -> list[Effect]:
        """End ``session`` (closed, a strict peer's fault, the group broke...); [] if it had."""
        if session.ended is not None:
            return []
        session.ended, session.failure = reason, failure
        session.connected.clear()
        session.pending, session.held = {}, {}
        if session in self.ready:
            self.ready.remove(session)
        self.sessions.pop(session.number, None)
        return [End(session.number, failure, reason, peer)]

    def fail_group(self, failure: Failure, reason: str) -> list[Effect]:
        """The group is broken: every session ends with the first failure, new ones are refused."""
        if self.failed is None:
            self.failed, self.failure = reason, failure
        effects: list[Effect] = []
        for session in list(self.sessions.values()):
            effects += self.end(session, self.failure, self.failed)
        return effects

    # -- time --------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest time :meth:`tick` has something to do (None: nothing until a message)."""
        deadlines = [s.deadline() for s in self.sessions.values() if s.waiting()]
        deadlines += [d for d in (s.linger_deadline() for s in self.sessions.values()) if d is not None]
        return min(deadlines, default=None)

    def tick(self, now: float) -> list[Effect]:
        """Whatever the time ``now`` decides: lingering sessions end, idle peers are parked at a
        step's start, and stalled peers are dropped (elastic) or end their session (strict)."""
        effects: list[Effect] = []
        bound = f"within the call bound {self.call_s:.0f} s"
        for session in list(self.sessions.values()):
            name = session.name
            linger = session.linger_deadline()
            if linger is not None and now >= linger:
                effects += self.end(session, Failure.SESSION_ENDED, f"session {name!r} had no connected peer "
                                    f"for {session.linger_s:g} s (its linger_s)")
                continue
            if not session.waiting() or now < session.deadline():
                continue
            if not session.pending:  # elastic, mid-step, and every active peer silent since the last layer
                for i in sorted(session.active):
                    why = f"peer {i} of session {name!r} did not send its next layer {bound}"
                    effects += self.fault(session, i, Failure.PEER_STALLED, why, now)
                continue
            missing = sorted(session.expected() - set(session.pending))
            layer = next(iter(session.pending.values()))[0].layer
            if session.elastic and session.at_boundary:  # idle: they sit this step out
                session.active -= set(missing)
                session.parked += len(missing)
                self._queue_if_complete(session)
            elif session.elastic:
                for i in missing:
                    why = f"peer {i} of session {name!r} did not send layer {layer} {bound}"
                    effects += self.fault(session, i, Failure.PEER_STALLED, why, now)
            else:
                what = "have" if len(missing) > 1 else "has"
                never = [i for i in missing if i not in session.connected]
                joined = f" ({never} never joined)" if never else ""
                effects += self.end(session, Failure.PEER_STALLED, f"peer(s) {missing} of session {name!r} "
                                    f"{what} not sent layer {layer} {bound}{joined}", peer=missing[0])
        return effects

    # -- the ready queue ---------------------------------------------------------------------

    def take(self, forward_limit: int) -> list[Taken]:
        """The next forward: the oldest ready layer with every other ready layer of the same MoE
        layer that fits beside it (no router logits, ``forward_limit`` rows in all), in queue
        order; [] when the oldest stopped being ready (a peer was dropped)."""
        if not self.ready:
            return []
        first = self.ready.popleft()
        if not first.complete():
            return []
        layer, rows, logits = first.shape()
        batch = [first]
        if not logits:
            room = forward_limit - rows
            for other in list(self.ready):
                if not other.complete():
                    continue
                its_layer, its_rows, its_logits = other.shape()
                if its_layer == layer and not its_logits and its_rows <= room:
                    self.ready.remove(other)
                    batch.append(other)
                    room -= its_rows
        return [self._take_layer(session) for session in batch]

    def answered(self, session: SessionSteps, parts: dict[int, Part], now: float) -> None:
        """A taken layer's peers have their answers: an elastic group at a step's end lets the
        held peers in."""
        session.last_at = now
        if session.elastic and not session.ended:
            session.at_boundary = all(frame.flags & END_STEP for frame, _ in parts.values())
            if session.at_boundary and session.held:
                self._start_step(session, now)

    def _take_layer(self, session: SessionSteps) -> Taken:
        peers = sorted(session.pending)  # every peer, or (elastic) the step's active ones
        parts = {i: session.pending[i] for i in peers}
        session.pending = {}
        layers = {frame.layer for frame, _ in parts.values()}
        layer = next(iter(parts.values()))[0].layer
        if len(layers) > 1:
            sent = {i: frame.layer for i, (frame, _) in parts.items()}
            end = self.end(session, Failure.OUT_OF_STEP, f"the peers of session {session.name!r} sent "
                           f"different layers: {sent}")
            return Taken(session, layer, peers, parts, False, end=end[0])
        new_step = all(frame.flags & NEW_STEP for frame, _ in parts.values())
        failed = [(i, frame.text) for i, (frame, _) in parts.items() if frame.kind is Kind.FAIL]
        failure = None
        if failed and not session.elastic:  # the others' steps depend on it: the layer fails for all
            i, why = failed[0]
            failure = (i, f"peer {i} of session {session.name!r} failed layer {layer}: {why}")
        return Taken(session, layer, peers, parts, new_step, failure=failure)

    def _start_step(self, session: SessionSteps, now: float) -> None:
        """Elastic: the held peers join the step the group starts now."""
        if not session.pending:
            session.first_at = now
        session.active |= set(session.held)
        session.pending.update(session.held)
        session.held = {}
        self._queue_if_complete(session)

    def _queue_if_complete(self, session: SessionSteps) -> None:
        # A session already queued keeps its place: it became ready first (the fairness rule).
        if session.complete() and session not in self.ready:
            self.ready.append(session)
