"""The data plane's messages on a TCP connection, and the handshake that admits a connection.

A message is a fixed header, an optional UTF-8 text (a tail's name, an error's words, a hello's
fields) and an optional array's bytes (rows, router logits, a slice of output). Arrays travel as
their raw bytes with dtype and shape in the header, written with one ``sendmsg`` of the array's own
buffer and read with ``recv_into`` straight into a fresh array: no pickle, no copy through a
Python bytes object.

Admission: the listener sends a random nonce; the caller answers with its role, index and
HMAC-SHA256(secret, nonce + role + index). Only a process holding the session's (or the group's)
secret can answer, and a connection that does not answer within ``HANDSHAKE_S`` is closed by its
own short-lived thread, so a stray or hostile connection can neither join nor hold anything up.

Pure: no Ray, no torch.
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import json
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_runtime.units import WIRE_DTYPES

from ..common.wire import DeviceRows, WireTensor
from ..config.timeouts import HANDSHAKE_S
from .errors import JOIN_REFUSALS, JoinRefused

NONCE_BYTES = 16
MAC = "sha256"
WELCOME = b"\x01"
REFUSED = {b"\x02": "secret", b"\x03": "ended", b"\x04": "taken"}  # a refused join's answer -> why
_HEADER = struct.Struct("<BBBxhiiiIQ")  # kind, dtype code, flags, index, layer, rows, cols, text, data bytes
_HELLO = struct.Struct("<Bi32s")  # role, index, mac


class Kind(enum.IntEnum):
    FORWARD = 1  # peer -> rank 0: this peer's rows for a layer (0 rows allowed)
    FAIL = 2  # peer -> rank 0: this peer cannot take part in this layer (its own failure)
    RESULT = 3  # rank 0 -> peer: the peer's slice of the layer's output; text: the tail
    ERROR = 4  # rank 0 -> peer: the layer ended without a result; text: JSON {kind, message, peer}
    BATCH = 5  # rank 0 -> other ranks: one forward to run; index: the session's number
    DONE = 6  # other rank -> rank 0: forward done (sequence parallel: with this rank's rows)
    BYE = 7  # rank 0 -> peer: the session ended; text: JSON {kind, message}
    LOGITS = 8  # follows a FORWARD or BATCH whose rows carry router logits: fp32 [T, E]
    CHANNEL = 9  # peer -> rank 0, once after joining: its rows go over a device channel; text: JSON
    PING = 10  # rank 0 -> other rank, between batches while idle: are you there?
    PONG = 11  # other rank -> rank 0: the answer to a PING
    EVENT = 12  # rank 0 -> the replica's watcher: a session or group event; text: JSON
    IDLE = 13  # peer -> rank 0, between its steps: it has no step to run now (no answer)


WITH_LOGITS = 1  # flags of a FORWARD or BATCH: a LOGITS message follows
NEW_STEP = 2  # flags of a FORWARD: the first layer of the peer's step on this group
END_STEP = 4  # flags of a FORWARD: the last layer of the peer's step on this group
ON_CHANNEL = 8  # flags of a FORWARD or RESULT: the array's bytes follow on the peer's device channel


class Role(enum.IntEnum):
    PEER = 1
    RANK = 2
    WATCH = 3  # the replica, hearing rank 0's events (admitted by the group's secret)


# The arrays' dtypes on the wire (a WireTensor's dtype name; bfloat16 travels as int16 bits).
_DTYPES = WIRE_DTYPES
_CODE = {name: i for i, name in enumerate(_DTYPES)}
_NUMPY = {"bfloat16": np.int16}


class ConnectionLost(ConnectionError):
    """The other end closed the connection (or it broke) before a whole message came."""


@dataclass
class Frame:
    kind: Kind
    flags: int = 0
    index: int = 0
    layer: int = 0
    text: str = ""
    data: WireTensor | None = None
    channel: tuple[tuple[int, ...], str] | None = None  # ON_CHANNEL: the array's shape and dtype

    def meta(self) -> dict[str, Any]:
        return json.loads(self.text) if self.text else {}


def send(sock: socket.socket, kind: Kind, *, flags: int = 0, index: int = 0, layer: int = 0, text: str = "",
         data: WireTensor | DeviceRows | None = None) -> None:
    """One message, written whole (``sendmsg`` of the header, the text and the array's buffer);
    rows on a device: the header only, flagged ``ON_CHANNEL`` (the caller sends the array on its
    channel next)."""
    raw = text.encode()
    if data is None:
        header = _HEADER.pack(kind, 0, flags, index, layer, -1, 0, len(raw), 0)
        buffers = [header, raw]
    elif isinstance(data, DeviceRows):
        rows, cols = (data.shape[0], data.shape[1]) if len(data.shape) == 2 else (data.shape[0], -1)
        code = _CODE[data.dtype]
        header = _HEADER.pack(kind, code, flags | ON_CHANNEL, index, layer, rows, cols, len(raw), 0)
        buffers = [header, raw]
    else:
        array = np.ascontiguousarray(data.array)
        rows, cols = (array.shape[0], array.shape[1]) if array.ndim == 2 else (array.shape[0], -1)
        code = _CODE[data.dtype]
        header = _HEADER.pack(kind, code, flags, index, layer, rows, cols, len(raw), array.nbytes)
        buffers = [header, raw, memoryview(array).cast("B") if array.nbytes else b""]
    view = [memoryview(b) for b in buffers if len(b)]
    while view:
        sent = sock.sendmsg(view)
        while view and sent >= len(view[0]):
            sent -= len(view[0])
            view.pop(0)
        if view and sent:
            view[0] = view[0][sent:]


def recv(sock: socket.socket) -> Frame:
    """One whole message; ``ConnectionLost`` when the other end is gone."""
    kind, code, flags, index, layer, rows, cols, n_text, n_data = _HEADER.unpack(_exact(sock, _HEADER.size))
    text = bytes(_exact(sock, n_text)).decode() if n_text else ""
    data = None
    if rows >= 0 and flags & ON_CHANNEL:
        return Frame(Kind(kind), flags, index, layer, text, None, ((rows, cols) if cols >= 0 else (rows,),
                                                                   _DTYPES[code]))
    if rows >= 0:
        name = _DTYPES[code]
        shape = (rows, cols) if cols >= 0 else (rows,)
        array = np.empty(shape, dtype=_NUMPY[name] if name in _NUMPY else np.dtype(name))
        if array.nbytes != n_data:
            raise ConnectionLost(f"a message's array of shape {shape} in {name} announced {n_data} bytes")
        if n_data:
            _into(sock, memoryview(array).cast("B"))
        data = WireTensor(array, name)
    return Frame(Kind(kind), flags, index, layer, text, data)


def _exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    if n:
        _into(sock, memoryview(buf))
    return buf


def _into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionLost("the connection was closed")
        got += n


def new_secret() -> str:
    return os.urandom(32).hex()


def _mac(secret: str, nonce: bytes, role: Role, index: int) -> bytes:
    return hmac.new(bytes.fromhex(secret), nonce + struct.pack("<Bi", role, index), MAC).digest()


def admit(sock: socket.socket, secrets: Any) -> tuple[Role, int, str]:
    """Listener side: challenge a new connection; ``(role, index, secret)`` of the caller, whose
    answer matched one of ``secrets`` (a callable returning the secrets now accepted). Raises
    ``PermissionError`` (wrong secret) or ``OSError`` (no answer within ``HANDSHAKE_S``)."""
    sock.settimeout(HANDSHAKE_S)
    nonce = os.urandom(NONCE_BYTES)
    sock.sendall(nonce)
    role, index, mac = _HELLO.unpack(_exact(sock, _HELLO.size))
    for secret in secrets():
        if hmac.compare_digest(mac, _mac(secret, nonce, Role(role), index)):
            sock.settimeout(None)
            return Role(role), index, secret
    raise PermissionError("a connection answered the challenge without a known secret")


def welcome(sock: socket.socket) -> None:
    """Listener side: the admitted caller may go on (it waits for this byte)."""
    sock.sendall(WELCOME)


def refuse(sock: socket.socket, reason: str) -> None:
    """Listener side: tell a caller why its join is refused (``JOIN_REFUSALS``), then close."""
    code = next(c for c, r in REFUSED.items() if r == reason)
    with contextlib.suppress(OSError):
        sock.sendall(code)
    sock.close()


def connect(address: tuple[str, int], secret: str, role: Role, index: int, timeout_s: float) -> socket.socket:
    """Caller side: a connection to ``address`` admitted as ``role`` ``index``; :class:`JoinRefused`
    naming why when the listener refuses it, ``ConnectionLost`` when it closes without a word."""
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = bytes(_exact(sock, NONCE_BYTES))
        sock.sendall(_HELLO.pack(role, index, _mac(secret, nonce, role, index)))
        answer = bytes(_exact(sock, len(WELCOME)))
        if answer != WELCOME:
            reason = REFUSED.get(answer, "secret")
            raise JoinRefused(reason, f"{address[0]}:{address[1]} refused {role.name.lower()} {index}: "
                              f"{JOIN_REFUSALS[reason]}")
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock


def error_text(kind: str, message: str, peer: int | None = None, error: str = "") -> str:
    return json.dumps({"kind": kind, "message": message, "peer": peer, "error": error})
