"""Sessions for independent processes: one process opens it, any number of peer processes join.

    # the process that owns the session (a Ray driver or actor of the app's cluster)
    with MoEClient("default").session(peers=4, max_tokens=8) as session:
        ticket = session.ticket.to_json()          # hand it to the peers: any channel will do
        ...
    # each peer process (reaches the ranks' nodes; needs no Ray)
    peer = join(SessionTicket.from_json(ticket), index=2)
    out = peer.forward(x_TH, layer)               # numpy or torch in, the same kind out

A session is opened on one replica's TP group per deployment serving its layers for ``peers``
peers (``client.leases``; all of them or none: a group that cannot be had closes the others).
It shares the groups with the Serve path and other sessions and has no term: it lasts until
:meth:`Session.close` (or, once its opener is gone, until none of its peers has been connected
for ``linger_s``: the spec's ``session_linger_s`` unless given). Each peer sends its rows per MoE
layer (0 rows allowed: a peer with nothing to do still takes part) and blocks until its slice of
that layer's one forward comes back (``deployments.dataplane``).
Every peer must call the same layers in the same order; a peer that dies or stalls ends the
session for all, with an error naming it. An *elastic* session (``idle_after_s``) is for engines
that step on their own (vLLM's): a peer may join late, idle, leave or die and the others go on;
at each step's start the group waits up to ``idle_after_s`` for its peers of the last step.
Errors: :class:`MoERequestError` for this peer's bad input (the session stays usable), else
:class:`~deployments.dataplane.errors.SessionError` with its ``failure`` and the ``action`` the
data plane's table gives.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Any

from ..cluster import moves
from ..common.errors import error_message
from ..common.private_api import serve_app_url
from ..common.workers import WORKER_NAMESPACE, worker_name
from ..config.timeouts import DEFAULT_RETRY_S, DEFAULT_WAIT_S, RANK_POLL_S, RELEASE_S, SESSION_MOVE_S
from ..dataplane.peer import GroupEndpoint, Peer, SessionTicket
from .leases import GroupLease, check_seconds, default_client_name, layers_by_deployment


class SessionRefused(RuntimeError):
    """No group of a deployment would open the session (full, ``lanes: false``, or none healthy)
    within the wait; the groups already opened were closed."""


class Session:
    """A session of ``peers`` peers (see the module doc); built by :meth:`MoEClient.session`."""

    def __init__(self, client: Any, peers: int, *, layers: Iterable[int] | None = None, max_tokens: int = 1,
                 wait_s: float = DEFAULT_WAIT_S, name: str | None = None, idle_after_s: float | None = None,
                 linger_s: float | None = None, url: str | None = None, move_s: float = SESSION_MOVE_S):
        if isinstance(peers, bool) or not isinstance(peers, int) or peers < 1:
            raise ValueError(f"peers must be a positive integer, got {peers!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer (rows per peer and layer), "
                             f"got {max_tokens!r}")
        check_seconds(move_s=move_s)
        self.name = name or f"session-{default_client_name()}"
        chosen, by_layer = layers_by_deployment(client, layers)
        self.leases = {d: GroupLease(client, d, self.name, max_tokens, DEFAULT_RETRY_S, peers=peers,
                                     idle_after_s=idle_after_s, linger_s=linger_s)
                       for d in sorted(set(by_layer.values()))}
        self.closed: str | None = None
        try:
            for d, lease in self.leases.items():
                if not lease.acquire(float(wait_s)):
                    raise SessionRefused(f"session {self.name!r}: no group of deployment {d!r} would open it "
                                         f"within {float(wait_s):g} s: {lease.why_not}")
            groups = tuple(GroupEndpoint.from_grant(lease.grant, [x for x in chosen if by_layer[x] == d])
                           for d, lease in self.leases.items())
            secret = secrets.token_hex(16)
            url = serve_app_url(client.app_name) if url is None else url
            self.ticket = SessionTicket(self.name, peers, groups, url, secret, float(move_s))
            opened_with = {"client": self.name, "max_tokens": max_tokens, "peers": peers,
                           "idle_after_s": idle_after_s, "linger_s": linger_s}
            for g in groups:
                moves.register(self.name, secret, g, opened_with)
        except BaseException:
            self.close()
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
                snap = ray.get(rank0_of(g).sessions_snapshot.remote(), timeout=RANK_POLL_S)
                out[d] = snap["sessions"].get(g.session) or {"ended": "no longer open on rank 0"}
            except Exception as e:  # rank 0 gone: the group failed
                out[d] = {"ended": f"rank 0 does not answer: {error_message(e)}", "failure": "group_failed"}
        return out

    def join(self, index: int, step: Iterable[int] | None = None, device: str | None = None) -> Peer:
        """Peer ``index`` in this process (usually each peer joins in its own: :func:`join`)."""
        return Peer(self.ticket, index, step, device)

    def status(self) -> dict[str, Any]:
        return {"session": self.name, "peers": self.ticket.peers, "layers": list(self.ticket.layers),
                "closed": self.closed, "url": self.ticket.url,
                "deployments": {d: {"replica": g.replica, "session_id": g.session_id}
                                for d, g in (self.groups().items() if self.closed is None else ())}}

    def close(self, why: str = "closed by its opener") -> None:
        """End the session on every group: its peers are told ``why`` (idempotent)."""
        if self.closed is not None:
            return
        self.closed = why
        ticket = getattr(self, "ticket", None)
        if ticket is None:  # refused while opening: close what was opened
            for lease in self.leases.values():
                if lease.held:
                    GroupLease.release(lease.take(why), why)
            return
        close_groups(ticket, why)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rank0_of(g: GroupEndpoint) -> Any:
    import ray

    return ray.get_actor(worker_name(g.deployment, g.replica, 0), namespace=WORKER_NAMESPACE)


def close_groups(ticket: SessionTicket, why: str) -> list[str]:
    """End ``ticket``'s session on the group serving it now on each deployment (its peers are told
    ``why``) and drop its move records; what could not be closed (its replica is gone: the session
    went with it)."""
    import ray

    failed = []
    for g in ticket.groups:
        current = moves.current(ticket.name, g)
        try:
            ray.get(rank0_of(current).session_close.remote(current.session, why), timeout=RELEASE_S)
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
