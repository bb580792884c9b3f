"""What can end a layer on the data plane, and what each side does about it: one table.

The ranks' side names the failure (:class:`Failure`, sent with the layer's ERROR or the session's
BYE); the peer raises :class:`SessionError` carrying it; callers (a lane, a cohort, a user's peer)
look the action up in :data:`ACTIONS` instead of each deciding from flags.

Pure: no Ray, no torch.
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
    SESSION_ENDED = "session_ended"  # the lease ended (released, expired, revoked): the layer never ran


class Action(enum.Enum):
    CALLER_ERROR = "caller_error"  # raise to the caller; the session stays usable
    PEER_ERROR = "peer_error"  # raise naming the peer at fault; the session stays usable
    SESSION_OVER = "session_over"  # raise naming the peer at fault; the session is closed
    RETRY_ELSEWHERE = "retry_elsewhere"  # the group broke: once more on another replica (common.retry)
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


class SessionError(RuntimeError):
    """A layer ended without this peer's result: ``failure`` says why, ``peer`` names the peer at
    fault (None: not a peer's), ``replica`` the replica whose group served the layer; ``error``:
    for ``Failure.INPUT``, the name of the check's error class (``common.errors``)."""

    def __init__(self, failure: Failure, message: str, peer: int | None = None, replica: str | None = None,
                 error: str = ""):
        super().__init__(message)
        self.failure, self.peer, self.replica, self.error = failure, peer, replica, error

    @property
    def action(self) -> Action:
        return ACTIONS[self.failure]

    def input_error(self) -> ServeInputError:
        """An ``INPUT`` failure as the check raised it on the rank (so its HTTP status is kept)."""
        kinds = {k.__name__: k for k in (ServeInputError, UnknownLayerError, TooLargeError)}
        return kinds.get(self.error, ServeInputError)(str(self))

    def __reduce__(self):  # Ray pickles errors between processes
        return type(self), (self.failure, str(self), self.peer, self.replica, self.error)
