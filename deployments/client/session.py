"""Sessions: one process opens it, peers join it; lanes and cohorts are sessions too.

    # the process that owns the session (a Ray driver or actor of the app's cluster)
    with MoEClient("default").session(peers=4, max_tokens=8) as session:
        ticket = session.ticket.to_json()          # hand it to the peers: any channel will do
        ...
    # each peer process (reaches the ranks' nodes; needs no Ray)
    peer = join(SessionTicket.from_json(ticket), index=2)
    out = peer.forward(x_TH, layer)               # numpy or torch in, the same kind out

A session is opened on one replica's TP group per deployment serving its layers for ``peers``
peers (:func:`open_group`, through the Serve path: the control plane; all of them or none: a
group that cannot be had closes the others). It shares the groups with the Serve path and other
sessions and has no term: it lasts until :meth:`Session.close` (or, once its opener is gone,
until none of its peers has been connected for ``linger_s``: the spec's ``session_linger_s``
unless given). Each peer sends its rows per MoE layer (0 rows allowed: a peer with nothing to do
still takes part) and blocks until its slice of that layer's one forward comes back
(``deployments.dataplane``). Its ticket carries the app's HTTP address and the session's own
secret, so its peers move by themselves to a healthy group when theirs fails
(``dataplane.peer``). Every peer must call the same layers in the same order; a peer that dies or
stalls ends the session for all, with an error naming it. An *elastic* session
(``idle_after_s``) is for engines that step on their own (vLLM's): a peer may join late, idle,
leave or die and the others go on; at each step's start the group waits up to ``idle_after_s``
for its peers of the last step. Errors: :class:`MoERequestError` for this peer's bad input (the
session stays usable), else :class:`~deployments.dataplane.errors.SessionError` with its
``failure`` and the ``action`` the data plane's table gives.

A lane (``client.lane``: one peer per deployment) and a cohort (``client.cohort``: its M workers)
hold their session in a :class:`SessionOrServe` -- the Serve path while none can be had, asked
again every ``retry_s`` -- and follow :func:`runs_again`, the one retry rule.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..cluster import moves
from ..common.errors import error_message
from ..common.private_api import serve_app_url
from ..common.retry import resend_after
from ..common.workers import WORKER_NAMESPACE, worker_name
from ..config.timeouts import DEFAULT_WAIT_S, OPEN_ATTEMPT_S, RANK_POLL_S, RELEASE_S, SESSION_MOVE_S
from ..dataplane.errors import Action, MoEServeError
from ..dataplane.peer import GroupEndpoint, Peer, SessionTicket
from .errors import raise_for

logger = logging.getLogger(__name__)


class SessionRefused(RuntimeError):
    """No group of a deployment would open the session (full, ``lanes: false``, or none healthy)
    within the wait; the groups already opened were closed."""


def default_client_name() -> str:
    return f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def check_seconds(**values: Any) -> None:
    for what, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
            raise ValueError(f"{what} must be a number of seconds >= 0, got {v!r}")


def served_layers(client: Any, layers: Iterable[int] | None) -> tuple[int, ...]:
    """``layers`` (None: every layer the app serves), each checked against the routing table."""
    served = {x for ls in client.layer_routes().layers.values() for x in ls}
    wanted = sorted(served) if layers is None else sorted({int(x) for x in layers})
    unknown = [x for x in wanted if x not in served]
    if unknown:
        raise ValueError(f"layer(s) {unknown} are not served by app {client.app_name!r} "
                         f"(it serves {sorted(served)})")
    return tuple(wanted)


def layers_by_deployment(client: Any, layers: Iterable[int] | None) -> tuple[tuple[int, ...], dict[int, str]]:
    """The layers a session serves (None: every layer of the client's app, or of its deployment for
    a client bound to one: ``MoEClient.direct``) and the deployment serving each."""
    if client.deployment is None:
        chosen = served_layers(client, layers)
        routes = client.layer_routes()
        return chosen, {x: routes.choose(x, None) for x in chosen}
    status = client.group_handle(client.deployment).status.remote().result(timeout_s=client.timeout_s)
    served = tuple(status["layers"])
    chosen = served if layers is None else tuple(sorted({int(x) for x in layers}))
    unknown = sorted(set(chosen) - set(served))
    if unknown:
        raise ValueError(f"layer(s) {unknown} are not served by deployment {client.deployment!r} "
                         f"(it serves {list(served)})")
    return chosen, dict.fromkeys(chosen, client.deployment)


def open_group(client: Any, deployment: str, opened_with: dict[str, Any], wait_s: float) -> dict[str, Any]:
    """A replica's grant of a session on its TP group (``serve.sessions``; the request router
    sends the ask to the least-loaded healthy replica), asking again for up to ``wait_s`` while
    replicas refuse it (full, ``lanes: false``). ``opened_with``: ``open_session``'s arguments
    (client, max_tokens, peers, workers, idle_after_s, linger_s). Raises :class:`SessionRefused`
    with the last reason, or the caller's error (e.g. ``peers x max_tokens`` too large)."""
    handle = client.group_handle(deployment)
    deadline = time.monotonic() + wait_s
    avoid: str | None = None
    while True:
        try:
            grant = handle.open_session.remote(avoid_replica=avoid, **opened_with).result(
                timeout_s=client.timeout_s)
        except Exception as e:
            # The replica asked has a known-broken group (or died) and the router has not steered
            # around it yet: ask once more, elsewhere (common.retry's rule), then give up.
            again = resend_after(e)
            if again is None:
                raise_for(e)
            if avoid is not None or again.avoid_replica is None:
                why = f"opening a session on {deployment!r} failed: {error_message(e)}"
                raise SessionRefused(why) from None
            avoid = again.avoid_replica
            continue
        if grant["granted"]:
            logger.info("%s: %s opened session %s on replica %s (TP %d)", opened_with["client"], deployment,
                        grant["session_id"], grant["replica"], grant["world"])
            return grant
        if time.monotonic() >= deadline:
            raise SessionRefused(f"session refused by replica {grant['replica']}: {grant['reason']}")
        # Full or refusing: a session may end, or the router's view of the replicas' load (it lags
        # by up to its stats period) may send the next ask elsewhere.
        time.sleep(min(OPEN_ATTEMPT_S, max(0.0, deadline - time.monotonic())))


