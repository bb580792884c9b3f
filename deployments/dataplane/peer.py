"""The peers' side of the data plane: a ticket names a session's groups, a peer joins by its index.

    ticket = client.session(peers=4, max_tokens=8)      # the process that leases (deployments.client)
    peer = ticket.join(2)                               # any process that can reach the ranks' nodes
    out, tail = peer.forward(rows, layer)               # blocks until this peer's slice comes back

A :class:`SessionTicket` is small and serialisable (``to_json``/``from_json``, or pickled by Ray):
per TP group serving the session's layers, rank 0's address, the session's secret for that group
and the group's shape. :meth:`SessionTicket.join` connects peer ``index`` to every group once
(admitted by the secret, ``frames.admit``); :meth:`SessionPeer.forward` sends this peer's rows
for one layer to the group serving it and waits -- a blocking read on its own connection, no
polling -- for its slice of that layer's one forward. A layer ended without a result raises
:class:`~deployments.dataplane.errors.SessionError`; its ``action`` says what the caller does.

Pure: no Ray, no torch.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..common.wire import WireTensor
from . import frames
from .errors import Failure, SessionError
from .frames import Kind, Role

CONNECT_S = 10.0  # joining a group: connect and handshake
ANSWER_MARGIN_S = 5.0  # a peer's wait for its answer over the layer's bounds (peers, then forward)


def answer_bound_s(call_s: float) -> float:
    """A peer's wait for a layer's answer: its peers (up to a call bound), then the forward (another)."""
    return 2 * call_s + ANSWER_MARGIN_S


@dataclass(frozen=True)
class GroupEndpoint:
    """One TP group of a session: where its rank 0 listens and what it serves."""

    deployment: str
    replica: str
    lease_id: str
    host: str
    port: int
    secret: str
    session: int  # the session's number on that rank 0
    layers: tuple[int, ...]
    hidden_size: int
    dtype: str
    call_s: float
    max_tokens: int  # rows per peer and layer


@dataclass(frozen=True)
class SessionTicket:
    """What a peer needs to join: the session's name, its number of peers, its groups."""

    name: str
    peers: int
    groups: tuple[GroupEndpoint, ...]

    def join(self, index: int, step: Sequence[int] | None = None) -> SessionPeer:
        return SessionPeer(self, index, step)

    def group_for(self, layer: int) -> GroupEndpoint | None:
        return next((g for g in self.groups if layer in g.layers), None)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(x for g in self.groups for x in g.layers))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SessionTicket:
        raw = json.loads(text)
        groups = tuple(GroupEndpoint(**{**g, "layers": tuple(g["layers"])}) for g in raw["groups"])
        return cls(raw["name"], raw["peers"], groups)


