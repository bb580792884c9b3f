"""``wait_until``: poll a condition instead of sleeping a fixed time (tests import it as
``from waiting import wait_until``; pytest puts tests/ on sys.path, as for conftest)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _short(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def wait_until(condition: Callable[[], T], timeout_s: float, what: str | Callable[[], str] = "",
               every_s: float = 0.05, ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``condition()`` every ``every_s`` until it returns a truthy value, and return that
    value. Once ``timeout_s`` has passed (and one last call at the deadline answered falsy),
    raise AssertionError naming ``what`` and the last value returned.

    ``what`` may be a callable: it is called only then, to describe the state at the timeout.
    An exception of a type in ``ignoring`` counts as "not yet" (the last one is chained to the
    AssertionError); any other exception propagates at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        error: BaseException | None = None
        try:
            value = condition()
        except ignoring as e:
            value, error = None, e
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            try:
                described = what() if callable(what) else what
            except Exception as e:  # noqa: BLE001 -- the timeout is the failure to report
                described = f"(describing the state failed: {e!r})"
            last = f"raised {_short(error)}" if error is not None else f"returned {_short(value)}"
            raise AssertionError(f"not within {timeout_s:g} s: {described or 'condition'} "
                                 f"(last call {last})") from error
        time.sleep(min(every_s, remaining))
