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

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..common.errors import ServeInputError, error_message
from ..common.requests import as_logits, as_rows, is_torch_tensor
from ..config.timeouts import DEFAULT_RETRY_S, DEFAULT_WAIT_S, RANK_POLL_S
from ..dataplane.errors import Action, SessionError
from ..dataplane.peer import SessionPeer, SessionTicket
from .errors import raise_for
from .leases import GroupLease, default_client_name, endpoint, layers_by_deployment


class SessionRefused(RuntimeError):
    """No group of a deployment would open the session (full, ``lanes: false``, or none healthy)
    within the wait; the groups already opened were closed."""


class Session:
    """A session of ``peers`` peers (see the module doc); built by :meth:`MoEClient.session`."""

    def __init__(self, client: Any, peers: int, *, layers: Iterable[int] | None = None, max_tokens: int = 1,
                 wait_s: float = DEFAULT_WAIT_S, name: str | None = None, idle_after_s: float | None = None,
                 linger_s: float | None = None):
        if isinstance(peers, bool) or not isinstance(peers, int) or peers < 1:
            raise ValueError(f"peers must be a positive integer, got {peers!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer (rows per peer and layer), "
                             f"got {max_tokens!r}")
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
        except BaseException:
            self.close()
            raise
        groups = tuple(endpoint(lease.grant, [x for x in chosen if by_layer[x] == d])
                       for d, lease in self.leases.items())
        self.ticket = SessionTicket(self.name, peers, groups)

    def state(self) -> dict[str, dict[str, Any] | None]:
        """Each group's record of the session, as its rank 0 has it now (``ended`` and ``failure``
        say why it is over), by deployment; None where rank 0 does not answer."""
        import ray

        out = {}
        for d, lease in self.leases.items():
            grant = lease.grant
            try:
                snap = ray.get(grant["ranks"][0].sessions_snapshot.remote(), timeout=RANK_POLL_S)
                out[d] = snap["sessions"].get(grant["session"]) or {"ended": "no longer open on rank 0"}
            except Exception as e:  # rank 0 gone: the group failed
                out[d] = {"ended": f"rank 0 does not answer: {error_message(e)}", "failure": "group_failed"}
        return out

    def join(self, index: int, step: Iterable[int] | None = None, device: str | None = None) -> Peer:
        """Peer ``index`` in this process (usually each peer joins in its own: :func:`join`)."""
        return Peer(self.ticket, index, step, device)

    def status(self) -> dict[str, Any]:
        return {"session": self.name, "peers": self.ticket.peers, "layers": list(self.ticket.layers),
                "closed": self.closed, "deployments": {d: lease.status() for d, lease in self.leases.items()}}

    def close(self, why: str = "closed by its opener") -> None:
        """End the session on every group: its peers are told ``why`` (idempotent)."""
        if self.closed is None:
            self.closed = why
        for lease in self.leases.values():
            if lease.held:
                GroupLease.release(lease.take(why), why)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Peer:
    """Peer ``index`` of a session: numpy float32 (rounded to the deployment dtype, as the Serve
    path does) or torch rows in, the same kind out. ``device``: torch rows travel over a device
    channel from that device and come back on it (``dataplane.channel``)."""

    def __init__(self, ticket: SessionTicket, index: int, step: Iterable[int] | None = None,
                 device: str | None = None):
        self.ticket, self.index, self.device = ticket, index, device
        self.peer = SessionPeer(ticket, index, None if step is None else tuple(step), device)

    def forward(self, hidden_states: Any, layer: int, router_logits: Any = None) -> Any:
        g = self.ticket.group_for(layer) if isinstance(layer, int) else None
        try:
            if g is None:
                raise ServeInputError(f"layer {layer!r} is not one of session {self.ticket.name!r}'s layers "
                                      f"{list(self.ticket.layers)}")
            x = as_rows(hidden_states, "hidden_states", g.dtype, on_device=self.device is not None)
            logits = None if router_logits is None else as_logits(router_logits)
        except ServeInputError as e:
            raise_for(e)
        try:
            out, _ = self.peer.forward(x, layer, logits)
        except SessionError as e:
            if e.action is Action.CALLER_ERROR:
                raise_for(e.input_error())
            raise
        if is_torch_tensor(hidden_states):
            return out.to_torch()
        return out.float32() if isinstance(hidden_states, np.ndarray) else out

    def fail(self, layer: int, message: str) -> SessionError:
        """Take part in ``layer`` with this peer's own failure: every peer's layer ends naming it."""
        return self.peer.fail(layer, message)

    def close(self) -> None:
        self.peer.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def join(ticket: SessionTicket, index: int, step: Iterable[int] | None = None, device: str | None = None
         ) -> Peer:
    """Join ``ticket``'s session as peer ``index`` (any process that reaches the ranks' nodes);
    ``step``: the layers it calls per step, in order (default: every layer of the ticket);
    ``device``: its torch rows go over a device channel from there (NCCL between GPUs, gloo on
    CPUs; the ticket says which its groups offer), not as bytes on the connection."""
    return Peer(ticket, index, step, device)
