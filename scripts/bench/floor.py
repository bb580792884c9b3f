"""The transport's own floor: the data plane's message pattern over raw TCP, no project code. ``A``
peer processes send, per layer, a header and ``T x H`` float32 rows to a gathering rank process, which
hands the batch to ``P - 1`` echo ranks (each answers a header alone, as a rank's DONE) and answers
each peer its slice: blocking reads, TCP_NODELAY, spawned processes importing numpy only. A peer's
*step* is ``layers`` round trips; rank 0 ends the run at a step's end, so the peers stay in step.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import queue
import socket
import struct
import time
from typing import NamedTuple

import numpy as np

from .harness import busy_cpu_s

HEADER = struct.Struct("<iii")  # layer, rows, stop
HELLO = struct.Struct("<i")  # >= 0: a peer's index; < 0: -rank of an echo rank


class Floor(NamedTuple):
    steps: list[list[float]]  # each peer's timed steps, seconds
    cores_busy: float | None  # the machine's busy cores over the timed window (None: no /proc/stat)


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _exact(sock: socket.socket, view: memoryview) -> memoryview:
    # deployments.dataplane.frames reads the same way; the floor imports nothing of the project
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("closed")
        got += n
    return view


def _read(sock: socket.socket, size: int) -> memoryview:
    return _exact(sock, memoryview(bytearray(size)))


def _send(sock: socket.socket, layer: int, rows: np.ndarray, stop: int = 0) -> None:
    parts = [memoryview(HEADER.pack(layer, rows.shape[0], stop)), _bytes(rows)]
    while parts:
        sent = sock.sendmsg([p for p in parts if len(p)])
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


def _recv(sock: socket.socket, cols: int) -> tuple[int, int, np.ndarray]:
    layer, rows, stop = HEADER.unpack(_read(sock, HEADER.size))
    out = np.empty((rows, cols), np.float32)
    _exact(sock, _bytes(out))
    return layer, stop, out


def _connect(port: int, hello: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(HELLO.pack(hello))
    return sock


def _rank0(ports, peers: int, ranks: int, cols: int, layers: int, steps: int, min_time_s: float,
           warmup: int, results) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ports.put(listener.getsockname()[1])
    peer_socks: list[socket.socket | None] = [None] * peers
    links = []
    for _ in range(peers + ranks - 1):
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        (who,) = HELLO.unpack(_read(sock, HELLO.size))
        if who >= 0:
            peer_socks[who] = sock
        else:
            links.append(sock)
    empty = np.empty((0, cols), np.float32)
    timed_from = busy_from = None
    for done in itertools.count():
        if done == warmup:
            timed_from, busy_from = time.perf_counter(), busy_cpu_s()
        for layer in range(layers):
            parts = [_recv(s, cols)[2] for s in peer_socks]
            batch = np.concatenate(parts)
            for link in links:
                _send(link, layer, batch)
            for link in links:
                _recv(link, cols)
            stop = int(layer + 1 == layers and done + 1 >= warmup + steps and timed_from is not None
                       and time.perf_counter() - timed_from >= min_time_s)
            for sock, piece in zip(peer_socks, np.split(batch, np.cumsum([len(p) for p in parts])[:-1]),
                                   strict=True):
                _send(sock, layer, piece, stop)
        if stop:
            break
    busy, wall = busy_cpu_s(), time.perf_counter() - timed_from
    cores = None if busy is None or busy_from is None else (busy - busy_from) / wall
    for link in links:
        _send(link, -1, empty, 1)
    results.put(("cores", cores))


def _echo_rank(port: int, rank: int, cols: int) -> None:
    sock = _connect(port, -rank)
    empty = np.empty((0, cols), np.float32)
    while True:
        layer, stop, _ = _recv(sock, cols)
        if stop:
            return
        _send(sock, layer, empty)


def _peer(port: int, index: int, tokens: int, cols: int, layers: int, warmup: int, results) -> None:
    sock = _connect(port, index)
    rows = np.ones((tokens, cols), np.float32)
    times, stop = [], 0
    while not stop:
        start = time.perf_counter()
        for layer in range(layers):
            _send(sock, layer, rows)
            _, stop, _ = _recv(sock, cols)
        times.append(time.perf_counter() - start)
    results.put((index, times[warmup:]))


def echo_floor(peers: int, tokens: int, hidden: int = 128, layers: int = 1, ranks: int = 1, *,
               min_steps: int = 3, min_time_s: float = 0.0, warmup: int = 3,
               timeout_s: float = 300.0) -> Floor:
    """``peers`` peers stepping ``layers`` layers of ``tokens`` rows each through one gathering rank
    and ``ranks - 1`` echo ranks: each peer's timed steps, seconds (at least ``min_steps`` steps and
    ``min_time_s`` seconds after ``warmup`` untimed ones), and the machine's busy cores meanwhile."""
    ctx = multiprocessing.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank0, args=(ports, peers, ranks, hidden, layers, min_steps, min_time_s,
                                              warmup, results), daemon=True)]
    procs[0].start()
    try:
        port = ports.get(timeout=timeout_s)
        procs += [ctx.Process(target=_echo_rank, args=(port, r, hidden), daemon=True)
                  for r in range(1, ranks)]
        procs += [ctx.Process(target=_peer, args=(port, i, tokens, hidden, layers, warmup, results),
                              daemon=True) for i in range(peers)]
        for p in procs[1:]:
            p.start()
        got, deadline = {}, time.monotonic() + timeout_s
        while len(got) < peers + 1:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"the echo floor failed (exit codes {failed}) or ran past {timeout_s:g} s")
            with contextlib.suppress(queue.Empty):
                index, times = results.get(timeout=0.5)
                got[index] = times
        for p in procs:
            p.join(timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return Floor([got[i] for i in range(peers)], got["cores"])
