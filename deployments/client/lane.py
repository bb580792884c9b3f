"""Lanes: per-layer calls straight to a TP group over the data plane.

    with MoEClient("default").lane(max_tokens=16) as lane:
        out = lane.forward(x_TH, layer)               # numpy or torch in, the same kind out
        out = await lane.forward_async(x_TH, layer)

A decode step calls the tier once per MoE layer; through Serve each call pays the handle's
router, the replica's event loop and a hop to the ranks. A lane holds, per deployment it needs
(the app's routing table, as :class:`MoEClient` routes), a session of one peer
(``client.session``) and is that peer (``dataplane.Peer``): each call sends its rows to the
group's rank 0 and waits, a blocking read, for the output.

Rules a caller can rely on:

* Same answer as the Serve path, bit for bit (same ranks, runners and tail plan: the Serve path
  is itself the replica's own session), and the same input checks (``common.requests``, on the
  client and again on rank 0); a bad input raises :class:`MoERequestError` and the lane stays
  usable.
* Admission: a session is opened per deployment (the router sends it to the least-loaded healthy
  replica), asking again for up to ``wait_s`` while replicas refuse it (full, or ``lanes:
  false``); a deployment with none to be had runs this lane's calls on the Serve path, and the
  lane asks again every ``retry_s``. ``status()`` says which path each deployment takes and why.
* The session shares its group with the Serve path and other sessions and has no term: it lasts
  until the lane is closed (or its context, or the last reference to it is dropped).
* Faults: the lane's peer moves by itself to a healthy group when its group fails (a rank died or
  stalled, the replica was replaced, scaled down or redeployed) and sends the call again there:
  the caller sees a slower call, no error, while a healthy replica exists or one comes back
  within ``move_s``. Otherwise the one retry rule (``client.session.runs_again``): a call whose
  session ended under it runs once more, on a new session or the Serve path; any other failure
  is the caller's error, raised as the data plane's table names it.
* One call at a time per lane (a lock); use one lane per concurrent caller.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..config.timeouts import DEFAULT_RETRY_S, DEFAULT_WAIT_S, SESSION_MOVE_S
from ..dataplane.errors import SessionError
from ..dataplane.peer import Peer
from .session import (
    Session,
    SessionOrServe,
    SessionRefused,
    check_seconds,
    default_client_name,
    runs_again,
    served_layers,
)


class LaneCore:
    """A lane's sessions, its peer on each and its counters (what :class:`Lane` delegates to; a
    ``weakref.finalize`` of the lane closes it)."""

    def __init__(self, client: Any, name: str, by_deployment: dict[str, tuple[int, ...] | None],
                 max_tokens: int, retry_s: float, move_s: float):
        self.client, self.name, self.max_tokens, self.move_s = client, name, max_tokens, move_s
        self.by_layer = {x: d for d, layers in by_deployment.items() for x in layers or ()}
        self.only = next(iter(by_deployment)) if client.deployment is not None else None
        self.peers: dict[str, Peer] = {}
        self.sessions = {d: SessionOrServe(lambda wait_s, d=d, ls=ls: self.open(d, ls, wait_s), retry_s)
                         for d, ls in by_deployment.items()}
        self.counts = {d: {"session_calls": 0, "serve_calls": 0, "reruns": 0} for d in by_deployment}
        self.lock = threading.Lock()
        self.closing = False

    def open(self, deployment: str, layers: tuple[int, ...] | None, wait_s: float) -> Session:
        """A session of one peer on ``deployment``'s group, joined here."""
        session = Session(self.client, 1, layers=layers, max_tokens=self.max_tokens, wait_s=wait_s,
                          name=self.name, move_s=self.move_s)
        try:
            self.peers[deployment] = session.join(0)
        except (OSError, SessionError) as e:
            session.close(f"the lane could not join it: {e}")
            raise SessionRefused(f"lane {self.name!r} could not join its session on {deployment!r}: "
                                 f"{e}") from None
        return session

    def drop(self, deployment: str, why: str) -> None:
        """Close the session, then leave it (rank 0 records why it ended, not a peer gone)."""
        self.sessions[deployment].drop(why)
        peer = self.peers.pop(deployment, None)
        if peer is not None:
            peer.close(why)

    def forward(self, hidden_states: Any, layer: Any, router_logits: Any) -> Any:
        if self.closing:
            raise RuntimeError(f"lane {self.name} is closed")
        deployment = self.only or (self.by_layer.get(layer) if isinstance(layer, int) else None)
        if deployment is None:  # not a layer of the lane: the Serve path says why
            return self.client.forward(hidden_states, layer, router_logits)
        with self.lock:
            for attempt in (1, 2):
                if self.sessions[deployment].get() is None:
                    self.counts[deployment]["serve_calls"] += 1
                    return self.client.forward(hidden_states, layer, router_logits)
                try:
                    out = self.peers[deployment].forward(hidden_states, layer, router_logits)
                except SessionError as e:
                    self.drop(deployment, f"lane call to layer {layer} failed: {e.message}")
                    if not runs_again(e, attempt):
                        raise
                    self.counts[deployment]["reruns"] += 1
                    continue
                self.counts[deployment]["session_calls"] += 1
                return out
        raise AssertionError("unreachable: the second attempt returns or raises")

    def close(self) -> None:
        """Leave and close every session (idempotent)."""
        self.closing = True
        with self.lock:
            for deployment in self.sessions:
                self.drop(deployment, "lane closed")

    def status(self) -> dict[str, Any]:
        out = {}
        for d, held in self.sessions.items():
            peer = self.peers.get(d)
            st = held.status({d: peer.groups[d]} if peer is not None else None)
            where = st.pop("deployments").get(d, {"replica": None, "session_id": None})
            out[d] = {**st, **where, **self.counts[d], "moves": len(peer.moves) if peer is not None else 0}
        return {"client": self.name, "max_tokens": self.max_tokens,
                "layers": sorted(self.by_layer), "deployments": out}


