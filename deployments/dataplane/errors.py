"""Every error a caller of the MoE app can see, and what to do about it: one family, one table.

Whatever path carried a call (a Serve handle, HTTP, a lane, a cohort, a session peer, the vLLM
op), what reaches the caller is a :class:`MoEServeError`: ``message``, HTTP-like ``status``,
``kind`` (what failed) and ``action`` (what the caller does: :class:`Action`).
:class:`MoERequestError` (4xx: the request was wrong), :class:`MoEServerError` (5xx: ours, e.g. a
TP group being replaced), :class:`MoEOverloadedError` (503, ``retry_after_s``),
:class:`WorkerError` (a cohort's attention worker failed), :class:`SessionError` (a session's
layer ended without this peer's result; ``failure`` names why) and :class:`JoinRefused` (a
session's rank 0 refused a peer's join; ``reason`` names why).

The ranks' side names a session's failure (:class:`Failure`, sent with the layer's ERROR or the
session's BYE); :data:`ACTIONS` maps each to its action, and every path looks it up there.

Pure: no Ray, no torch (a Ray-less peer imports it).
"""

from __future__ import annotations

import enum

from ..common.errors import ServeInputError, TooLargeError, UnknownLayerError


class Failure(enum.Enum):
    INPUT = "input"  # this peer's rows or layer were refused; nothing ran for them
    PEER_FAILED = "peer_failed"  # another peer reported its own failure for this layer
    PEER_GONE = "peer_gone"  # a peer's connection closed: the session ended
    PEER_STALLED = "peer_stalled"  # a peer did not send the layer within the call bound: the session ended
    OUT_OF_STEP = "out_of_step"  # peers sent different layers: the session ended
    GROUP_FAILED = "group_failed"  # a rank failed or died: the group is broken
    GROUP_TIMEOUT = "group_timeout"  # no answer within the bound: a rank is stalled, the group is broken
    SESSION_ENDED = "session_ended"  # the session ended (closed, lingered out): the layer never ran


class Action(enum.Enum):
    CALLER_ERROR = "caller_error"  # the request was wrong: fix it; the session stays usable
    PEER_ERROR = "peer_error"  # another peer failed this layer; the session stays usable
    SESSION_OVER = "session_over"  # the session was ended by a peer's fault: open a new one
    RETRY_ELSEWHERE = "retry_elsewhere"  # the group broke: once more on another replica (peers move)
    RETRY_LATER = "retry_later"  # refused for load (or no replica yet): the same call later
    START_OVER = "start_over"  # nothing ran: a first attempt on another session or the Serve path


ACTIONS: dict[Failure, Action] = {
    Failure.INPUT: Action.CALLER_ERROR,
    Failure.PEER_FAILED: Action.PEER_ERROR,
    Failure.PEER_GONE: Action.SESSION_OVER,
    Failure.PEER_STALLED: Action.SESSION_OVER,
    Failure.OUT_OF_STEP: Action.SESSION_OVER,
    Failure.GROUP_FAILED: Action.RETRY_ELSEWHERE,
    Failure.GROUP_TIMEOUT: Action.RETRY_ELSEWHERE,
    Failure.SESSION_ENDED: Action.START_OVER,
}

STATUS: dict[Failure, int] = {  # the HTTP status each failure answers with (HTTP clients, logs)
    Failure.INPUT: 400, Failure.PEER_FAILED: 409, Failure.PEER_GONE: 409, Failure.PEER_STALLED: 409,
    Failure.OUT_OF_STEP: 409, Failure.GROUP_FAILED: 503, Failure.GROUP_TIMEOUT: 504,
    Failure.SESSION_ENDED: 410,
}


