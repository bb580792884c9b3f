"""Where a session's peers go when its group fails: one record per session and deployment.

The opener of a session (``client.session``) records, per deployment, the group serving it now,
the hash of the session's secret and what the session was opened with. A peer whose group
failed asks the app's ingress to move it (``POST /v1/sessions/move``, ``dataplane.peer``);
:func:`move` answers every peer of the session with the same new group: the first ask claims
the move (an atomic create in the GCS key-value store, so two ingress replicas never open two
groups), opens the session on another replica of the deployment and rewrites the record; the
others find the record already moved, or wait for the claim. An open is given up after
``MOVE_OPEN_S`` (the peer asks again), so a live claim ends before one whose ingress died is taken
over (``MOVE_CLAIM_S``); a mover that finds the record moved meanwhile closes its group unused.

The record ends with the session: its opener's close, or the replica's hearing that it ended
for any other reason than a broken group (``serve.sessions``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from ..common.private_api import kv_put_new
from ..config.timeouts import MOVE_CLAIM_S, MOVE_OPEN_S, RELEASE_S
from ..dataplane.peer import GroupEndpoint, endpoint_from_dict
from . import kv

RECORD_PREFIX = "session:"
CLAIM_PREFIX = "session-move:"
CLAIM_POLL_S = 0.1  # another ingress replica is opening the new group: look again this often

# (deployment, opener's arguments) -> the replica's grant (``serve.sessions.GroupSessions.open``)
OpenSession = Callable[..., Awaitable[dict[str, Any]]]


class MoveRefused(Exception):
    """A move that cannot be done (``status``: 400 malformed, 403 wrong secret, 404 unknown
    session) or not yet (503: no group can take the session now; the peer asks again)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def record_key(session: str, deployment: str) -> str:
    return f"{RECORD_PREFIX}{session}:{deployment}"


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def register(session: str, secret: str, group: GroupEndpoint, opened_with: dict[str, Any]) -> None:
    """Record ``group`` as ``session``'s on its deployment (blocking: a GCS call)."""
    kv.put_json(record_key(session, group.deployment),
                {"secret": secret_hash(secret), "group": asdict(group), "open": opened_with})


def forget(session: str, deployment: str, session_id: str | None = None) -> None:
    """Drop the record (``session_id``: only while it still names that group)."""
    key = record_key(session, deployment)
    record = kv.get_json(key)
    if record is not None and (session_id is None or record["group"]["session_id"] == session_id):
        kv.delete(key)


def current(session: str, group: GroupEndpoint) -> GroupEndpoint:
    """The group serving ``session`` on ``group``'s deployment now (``group`` if never moved or
    no longer recorded)."""
    record = kv.get_json(record_key(session, group.deployment))
    return group if record is None else endpoint_of(record)


def check_body(body: Any) -> dict[str, Any]:
    fields = ("session", "deployment", "from", "replica", "secret")
    if not isinstance(body, dict) or not all(isinstance(body.get(f), str) for f in fields):
        raise MoveRefused(400, f"a move names {', '.join(fields)} (strings), got {body!r}")
    return body


async def move(body: Any, open_session: OpenSession) -> GroupEndpoint:
    """The group of ``body['session']`` on ``body['deployment']`` after the one with session id
    ``body['from']`` failed (see the module doc); ``open_session(deployment, **opened_with)``
    asks the deployment for a session (``avoid_replica``: the failed one)."""
    body = check_body(body)
    key = record_key(body["session"], body["deployment"])
    claim = f"{CLAIM_PREFIX}{body['session']}:{body['deployment']}:{body['from']}"
    deadline = time.monotonic() + MOVE_CLAIM_S
    while True:
        record = await asyncio.to_thread(kv.get_json, key)
        if record is None:
            raise MoveRefused(404, f"no session {body['session']!r} on deployment {body['deployment']!r} "
                                   "(it was closed or ended, or another app opened it)")
        if not hmac.compare_digest(record["secret"], secret_hash(body["secret"])):
            raise MoveRefused(403, f"the secret given is not session {body['session']!r}'s")
        if record["group"]["session_id"] != body["from"]:  # moved already: the same group for all
            return endpoint_of(record)
        if await asyncio.to_thread(kv_put_new, claim, str(time.time()), kv.NAMESPACE):
            break
        if time.monotonic() > deadline:  # the claimer died half-way: take the move over
            await asyncio.to_thread(kv.delete, claim)
            deadline = time.monotonic() + MOVE_CLAIM_S
        await asyncio.sleep(CLAIM_POLL_S)
    try:
        try:
            failed = record["group"]["replica"]
            opening = open_session(body["deployment"], avoid_replica=failed, **record["open"])
            grant = await asyncio.wait_for(opening, MOVE_OPEN_S)
        except TimeoutError:  # no replica free yet (Serve may be replacing the only one): asked again
            raise MoveRefused(503, f"no replica of {body['deployment']!r} answered within {MOVE_OPEN_S:.0f} s"
                              ) from None
        if not grant.get("granted"):
            raise MoveRefused(503, f"no replica of {body['deployment']!r} took session {body['session']!r} "
                                   f"yet: {grant.get('reason')}")
        group = GroupEndpoint.from_grant(grant, record["group"]["layers"])
        # The claim keeps a second mover out; should one have taken over all the same (a claim past
        # MOVE_CLAIM_S), the record that moved first wins and this group is closed unused: every
        # peer must meet on one group.
        latest = await asyncio.to_thread(kv.get_json, key)
        if latest is None or latest["group"]["session_id"] != body["from"]:
            await asyncio.to_thread(close_group, group, "a concurrent move of the session won")
            if latest is None:
                raise MoveRefused(404, f"session {body['session']!r} ended while it was being moved")
            return endpoint_of(latest)
        await asyncio.to_thread(kv.put_json, key, {**record, "group": asdict(group)})
        return group
    finally:
        await asyncio.to_thread(kv.delete, claim)


def close_group(group: GroupEndpoint, why: str) -> None:
    """End the session ``group`` names on its rank 0 (blocking: a Ray call)."""
    import ray

    from ..common.workers import WORKER_NAMESPACE, worker_name

    with contextlib.suppress(Exception):  # its replica is gone: the session went with it
        rank0 = ray.get_actor(worker_name(group.deployment, group.replica, 0), namespace=WORKER_NAMESPACE)
        ray.get(rank0.session_close.remote(group.session, why), timeout=RELEASE_S)


def endpoint_of(record: dict[str, Any]) -> GroupEndpoint:
    return endpoint_from_dict(record["group"])