class Lane:
    """Per-layer calls to the app's TP groups over the data plane; see the module doc.

    Built by :meth:`MoEClient.lane`; a context manager (sync or async) that closes its
    sessions on exit (:meth:`close`).
    """

    def __init__(self, client: Any, *, layers: Iterable[int] | None = None, max_tokens: int = 1,
                 wait_s: float = DEFAULT_WAIT_S, retry_s: float = DEFAULT_RETRY_S, name: str | None = None,
                 move_s: float = SESSION_MOVE_S):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        check_seconds(wait_s=wait_s, retry_s=retry_s, move_s=move_s)
        self.name = name or default_client_name()
        if client.deployment is not None:  # a client bound to one deployment: its layers
            chosen = None if layers is None else tuple(sorted({int(x) for x in layers}))
            by_deployment = {client.deployment: chosen}
        else:
            routes = client.layer_routes()
            by_deployment: dict[str, tuple[int, ...] | None] = {}
            for x in served_layers(client, layers):
                d = routes.choose(x, None)
                by_deployment[d] = (*by_deployment.get(d, ()), x)
        core = LaneCore(client, self.name, by_deployment, max_tokens, float(retry_s), float(move_s))
        self._core = core
        self._close = weakref.finalize(self, core.close)
        try:
            for held in core.sessions.values():
                held.get(float(wait_s))
        except BaseException:
            self.close()
            raise

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._core.by_layer))

    @property
    def sessions(self) -> dict[str, Session | None]:
        """Each deployment's session while the lane holds one (None: the Serve path)."""
        return {d: held.session for d, held in self._core.sessions.items()}

    def forward(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                router_logits: np.ndarray | torch.Tensor | None = None) -> np.ndarray | torch.Tensor:
        """``[T, H]`` output of MoE ``layer`` (blocking); numpy float32 or torch in, same kind out."""
        return self._core.forward(hidden_states, layer, router_logits)

    async def forward_async(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                            router_logits: np.ndarray | torch.Tensor | None = None) -> Any:
        """:meth:`forward` without blocking the event loop (it runs in a thread)."""
        return await asyncio.to_thread(self.forward, hidden_states, layer, router_logits)

    def status(self) -> dict[str, Any]:
        """Per deployment: ``path`` (session or serve), ``replica`` and ``session_id`` of the group
        serving it now, ``why_serve``, ``sessions`` opened, ``session_calls``, ``serve_calls``,
        ``reruns`` (calls run again after their session ended under them) and ``moves`` (the
        session's moves to a healthy group)."""
        return self._core.status()

    def close(self) -> None:
        """Leave and close every session (idempotent)."""
        self._close()

    def __enter__(self) -> Lane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Lane:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)
