"""Error classes shared by the deployments, the HTTP ingress and the client.

Client faults derive from ``ValueError`` and carry a 4xx HTTP status; our faults carry a
5xx. Ray wraps an exception raised in a replica in a ``RayTaskError`` that is also an
instance of the original class, so ``isinstance`` checks keep working across hops, and
:func:`root_cause` recovers the original (clean) message.
"""

from __future__ import annotations


class ServeInputError(ValueError):
    """A bad request: malformed body, missing tensor, wrong shape or dtype, NaN/Inf, ..."""

    status = 400


class UnknownLayerError(ServeInputError):
    """The layer is not a MoE layer of the checkpoint, or this deployment does not serve it."""

    status = 404


class UnknownDeploymentError(ServeInputError):
    status = 404


class TooLargeError(ServeInputError):
    """More tokens than ``max_tokens_per_request``, or an HTTP body over the size limit."""

    status = 413


class GroupUnavailableError(RuntimeError):
    """The TP group failed (a worker died, a collective failed, or a call outlived its bound):
    it is broken for good, the replica is unhealthy and Serve replaces it. ``replica``: the
    replica whose group it is (``None`` where unknown), so a re-send can avoid it
    (``common.retry``)."""

    status = 503

    def __init__(self, message: str, replica: str | None = None):
        super().__init__(message)
        self.replica = replica

    def __reduce__(self):  # Ray pickles errors across hops: keep the replica
        return type(self), (self.args[0], self.replica)


class GroupTimeoutError(GroupUnavailableError):
    """A TP-group call outlived the collective timeout plus its margin: the group is broken."""

    status = 504


class RequestTimeoutError(TimeoutError):
    """A caller's own wait ran out (e.g. the ingress's ``request_timeout_s``): the call may still
    run, so it is never sent again."""

    status = 504


def root_cause(exc: BaseException) -> BaseException:
    """Unwrap Ray's task-error wrappers (possibly nested across hops) to the original error."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and cause is not exc:
            exc = cause
            continue
        break
    return exc


def retry_after_s(exc: BaseException) -> float | None:
    """Seconds after which a refused request may be retried (Serve's backpressure), or None."""
    value = getattr(root_cause(exc), "retry_after_s", None)
    return float(value) if isinstance(value, int | float) else None


def actor_died(exc: BaseException) -> bool:
    """Ray's ``RayActorError`` (``ActorDiedError``...): the replica died under the call, matched
    by class name because this module imports no Ray."""
    return any(c.__name__ == "RayActorError" for c in type(root_cause(exc)).__mro__)


def error_message(exc: BaseException) -> str:
    """The clean, one-line message of an error (no Ray traceback)."""
    cause = root_cause(exc)
    if cause.args and isinstance(cause.args[0], str):
        return cause.args[0]
    return str(cause) or type(cause).__name__


def http_status(exc: BaseException) -> int:
    """4xx for client faults, 5xx for ours (Serve's ``BackPressureError``: its own, 503 or 429)."""
    cause = root_cause(exc)
    for attr in ("status", "status_code"):
        status = getattr(cause, attr, None)
        if isinstance(status, int):
            return status
    if isinstance(cause, ValueError):
        return 400
    if isinstance(cause, TimeoutError):
        return 504
    if actor_died(cause):  # the replica is gone and Serve is replacing it: unavailable, not a bug
        return 503
    return 500
