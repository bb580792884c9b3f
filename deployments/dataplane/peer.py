"""The peers' side of the data plane: a ticket names a session's groups, a peer joins by its index.

    session = client.session(peers=4, max_tokens=8)     # the process that opens it (deployments.client)
    text = session.ticket.to_json()                     # handed to the peers by any channel
    peer = SessionTicket.from_json(text).join(2)        # any process that can reach the ranks' nodes
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
from typing import Any

import numpy as np

from ..common.wire import DeviceRows, WireTensor
from ..config.timeouts import ANSWER_MARGIN_S, CONNECT_S
from . import frames
from .errors import Failure, SessionError
from .frames import Kind, Role


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
    store_port: int = 0  # rank 0's store for device channels (``channel``); 0: it offers none
    channel: str = ""  # the device channel its ranks take ("nccl" on GPUs, "gloo" on CPUs)


@dataclass(frozen=True)
class SessionTicket:
    """What a peer needs to join: the session's name, its number of peers, its groups."""

    name: str
    peers: int
    groups: tuple[GroupEndpoint, ...]

    def join(self, index: int, step: Sequence[int] | None = None, device: str | None = None) -> SessionPeer:
        return SessionPeer(self, index, step, device)

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
    on each group mark the step's bounds for an elastic session (``host``). ``device``: rows
    travel over a device channel (``channel``: NCCL to GPU ranks from a GPU, gloo to CPU ranks
    from the CPU) and answers come back as ``DeviceRows`` on it; None: as bytes on the connection."""

    def __init__(self, ticket: SessionTicket, index: int, step: Sequence[int] | None = None,
                 device: str | None = None):
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
        if device is not None:
            check_channels(ticket, device)
        self.closed: str | None = None
        self.socks: dict[str, socket.socket] = {}
        self.channels: dict[str, Any] = {}  # deployment -> its device channel
        try:
            for g in ticket.groups:
                address = (g.host, g.port)
                self.socks[g.deployment] = frames.connect(address, g.secret, Role.PEER, index, CONNECT_S)
                if device is not None:
                    self.channels[g.deployment] = open_channel(self.socks[g.deployment], g, index, device)
        except BaseException:
            self.close()
            raise

    def forward(self, x: WireTensor | DeviceRows, layer: int, router_logits: np.ndarray | None = None
                ) -> tuple[WireTensor | DeviceRows, str]:
        """This peer's rows of ``layer`` (``[T, H]``, T >= 0) -> ``(its output rows, tail)``."""
        g = self._group(layer)
        flags = self.bounds.get(layer, 0) | (frames.WITH_LOGITS if router_logits is not None else 0)
        sock, channel = self.socks[g.deployment], self.channels.get(g.deployment)
        sent = None
        try:
            if channel is not None and not isinstance(x, DeviceRows):
                x = DeviceRows(x.to_torch(writable=False), x.dtype)
            frames.send(sock, Kind.FORWARD, flags=flags, index=self.index, layer=layer, data=x)
            if channel is not None:
                sent = channel.send(x)
            if router_logits is not None:
                frames.send(sock, Kind.LOGITS, data=WireTensor(np.ascontiguousarray(router_logits,
                                                                                    np.float32), "float32"))
        except OSError:
            pass  # the rank closed: its answer (a BYE) may be waiting, read it below
        return self._answer(g, layer, sent)

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

    def _answer(self, g: GroupEndpoint, layer: int, sent: Any = None) -> tuple[WireTensor | DeviceRows, str]:
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
        if frame.kind is Kind.RESULT and frame.channel is not None:
            try:
                out = self.channels[g.deployment].recv(*frame.channel)
                if sent is not None:
                    sent.wait()
            except (RuntimeError, KeyError) as e:
                self.close(f"device channel failed: {e}")
                raise SessionError(Failure.GROUP_FAILED, f"the device channel to rank 0 of replica "
                                   f"{g.replica} failed during layer {layer}: {e}", None, g.replica) from None
            return out, frame.text
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
        for channel in self.channels.values():
            channel.close()

    def __enter__(self) -> SessionPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_channels(ticket: SessionTicket, device: str) -> None:
    """A peer on ``device`` can open a channel to every group of ``ticket`` (ValueError if not)."""
    from .channel import backend_for, check_backend

    backend = backend_for(device)
    check_backend(backend)
    for g in ticket.groups:
        if g.channel != backend:
            offers = f"offers {g.channel}" if g.channel else "offers no device channel"
            raise ValueError(f"a peer on {device} needs a {backend} channel, but replica {g.replica} of "
                             f"{g.deployment!r} {offers}: join on the device its ranks use, or without one")


def open_channel(sock: socket.socket, g: GroupEndpoint, index: int, device: str) -> Any:
    """Ask rank 0 for a device channel on the admitted connection ``sock``, then build this side."""
    import secrets

    from .channel import Channel

    key = secrets.token_hex(16)
    frames.send(sock, Kind.CHANNEL, index=index, text=json.dumps({"key": key}))
    return Channel(g.channel, g.host, g.store_port, f"{g.session}/{index}/{key}", 1, device, g.call_s)
