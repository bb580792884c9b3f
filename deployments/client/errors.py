"""What the clients raise: the app's one error family (``dataplane.errors``, re-exported here)
and the rule turning whatever an answer's hop raised into it (:func:`raise_for`)."""

from __future__ import annotations

from typing import NoReturn

from ray.serve.exceptions import BackPressureError

from ..common.errors import error_message, http_status, root_cause
from ..dataplane.errors import (
    Action,
    JoinRefused,
    MoEOverloadedError,
    MoERequestError,
    MoEServeError,
    MoEServerError,
    SessionError,
    WorkerError,
)

__all__ = ["Action", "JoinRefused", "MoEOverloadedError", "MoERequestError", "MoEServeError",
           "MoEServerError", "SessionError", "WorkerError", "raise_for", "raise_status"]


def raise_status(message: str, status: int, kind: str | None = None, overloaded: bool = False,
                 retry_after_s: float | None = None) -> NoReturn:
    """The client error of an answer with HTTP ``status`` (``overloaded``: refused for load)."""
    if overloaded:
        raise MoEOverloadedError(message, status, kind, retry_after_s) from None
    cls = MoERequestError if 400 <= status < 500 else MoEServerError
    raise cls(message, status, kind) from None


def raise_for(exc: BaseException) -> NoReturn:
    """Raise the client error for ``exc`` (whatever hop wrapped it); client errors as they are."""
    if isinstance(exc, MoEServeError):
        raise exc
    cause = root_cause(exc)
    overloaded = isinstance(cause, BackPressureError)
    raise_status(error_message(cause), http_status(cause), type(cause).__name__, overloaded,
                 cause.retry_after_s if overloaded else None)
