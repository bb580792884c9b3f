"""The peers' side of the data plane: a ticket names a session's groups, a peer joins by its index.

    session = client.session(peers=4, max_tokens=8)     # the process that opens it (deployments.client)
    text = session.ticket.to_json()                     # handed to the peers by any channel
    peer = SessionTicket.from_json(text).join(2)        # any process that can reach the ranks' nodes
    out = peer.forward(rows, layer)                     # numpy or torch in, the same kind out

A :class:`SessionTicket` is small and serialisable (``to_json``/``from_json``, or pickled by Ray):
per TP group serving the session's layers, rank 0's address, the session's secret for that group
and the group's shape; and the app's HTTP address with the session's own secret, for moves.
:meth:`SessionTicket.join` connects peer ``index`` to every group once (admitted by the secret,
``frames.admit``; a refusal raises :class:`~deployments.dataplane.errors.JoinRefused` naming why;
a peer joining after the session moved finds its group through the app, as a move does);
:meth:`Peer.forward` sends this peer's rows for one layer to the group serving it and waits -- a
blocking read on its own connection, no polling -- for its slice of that layer's one forward.

**Peers move by themselves.** When the group serving a layer fails (a rank died or stalled, its
replica was replaced, scaled down or redeployed), the peer asks the app (``POST
/v1/sessions/move`` on the ticket's ``url``, proving the session's secret) for the session's group
on another replica of the same deployment -- the first peer to ask opens it there, the others get
the same one -- joins it and sends the layer again as the start of a step, so a step that moves
starts whole on the new group. It keeps asking until ``move_s`` after the failure; only then does
the caller get the failure. A Ray-less peer can do all of it: the ticket holds what it needs.
A layer ended without a result for any other reason raises
:class:`~deployments.dataplane.errors.SessionError`; its ``action`` says what the caller does.

Pure: no Ray, no torch at import (torch rows are converted when they come).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..common.errors import ServeInputError
from ..common.requests import as_logits, as_rows, is_torch_tensor
from ..common.wire import DeviceRows, WireTensor
from ..config.timeouts import ANSWER_MARGIN_S, CONNECT_S, MOVE_ASK_S, MOVE_RETRY_S, SESSION_MOVE_S
from . import frames
from .errors import ACTIONS, Action, Failure, JoinRefused, MoERequestError, SessionError
from .frames import Kind, Role

MOVE_PATH = "/v1/sessions/move"


def answer_bound_s(call_s: float) -> float:
    """A peer's wait for a layer's answer: its peers (up to a call bound), then the forward (another)."""
    return 2 * call_s + ANSWER_MARGIN_S


@dataclass(frozen=True)
class GroupEndpoint:
    """One TP group of a session: where its rank 0 listens and what it serves."""

    deployment: str
    replica: str
    session_id: str  # the session's id on that replica (a moved session has a new one)
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

    @classmethod
    def from_grant(cls, grant: dict[str, Any], layers: Sequence[int]) -> GroupEndpoint:
        """A replica's answer to ``open_session`` (``serve.sessions``) as a ticket names its group;
        ``layers``: the session's layers it serves."""
        return cls(grant["deployment"], grant["replica"], grant["session_id"], grant["host"], grant["port"],
                   grant["secret"], grant["session"], tuple(layers), grant["hidden_size"], grant["dtype"],
                   grant["call_timeout_s"], grant["max_tokens"], grant["store_port"], grant["channel"])


@dataclass(frozen=True)
class SessionTicket:
    """What a peer needs to join: the session's name, its number of peers, its groups; ``url``:
    the app's HTTP address its peers move through ("": they cannot move), ``secret``: the
    session's own (proves a move), ``move_s``: how long peers look for a new group."""

    name: str
    peers: int
    groups: tuple[GroupEndpoint, ...]
    url: str = ""
    secret: str = ""
    move_s: float = SESSION_MOVE_S

    def join(self, index: int, step: Sequence[int] | None = None, device: str | None = None) -> Peer:
        return Peer(self, index, step, device)

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
        groups = tuple(endpoint_from_dict(g) for g in raw.pop("groups"))
        return cls(groups=groups, **raw)