class SessionPeer:
    """Peer ``index`` of a session (one call at a time; see the module doc). ``step``: the layers
    this peer calls per step, in order (default: every layer of the ticket); the first and last
    on each group mark the step's bounds for an elastic session (``host``)."""

    def __init__(self, ticket: SessionTicket, index: int, step: Sequence[int] | None = None):
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < ticket.peers:
            raise ValueError(f"peer index must be in [0, {ticket.peers}) for session {ticket.name!r} of "
                             f"{ticket.peers} peers, got {index!r}")
        step = ticket.layers if step is None else tuple(step)
        unknown = sorted(set(step) - set(ticket.layers))
        if not step or unknown:
            raise ValueError(f"a peer's step must be some of session {ticket.name!r}'s layers "
                             f"{list(ticket.layers)}, got {list(step)}")
        self.ticket, self.index = ticket, index
        self.bounds: dict[int, int] = {}  # layer -> its NEW_STEP / END_STEP flags
        for g in ticket.groups:
            mine = [x for x in step if x in g.layers]
            if mine:
                self.bounds[mine[0]] = self.bounds.get(mine[0], 0) | frames.NEW_STEP
                self.bounds[mine[-1]] = self.bounds.get(mine[-1], 0) | frames.END_STEP
        self.closed: str | None = None
        self.socks: dict[str, socket.socket] = {}
        try:
            for g in ticket.groups:
                address = (g.host, g.port)
                self.socks[g.deployment] = frames.connect(address, g.secret, Role.PEER, index, CONNECT_S)
        except BaseException:
            self.close()
            raise

    def forward(self, x: WireTensor, layer: int, router_logits: np.ndarray | None = None
                ) -> tuple[WireTensor, str]:
        """This peer's rows of ``layer`` (``[T, H]``, T >= 0) -> ``(its output rows, tail)``."""
        g = self._group(layer)
        flags = self.bounds.get(layer, 0) | (frames.WITH_LOGITS if router_logits is not None else 0)
        sock = self.socks[g.deployment]
        try:
            frames.send(sock, Kind.FORWARD, flags=flags, index=self.index, layer=layer, data=x)
            if router_logits is not None:
                frames.send(sock, Kind.LOGITS, data=WireTensor(np.ascontiguousarray(router_logits,
                                                                                    np.float32), "float32"))
        except OSError:
            pass  # the rank closed: its answer (a BYE) may be waiting, read it below
        return self._answer(g, layer)

    def fail(self, layer: int, message: str) -> SessionError:
        """Take part in ``layer`` with this peer's own failure (``message``): the layer ends for every
        peer with ``Failure.PEER_FAILED`` naming this one; returns that error."""
        g = self._group(layer)
        with contextlib.suppress(OSError):
            frames.send(self.socks[g.deployment], Kind.FAIL, flags=self.bounds.get(layer, 0),
                        index=self.index, layer=layer, text=message)
        try:
            self._answer(g, layer)
        except SessionError as e:
            return e
        return SessionError(Failure.PEER_FAILED, message, self.index, g.replica)

    def _group(self, layer: int) -> GroupEndpoint:
        if self.closed is not None:
            raise SessionError(Failure.SESSION_ENDED, f"peer {self.index} of session {self.ticket.name!r} "
                               f"is closed: {self.closed}")
        g = self.ticket.group_for(layer)
        if g is None:
            raise SessionError(Failure.INPUT, f"layer {layer!r} is not one of session {self.ticket.name!r}'s "
                               f"layers {list(self.ticket.layers)}")
        return g

    def _answer(self, g: GroupEndpoint, layer: int) -> tuple[WireTensor, str]:
        sock = self.socks[g.deployment]
        bound_s = answer_bound_s(g.call_s)
        sock.settimeout(bound_s)
        try:
            frame = frames.recv(sock)
        except TimeoutError:
            self.close(f"no answer for layer {layer} within {bound_s:.0f} s")
            raise SessionError(Failure.GROUP_TIMEOUT, f"replica {g.replica} did not answer layer {layer} "
                               f"within {bound_s:.0f} s: a rank is stalled", None, g.replica) from None
        except (frames.ConnectionLost, OSError) as e:
            self.close(f"connection lost: {e}")
            raise SessionError(Failure.GROUP_FAILED, f"rank 0 of replica {g.replica} closed the connection "
                               f"during layer {layer}: {e}", None, g.replica) from None
        if frame.kind is Kind.RESULT:
            return frame.data, frame.text
        meta = frame.meta()
        failure = Failure(meta["kind"])
        if frame.kind is Kind.BYE:
            self.close(meta["message"])
        elif frame.kind is not Kind.ERROR:
            self.close(f"unexpected {frame.kind.name} message")
            raise SessionError(Failure.OUT_OF_STEP, f"replica {g.replica} answered layer {layer} with a "
                               f"{frame.kind.name} message", None, g.replica)
        raise SessionError(failure, meta["message"], meta.get("peer"), g.replica, meta.get("error", ""))

    def close(self, why: str = "closed by its owner") -> None:
        if self.closed is None:
            self.closed = why
        for sock in self.socks.values():
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> SessionPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