class MoEServeError(Exception):
    """An error answer of the MoE app: ``message`` (the server's), ``status`` (HTTP code), ``kind``
    (what failed: an error class or a :class:`Failure` value) and ``action`` (:class:`Action`)."""

    def __init__(self, message: str, status: int, kind: str | None = None):
        super().__init__(f"[{status}{' ' + kind if kind else ''}] {message}")
        self.message, self.status, self.kind = message, status, kind

    @property
    def action(self) -> Action:
        if self.status == 503 and self.kind in (None, "BackPressureError", "overloaded"):
            return Action.RETRY_LATER
        return Action.CALLER_ERROR if 400 <= self.status < 500 else Action.RETRY_ELSEWHERE

    def __reduce__(self):  # Ray pickles errors between processes
        return type(self), (self.message, self.status, self.kind)


class MoERequestError(MoEServeError, ValueError):
    """4xx: the request itself is wrong (shape, dtype, NaN, unknown layer, too large...)."""


class MoEServerError(MoEServeError, RuntimeError):
    """5xx: the server failed (TP group broken and being replaced, timeout, bug)."""


class MoEOverloadedError(MoEServerError):
    """503: refused at once because the deployment's queue is full; retry after ``retry_after_s``."""

    def __init__(self, message: str, status: int, kind: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message, status, kind)
        self.retry_after_s = retry_after_s

    @property
    def action(self) -> Action:
        return Action.RETRY_LATER

    def __reduce__(self):
        return type(self), (self.message, self.status, self.kind, self.retry_after_s)


class WorkerError(MoEServeError, RuntimeError):
    """A cohort's attention worker failed: ``index`` (its position in the cohort), ``name``
    (its actor's name or repr), ``detail``; ``died``: the actor is gone (the cohort is then
    closed: build a new one without it). The step was aborted on every worker."""

    def __init__(self, index: int, name: str, detail: str, died: bool = False):
        super().__init__(f"attention worker {index} ({name}){' died' if died else ''}: {detail}", 500,
                         "worker_died" if died else "worker_failed")
        self.index, self.name, self.detail, self.died = index, name, detail, died

    @property
    def action(self) -> Action:
        return Action.SESSION_OVER if self.died else Action.PEER_ERROR

    def __reduce__(self):  # raised in the worker's process, carried back by Ray
        return type(self), (self.index, self.name, self.detail, self.died)


class SessionError(MoEServeError, RuntimeError):
    """A layer ended without this peer's result: ``failure`` says why, ``peer`` names the peer at
    fault (None: not a peer's), ``replica`` the replica whose group served the layer; ``error``:
    for ``Failure.INPUT``, the name of the check's error class (``common.errors``)."""

    def __init__(self, failure: Failure, message: str, peer: int | None = None, replica: str | None = None,
                 error: str = ""):
        super().__init__(message, STATUS[failure], failure.value)
        self.failure, self.peer, self.replica, self.error = failure, peer, replica, error

    @property
    def action(self) -> Action:
        return ACTIONS[self.failure]

    def input_error(self) -> ServeInputError:
        """An ``INPUT`` failure as the check raised it on the rank (so its HTTP status is kept)."""
        kinds = {k.__name__: k for k in (ServeInputError, UnknownLayerError, TooLargeError)}
        return kinds.get(self.error, ServeInputError)(self.message)

    def __reduce__(self):  # Ray pickles errors between processes
        return type(self), (self.failure, self.message, self.peer, self.replica, self.error)


class JoinRefused(SessionError):
    """A group's rank 0 refused a peer's join; ``reason`` is one of :data:`JOIN_REFUSALS`."""

    def __init__(self, reason: str, message: str, replica: str | None = None):
        failure = Failure.SESSION_ENDED if reason == "ended" else Failure.INPUT
        SessionError.__init__(self, failure, message, None, replica)
        self.reason = reason
        self.status = {"secret": 403, "ended": 410, "taken": 409}.get(reason, 400)

    def __reduce__(self):
        return type(self), (self.reason, self.message, self.replica)


JOIN_REFUSALS = {  # why rank 0 refuses a join -> what the peer is told
    "secret": "its secret is not one this group knows (a wrong ticket, or another app's)",
    "ended": "the session has ended",
    "taken": "another peer has joined with that index",
}