def close_grant(grant: dict[str, Any], why: str) -> None:
    """End the session a grant opened on its rank 0 (ranks gone: it ended with them)."""
    import ray

    with contextlib.suppress(Exception):
        ray.get(grant["ranks"][0].session_close.remote(grant["session"], why), timeout=RELEASE_S)


class Session:
    """A session of ``peers`` peers (see the module doc); built by :meth:`MoEClient.session`, and
    by lanes and cohorts. ``workers``: a cohort's workers' names (the replica lists them)."""

    def __init__(self, client: Any, peers: int, *, layers: Iterable[int] | None = None, max_tokens: int = 1,
                 wait_s: float = DEFAULT_WAIT_S, name: str | None = None, idle_after_s: float | None = None,
                 linger_s: float | None = None, url: str | None = None, move_s: float = SESSION_MOVE_S,
                 workers: Sequence[str] = ()):
        if isinstance(peers, bool) or not isinstance(peers, int) or peers < 1:
            raise ValueError(f"peers must be a positive integer, got {peers!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer (rows per peer and layer), "
                             f"got {max_tokens!r}")
        check_seconds(wait_s=wait_s, move_s=move_s)
        self.name = name or f"session-{default_client_name()}"
        chosen, by_layer = layers_by_deployment(client, layers)
        opened_with = {"client": self.name, "max_tokens": max_tokens, "peers": peers,
                       "workers": list(workers), "idle_after_s": idle_after_s, "linger_s": linger_s}
        self.closed: str | None = None
        self.ticket: SessionTicket | None = None
        grants: list[dict[str, Any]] = []
        try:
            for d in sorted(set(by_layer.values())):
                try:
                    grants.append(open_group(client, d, opened_with, float(wait_s)))
                except SessionRefused as e:
                    raise SessionRefused(f"session {self.name!r}: no group of deployment {d!r} would open it "
                                         f"within {float(wait_s):g} s: {e}") from None
            groups = tuple(GroupEndpoint.from_grant(g, [x for x in chosen if by_layer[x] == g["deployment"]])
                           for g in grants)
            secret = secrets.token_hex(16)
            url = serve_app_url(client.app_name) if url is None else url
            for g in groups:
                moves.register(self.name, secret, g, opened_with)
            self.ticket = SessionTicket(self.name, peers, groups, url, secret, float(move_s))
        except BaseException:
            self.closed = "refused while opening"
            for grant in grants:
                close_grant(grant, self.closed)
                moves.forget(self.name, grant["deployment"], grant["session_id"])
            raise

    def groups(self) -> dict[str, GroupEndpoint]:
        """The group serving the session on each deployment now (its peers may have moved it)."""
        return {g.deployment: moves.current(self.name, g) for g in self.ticket.groups}

    def state(self) -> dict[str, dict[str, Any] | None]:
        """Each group's record of the session, as its rank 0 has it now (``ended`` and ``failure``
        say why it is over), by deployment; None where rank 0 does not answer."""
        import ray

        out = {}
        for d, g in self.groups().items():
            try:
                snap = ray.get(rank_of(g).sessions_snapshot.remote(), timeout=RANK_POLL_S)
                out[d] = snap["sessions"].get(g.session) or gone_from(snap)
            except Exception as e:  # rank 0 gone: the group failed
                out[d] = {"ended": f"rank 0 does not answer: {error_message(e)}", "failure": "group_failed"}
        return out

    def join(self, index: int, step: Iterable[int] | None = None, device: str | None = None) -> Peer:
        """Peer ``index`` in this process (usually each peer joins in its own: :func:`join`)."""
        return Peer(self.ticket, index, step, device)

    def status(self) -> dict[str, Any]:
        return {"session": self.name, "peers": self.ticket.peers, "layers": list(self.ticket.layers),
                "closed": self.closed, "url": self.ticket.url,
                "deployments": {d: {"path": "session", "replica": g.replica, "session_id": g.session_id}
                                for d, g in (self.groups().items() if self.closed is None else ())}}

    def close(self, why: str = "closed by its opener") -> None:
        """End the session on every group: its peers are told ``why`` (idempotent)."""
        if self.closed is not None:
            return
        self.closed = why
        close_groups(self.ticket, why)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gone_from(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Why a session is missing from its group's rank 0 (``sessions_snapshot``): the group failed
    (its peers move the session: not its end), or it ended there."""
    if snapshot.get("failed"):
        return {"ended": f"its group failed: {snapshot['failed']}",
                "failure": snapshot.get("failure") or "group_failed"}
    return {"ended": "no longer open on rank 0"}


def rank_of(g: GroupEndpoint, rank: int = 0) -> Any:
    """The actor of ``rank`` of group ``g``."""
    import ray

    return ray.get_actor(worker_name(g.deployment, g.replica, rank), namespace=WORKER_NAMESPACE)


def close_groups(ticket: SessionTicket, why: str) -> list[str]:
    """End ``ticket``'s session on the group serving it now on each deployment (its peers are told
    ``why``) and drop its move records; what could not be closed (its replica is gone: the session
    went with it)."""
    import ray

    failed = []
    for g in ticket.groups:
        current = moves.current(ticket.name, g)
        try:
            ray.get(rank_of(current).session_close.remote(current.session, why), timeout=RELEASE_S)
        except Exception as e:
            failed.append(f"{current.deployment} (replica {current.replica}): {error_message(e)}")
        moves.forget(ticket.name, g.deployment)
    return failed


def join(ticket: SessionTicket, index: int, step: Iterable[int] | None = None, device: str | None = None
         ) -> Peer:
    """Join ``ticket``'s session as peer ``index`` (any process that reaches the ranks' nodes);
    ``step``: the layers it calls per step, in order (default: every layer of the ticket);
    ``device``: its torch rows go over a device channel from there (NCCL between GPUs, gloo on
    CPUs; the ticket says which its groups offer), not as bytes on the connection."""
    return Peer(ticket, index, step, device)


def runs_again(error: BaseException, attempt: int) -> bool:
    """The one retry rule of a lane's call and a cohort's step, read from the data plane's table
    (``dataplane.errors.ACTIONS``): it runs at most twice, the second time only when the first
    met a session that ended under it before running it (``START_OVER``: closed, lingered out),
    on a session opened anew or the Serve path. A broken group is not retried here: the peers
    moved to a healthy one by themselves, and ``RETRY_ELSEWHERE`` reaching the caller means no
    group took the session within its ``move_s``."""
    return attempt == 1 and isinstance(error, MoEServeError) and error.action is Action.START_OVER


class SessionOrServe:
    """A lane's or a cohort's session while one can be had, else the Serve path: ``open(wait_s)``
    opens it (the owner's opener: a :class:`Session`, joined), and while it is refused (full,
    ``lanes: false``, no healthy group) the owner's calls take the Serve path and it is asked for
    again once ``retry_s`` has passed (:meth:`get`). Admission, not faults: a session's faults
    follow :func:`runs_again`."""

    def __init__(self, opener: Callable[[float], Session], retry_s: float):
        self.opener, self.retry_s = opener, retry_s
        self.session: Session | None = None
        self.why_serve = "not opened yet"
        self.next_try = 0.0  # when a refused session is asked for again
        self.opened = 0

    def get(self, wait_s: float = 0.0) -> Session | None:
        """The session (opening it first when due: asking for up to ``wait_s``), or None: the
        Serve path."""
        if self.session is None and time.monotonic() >= self.next_try:
            try:
                self.session = self.opener(wait_s)
            except SessionRefused as e:
                self.why_serve, self.next_try = str(e), time.monotonic() + self.retry_s
                logger.info("%s; the Serve path until asked again in %g s", e, self.retry_s)
            else:
                self.opened += 1
                self.why_serve = ""
        return self.session

    def drop(self, why: str) -> None:
        """Close the session (its peers are told ``why``); a new one is asked for at the next call."""
        session, self.session = self.session, None
        if session is not None:
            self.why_serve = why
            session.close(why)

    def status(self, groups: dict[str, GroupEndpoint] | None = None) -> dict[str, Any]:
        """The path, and where the session is (``groups``: the owner's view of them, else its
        records') by deployment."""
        session = self.session
        if session is None:
            return {"path": "serve", "why_serve": self.why_serve, "sessions": self.opened, "deployments": {}}
        groups = groups if groups is not None else session.groups()
        where = {d: {"replica": g.replica, "session_id": g.session_id} for d, g in groups.items()}
        return {"path": "session", "why_serve": None, "sessions": self.opened, "deployments": where}
