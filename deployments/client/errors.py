"""What the clients raise: every error answer of the MoE app, whatever path carried it.

:class:`MoERequestError` (4xx: the request was wrong) or :class:`MoEServerError` (5xx: ours,
e.g. a TP group being replaced), carrying the server's message and status; a request refused
because the deployment's queue is full (``max_queued_requests``) raises
:class:`MoEOverloadedError` (503, ``retry_after_s``). A cohort raises :class:`WorkerError`
when one of its attention workers failed (its own code raised, it sent rows of the wrong shape,
or it died), naming the worker.
"""

from __future__ import annotations

from typing import NoReturn

from ray.serve.exceptions import BackPressureError

from ..common.errors import error_message, http_status, root_cause


class MoEServeError(Exception):
    """An error answer of the MoE app: ``message`` (the server's), ``status`` (HTTP code)."""

    def __init__(self, message: str, status: int, kind: str | None = None):
        super().__init__(f"[{status}{' ' + kind if kind else ''}] {message}")
        self.message, self.status, self.kind = message, status, kind

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

    def __reduce__(self):
        return type(self), (self.message, self.status, self.kind, self.retry_after_s)


class WorkerError(RuntimeError):
    """A cohort's attention worker failed: ``index`` (its position in the cohort), ``name``
    (its actor's name or repr), ``message``; ``died``: the actor is gone (the cohort is then
    closed: build a new one without it). The step was aborted on every worker."""

    def __init__(self, index: int, name: str, message: str, died: bool = False):
        super().__init__(f"attention worker {index} ({name}){' died' if died else ''}: {message}")
        self.index, self.name, self.message, self.died = index, name, message, died

    def __reduce__(self):  # raised in the worker's process, carried back by Ray
        return type(self), (self.index, self.name, self.message, self.died)


def raise_status(message: str, status: int, kind: str | None = None, overloaded: bool = False,
                 retry_after_s: float | None = None) -> NoReturn:
    """The client error of an answer with HTTP ``status`` (``overloaded``: refused for load)."""
    if overloaded:
        raise MoEOverloadedError(message, status, kind, retry_after_s) from None
    cls = MoERequestError if 400 <= status < 500 else MoEServerError
    raise cls(message, status, kind) from None


def raise_for(exc: BaseException) -> NoReturn:
    """Raise the client error for ``exc`` (whatever hop wrapped it); client errors as they are."""
    if isinstance(exc, MoEServeError | WorkerError):
        raise exc
    cause = root_cause(exc)
    overloaded = isinstance(cause, BackPressureError)
    raise_status(error_message(cause), http_status(cause), type(cause).__name__, overloaded,
                 cause.retry_after_s if overloaded else None)