def endpoint_from_dict(raw: dict[str, Any]) -> GroupEndpoint:
    return GroupEndpoint(**{**raw, "layers": tuple(raw["layers"])})


class Peer:
    """Peer ``index`` of a session (one call at a time; see the module doc). ``step``: the layers
    this peer calls per step, in order (default: every layer of the ticket); the first and last
    on each group mark the step's bounds for an elastic session (``host``). ``device``: rows
    travel over a device channel (``channel``: NCCL to GPU ranks from a GPU, gloo to CPU ranks
    from the CPU) and answers come back on it; None: as bytes on the connection."""

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
        self.ticket, self.index, self.device = ticket, index, device
        self.bounds: dict[int, int] = {}  # layer -> its NEW_STEP / END_STEP flags
        for g in ticket.groups:
            mine = [x for x in step if x in g.layers]
            if mine:
                self.bounds[mine[0]] = self.bounds.get(mine[0], 0) | frames.NEW_STEP
                self.bounds[mine[-1]] = self.bounds.get(mine[-1], 0) | frames.END_STEP
        if device is not None:
            check_channels(ticket, device)
        self.closed: str | None = None
        self.calling = threading.Lock()  # held through a call (:meth:`idle` from another thread)
        self.groups = {g.deployment: g for g in ticket.groups}  # the group serving each, now
        self.socks: dict[str, socket.socket] = {}
        self.channels: dict[str, Any] = {}  # deployment -> its device channel
        self.moves: list[dict[str, Any]] = []  # each move: deployment, from/to replica, seconds, why
        try:
            for g in ticket.groups:
                self._join(g)
        except BaseException:
            self.close()
            raise

    def forward(self, hidden_states: Any, layer: int, router_logits: Any = None) -> Any:
        """This peer's rows of ``layer`` (``[T, H]``, T >= 0): numpy float32 (rounded to the
        deployment's dtype, as the Serve path does) or torch in, the same kind out."""
        g = self._group(layer)
        try:
            x = as_rows(hidden_states, "hidden_states", g.dtype, on_device=self.device is not None)
            logits = None if router_logits is None else as_logits(router_logits)
        except ServeInputError as e:
            raise MoERequestError(str(e), e.status, type(e).__name__) from None
        try:
            out, _ = self.forward_wire(x, layer, logits)
        except SessionError as e:
            if e.action is Action.CALLER_ERROR and not isinstance(e, JoinRefused):
                cause = e.input_error()
                raise MoERequestError(str(cause), cause.status, type(cause).__name__) from None
            raise
        if is_torch_tensor(hidden_states):
            return out.to_torch()
        return out.float32() if isinstance(hidden_states, np.ndarray) else out

    def forward_wire(self, x: WireTensor | DeviceRows, layer: int, router_logits: np.ndarray | None = None
                     ) -> tuple[WireTensor | DeviceRows, str]:
        """:meth:`forward` on wire rows: ``(this peer's output rows, tail)``. A failed group is left
        for another (the module doc) until the ticket's ``move_s``; then its failure is raised."""
        with self.calling:
            return self._forward_wire(x, layer, router_logits)

    def _forward_wire(self, x: WireTensor | DeviceRows, layer: int, router_logits: np.ndarray | None
                      ) -> tuple[WireTensor | DeviceRows, str]:
        g = self._group(layer)
        flags = self.bounds.get(layer, 0) | (frames.WITH_LOGITS if router_logits is not None else 0)
        deadline = None
        while True:
            try:
                return self._call(g, layer, x, router_logits, flags)
            except SessionError as e:
                if e.action is not Action.RETRY_ELSEWHERE:
                    raise
                if not self.ticket.url:  # a ticket without the app's address: no move
                    self.close(e.message)
                    raise
                deadline = deadline or time.monotonic() + self.ticket.move_s
                try:
                    g = self._move(g, e, deadline)
                except SessionError as final:
                    self.close(final.message)
                    raise
                flags |= frames.NEW_STEP  # the step goes on whole on the new group

    def _call(self, g: GroupEndpoint, layer: int, x: WireTensor | DeviceRows, router_logits: Any,
              flags: int) -> tuple[WireTensor | DeviceRows, str]:
        sock, channel = self.socks.get(g.deployment), self.channels.get(g.deployment)
        sent = None
        if sock is None:  # a move's join failed: its group is gone as well
            raise SessionError(Failure.GROUP_FAILED, f"no connection to replica {g.replica}", None, g.replica)
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
        with self.calling:
            g = self._group(layer)
            with contextlib.suppress(OSError, KeyError):
                frames.send(self.socks[g.deployment], Kind.FAIL, flags=self.bounds.get(layer, 0),
                            index=self.index, layer=layer, text=message)
            try:
                self._answer(g, layer)
            except SessionError as e:
                return e
            return SessionError(Failure.PEER_FAILED, message, self.index, g.replica)

    def idle(self) -> bool:
        """Tell the session this peer has no step to run now: an elastic session parks it at once,
        not after ``idle_after_s`` (``steps``); its next step's first layer brings it back. Between
        steps only: from another thread while a call is in flight it sends nothing (the peer is
        busy, not idle). Whether it was sent."""
        if not self.calling.acquire(blocking=False):
            return False
        try:
            if self.closed is not None:
                return False
            for sock in list(self.socks.values()):  # a copy: close() may drop one meanwhile
                with contextlib.suppress(OSError):  # a failed group: the next call finds out and moves
                    frames.send(sock, Kind.IDLE, index=self.index)
            return True
        finally:
            self.calling.release()

    def _group(self, layer: int) -> GroupEndpoint:
        if self.closed is not None:
            raise SessionError(Failure.SESSION_ENDED, f"peer {self.index} of session {self.ticket.name!r} "
                               f"is closed: {self.closed}")
        g = self.ticket.group_for(layer) if isinstance(layer, int) else None
        if g is None:
            raise MoERequestError(f"layer {layer!r} is not one of session {self.ticket.name!r}'s layers "
                                  f"{list(self.ticket.layers)}", 404, "UnknownLayerError")
        return self.groups[g.deployment]

    def _join(self, g: GroupEndpoint) -> None:
        """Join ``g``, or the group the session moved to since the ticket was written (a group that
        is gone, or whose session ended there: the app knows where it went, or that it is over)."""
        try:
            self._connect(g)
        except (OSError, frames.ConnectionLost, JoinRefused) as e:
            if not self.ticket.url or (isinstance(e, JoinRefused) and e.reason != "ended"):
                raise
            cause = SessionError(Failure.GROUP_FAILED, f"joining replica {g.replica} failed: {e}", None,
                                 g.replica)
            self._move(g, cause, time.monotonic() + self.ticket.move_s)

    def _connect(self, g: GroupEndpoint) -> None:
        sock = self.socks[g.deployment] = frames.connect((g.host, g.port), g.secret, Role.PEER, self.index,
                                                         CONNECT_S)
        if self.device is not None:
            self.channels[g.deployment] = open_channel(sock, g, self.index, self.device)

    def _drop(self, deployment: str) -> None:
        sock, channel = self.socks.pop(deployment, None), self.channels.pop(deployment, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        if channel is not None:
            channel.close()

    def _move(self, g: GroupEndpoint, cause: SessionError, deadline: float) -> GroupEndpoint:
        """The session's group of ``g.deployment`` on a healthy replica, joined (see the module doc);
        ``cause``: why ``g`` failed, raised (with what the moves met) once ``deadline`` passes."""
        started, last = time.monotonic(), str(cause)
        self._drop(g.deployment)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SessionError(cause.failure, f"{cause.message}; and no healthy group of deployment "
                                   f"{g.deployment!r} took session {self.ticket.name!r} within "
                                   f"{self.ticket.move_s:g} s (last: {last})", cause.peer, g.replica)
            status, answer = ask_move(self.ticket, g, self.index, min(left, MOVE_ASK_S))
            if status == 200:
                new = endpoint_from_dict(answer["group"])
                try:
                    self._connect(new)
                except (OSError, frames.ConnectionLost, JoinRefused) as e:
                    last, g = f"joining replica {new.replica} failed: {e}", new
                    self._drop(new.deployment)
                    time.sleep(min(MOVE_RETRY_S, max(0.0, deadline - time.monotonic())))
                    continue
                self.groups[new.deployment] = new
                self.moves.append({"deployment": new.deployment, "from": g.replica, "to": new.replica,
                                   "why": cause.failure.value,
                                   "seconds": round(time.monotonic() - started, 3)})
                return new
            last = answer.get("error", f"HTTP {status}")
            if status not in (0, 502, 503, 504):  # the app refuses the move itself: final
                failure = Failure.SESSION_ENDED if status in (404, 410) else cause.failure
                raise SessionError(failure, f"{cause.message}; session {self.ticket.name!r} cannot move off "
                                   f"replica {g.replica}: {last}", cause.peer, g.replica)
            time.sleep(min(MOVE_RETRY_S, max(0.0, deadline - time.monotonic())))

    def _answer(self, g: GroupEndpoint, layer: int, sent: Any = None) -> tuple[WireTensor | DeviceRows, str]:
        sock = self.socks[g.deployment]
        bound_s = answer_bound_s(g.call_s)
        sock.settimeout(bound_s)
        try:
            frame = frames.recv(sock)
        except TimeoutError:
            raise SessionError(Failure.GROUP_TIMEOUT, f"replica {g.replica} did not answer layer {layer} "
                               f"within {bound_s:.0f} s: a rank is stalled", None, g.replica) from None
        except (frames.ConnectionLost, OSError) as e:
            raise SessionError(Failure.GROUP_FAILED, f"rank 0 of replica {g.replica} closed the connection "
                               f"during layer {layer}: {e}", None, g.replica) from None
        if frame.kind is Kind.RESULT and frame.channel is not None:
            try:
                out = self.channels[g.deployment].recv(*frame.channel)
                if sent is not None:
                    sent.wait()
            except (RuntimeError, KeyError) as e:
                raise SessionError(Failure.GROUP_FAILED, f"the device channel to rank 0 of replica "
                                   f"{g.replica} failed during layer {layer}: {e}", None, g.replica) from None
            return out, frame.text
        if frame.kind is Kind.RESULT:
            return frame.data, frame.text
        meta = frame.meta()
        failure = Failure(meta["kind"])
        if frame.kind is Kind.BYE and ACTIONS[failure] is not Action.RETRY_ELSEWHERE:
            self.close(meta["message"])
        elif frame.kind not in (Kind.ERROR, Kind.BYE):
            self.close(f"unexpected {frame.kind.name} message")
            raise SessionError(Failure.OUT_OF_STEP, f"replica {g.replica} answered layer {layer} with a "
                               f"{frame.kind.name} message", None, g.replica)
        raise SessionError(failure, meta["message"], meta.get("peer"), g.replica, meta.get("error", ""))

    def close(self, why: str = "closed by its owner") -> None:
        if self.closed is None:
            self.closed = why
        for deployment in list(self.socks):
            self._drop(deployment)

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ask_move(ticket: SessionTicket, g: GroupEndpoint, index: int, timeout_s: float) -> tuple[int, dict]:
    """Ask the app at ``ticket.url`` for session ``ticket.name``'s group of ``g.deployment`` after
    ``g`` failed: ``(HTTP status, JSON answer)``; status 0: the app did not answer."""
    body = json.dumps({"session": ticket.name, "deployment": g.deployment, "from": g.session_id,
                       "replica": g.replica, "secret": ticket.secret, "peer": index}).encode()
    request = urllib.request.Request(ticket.url.rstrip("/") + MOVE_PATH, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        with contextlib.suppress(ValueError):
            return e.code, json.loads(e.read())
        return e.code, {"error": f"HTTP {e.code}: {e.reason}"}
    except (OSError, ValueError) as e:  # refused, reset, timed out, or not JSON: the app is away
        return 0, {"error": f"the app at {ticket.url} did not answer: {e}"}


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
