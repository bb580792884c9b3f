"""The one retry rule of the Serve path: the handle client (``MoEClient``), the ingress (HTTP and
app-handle calls), and a session's opening (``client.session.open_group``). Sessions -- lanes,
cohorts, independent peers -- leave a broken group by moving (``dataplane.peer``) and follow the
data plane's table (``client.session.runs_again``).

A forward is attempted at most ``MAX_ATTEMPTS`` = 2 times. It is sent again only when the group
that ran it is **known broken** -- a rank died, a rank failed, or the call outlived the group's
call timeout (each marks the group broken for good: the replica turns unhealthy and Serve
replaces it) -- or when the replica itself died under it; and then only to a **different**
replica: the second attempt names the replica that failed (``avoid_replica``), the request router
(``deployments.serve.router``) sends it elsewhere, and a replica that receives a request naming
itself refuses it without running it. Forwards are idempotent, and a broken group runs nothing
more, so the caller never gets an answer computed twice on one group.

Never sent again: bad input (4xx), backpressure (a retry would only add load), and a timeout
the caller measured itself (``RequestTimeoutError``; the call may still be running).

Pure: no Ray import.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import GroupUnavailableError, actor_died, root_cause

MAX_ATTEMPTS = 2

T = TypeVar("T")


@dataclass(frozen=True)
class Resend:
    """The second attempt: anywhere but ``avoid_replica`` (None: the failed replica is unknown,
    e.g. it died, so it takes no more requests anyway)."""

    avoid_replica: str | None


def resend_after(exc: BaseException) -> Resend | None:
    """The rule: a second attempt after ``exc`` (the first attempt's error), or None."""
    cause = root_cause(exc)
    if isinstance(cause, GroupUnavailableError):
        return Resend(cause.replica)
    if actor_died(cause):
        return Resend(None)
    return None


def call_with_retry(attempt: Callable[[str | None], T]) -> T:
    """``attempt(avoid_replica)``: first with None, then once more per :func:`resend_after`."""
    try:
        return attempt(None)
    except Exception as e:
        again = resend_after(e)
        if again is None:
            raise
    return attempt(again.avoid_replica)


async def call_with_retry_async(attempt: Callable[[str | None], Awaitable[T]]) -> T:
    """The asyncio twin of :func:`call_with_retry`."""
    try:
        return await attempt(None)
    except Exception as e:
        again = resend_after(e)
        if again is None:
            raise
    return await attempt(again.avoid_replica)
