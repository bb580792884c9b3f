"""Lanes: per-layer calls straight to a TP group over the data plane.

    with MoEClient("default").lane(max_tokens=16) as lane:
        out = lane.forward(x_TH, layer)               # numpy or torch in, the same kind out
        out = await lane.forward_async(x_TH, layer)

A decode step calls the tier once per MoE layer; through Serve each call pays the handle's
router, the replica's event loop and a hop to the ranks. A lane opens a session on one
replica's TP group per deployment it needs (the app's routing table, as :class:`MoEClient`
routes) through the Serve path -- the control plane -- and is its one peer on the data plane
(``deployments.dataplane``): each call sends its rows to the group's rank 0 and waits, a
blocking read, for the output. A lane is the one-peer case of a session; cohorts and sessions of
independent processes (``client.session``) open theirs the same way (``client.leases``).

Rules a caller can rely on:

* Same answer as the Serve path, bit for bit (same ranks, runners and tail plan: the Serve path
  is itself the replica's own session), and the same input checks (``common.requests``, on the
  client and again on rank 0); a bad input raises :class:`MoERequestError` and the lane stays
  usable.
* A session is opened per deployment (the router sends it to the least-loaded healthy replica),
  asking again for up to ``wait_s`` while replicas refuse it (full, or ``lanes: false``); a
  deployment with none to be had runs this lane's calls on the Serve path, and the lane asks
  again every ``retry_s``. ``status()`` says which path each deployment takes and why.
* The session shares its group with the Serve path and other sessions (nothing is held, nothing
  revoked) and has no term: it lasts until the lane is closed (or its context, or the last
  reference to it is dropped), which closes every session.
* Failures follow the data plane's one table (``dataplane.errors.ACTIONS``) and the tier's one
  retry rule (``common.retry``): a call whose group broke (a rank died or failed, or the call
  outlived its bound, which the lane reports so the replica breaks the group) is sent once more,
  on the Serve path, to another replica; with a healthy replica left the caller sees no error. A
  call that met an ended session never ran: it goes to the Serve path as a first attempt.
* One call at a time per lane (a lock); use one lane per concurrent caller.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..common.errors import ServeInputError, error_message
from ..common.requests import as_logits, as_rows
from ..common.retry import resend_after
from ..common.wire import WireTensor
from ..config.timeouts import DEFAULT_RETRY_S, DEFAULT_WAIT_S
from ..dataplane.errors import Action, SessionError
from ..dataplane.peer import GroupEndpoint, Peer, SessionTicket
from .errors import raise_for
from .leases import (
    GroupLease,
    LeaseHolder,
    check_seconds,
    default_client_name,
    group_failure,
    served_layers,
)


class LaneCore(LeaseHolder):
    """A lane's leases, its peer on each leased group and its counters (what :class:`Lane`
    delegates to)."""

    def __init__(self, client: Any, name: str, layers: tuple[int, ...], by_layer: dict[int, str],
                 only: str | None, max_tokens: int, retry_s: float):
        deployments = [only] if only is not None else sorted(set(by_layer.values()))
        super().__init__(name, {d: GroupLease(client, d, name, max_tokens, retry_s) for d in deployments})
        self.client, self.layers, self.by_layer, self.only = client, layers, by_layer, only
        self.max_tokens = max_tokens
        self.peers: dict[str, Peer] = {}
        self.counts = {d: {"lane_calls": 0, "serve_calls": 0, "fallbacks": 0} for d in deployments}

    # -- leases and peers -----------------------------------------------------------------

    def acquire(self, deployment: str, wait_s: float, avoid_replica: str | None = None) -> bool:
        lease = self.leases[deployment]
        if not lease.acquire(wait_s, avoid_replica):
            return False
        grant = lease.grant
        try:
            ticket = SessionTicket(self.name, 1, (GroupEndpoint.from_grant(grant, grant["layers"]),))
            self.peers[deployment] = ticket.join(0)
        except (OSError, PermissionError) as e:
            GroupLease.release(lease.take(f"could not join the group's session: {error_message(e)}"))
            return False
        return True

    def drop(self, deployment: str, why: str) -> None:
        """Close the session (then leave it: rank 0 records why it ended, not a peer gone); the
        Serve path until asked again."""
        grant = self.leases[deployment].take(why)
        if grant is not None:
            GroupLease.release(grant, why)
        peer = self.peers.pop(deployment, None)
        if peer is not None:
            peer.close(why)

    def drop_all(self, why: str) -> None:
        for deployment, lease in self.leases.items():
            if lease.held:
                self.drop(deployment, why)

    def ready(self, deployment: str) -> bool:
        """True when this call can go on the lane (opening its session first if due)."""
        lease = self.leases[deployment]
        if lease.held:
            return True
        if not lease.due():
            return False
        wait_s, lease.next_wait = lease.next_wait, 0.0
        return self.acquire(deployment, wait_s)

    # -- calls ----------------------------------------------------------------------------

    def forward(self, hidden_states: Any, layer: Any, router_logits: Any) -> Any:
        if self.closing:
            raise RuntimeError(f"lane {self.name} is closed")
        deployment = self.only or (self.by_layer.get(layer) if isinstance(layer, int) else None)
        with self.lock:
            if deployment is None or not self.ready(deployment):
                if deployment is not None:
                    self.counts[deployment]["serve_calls"] += 1
                return self.client.forward(hidden_states, layer, router_logits)
            lease = self.leases[deployment]
            try:
                x, logits = self._wire(lease, hidden_states, router_logits)
            except ServeInputError as e:  # refused here, as the Serve path's replica would
                raise_for(e)
            try:
                out, _ = self.peers[deployment].forward_wire(x, layer, logits)
            except SessionError as e:
                return self._after_failure(deployment, e, hidden_states, layer, router_logits)
            self.counts[deployment]["lane_calls"] += 1
        return out.float32() if isinstance(hidden_states, np.ndarray) else out.to_torch()

    def _after_failure(self, deployment: str, exc: SessionError, hidden_states: Any, layer: Any,
                       router_logits: Any) -> Any:
        """What the data plane's table says: the caller's error, a first attempt on the Serve
        path (nothing ran), or once more elsewhere (the group broke)."""
        if exc.action is Action.CALLER_ERROR:
            raise_for(exc.input_error())
        lease, counts = self.leases[deployment], self.counts[deployment]
        counts["fallbacks"] += 1
        counts["serve_calls"] += 1
        if exc.action is not Action.RETRY_ELSEWHERE:  # never ran (an ended lease or session)
            self.drop(deployment, f"lane call not run: {exc}")
            return self.client.forward(hidden_states, layer, router_logits)
        failure = group_failure(exc, lease, f"lane call to layer {layer}")
        self.drop(deployment, f"lane call failed: {error_message(failure)}")
        again = resend_after(failure)  # the group is broken: once more, elsewhere
        return self.client.forward_once(hidden_states, layer, router_logits,
                                        avoid_replica=again.avoid_replica)

    def _wire(self, lease: GroupLease, hidden_states: Any, router_logits: Any) -> tuple[WireTensor, Any]:
        # The Serve path's conversions (numpy float32 rounded to the deployment dtype); rank 0
        # checks the rest exactly as the replica would.
        x = as_rows(hidden_states, "hidden_states", lease.grant["dtype"])
        logits = None if router_logits is None else as_logits(router_logits)
        return x, logits

    def close(self) -> None:
        """Leave every session and release every lease (idempotent)."""
        self.closing = True
        with self.lock:
            self.drop_all("lane closed")

    def status(self) -> dict[str, Any]:
        return {"client": self.name, "max_tokens": self.max_tokens, "layers": list(self.layers),
                "deployments": {d: {**lease.status(), **self.counts[d]} for d, lease in self.leases.items()}}


class Lane:
    """Per-layer calls to the app's TP groups over the data plane; see the module doc.

    Built by :meth:`MoEClient.lane`; a context manager (sync or async) that closes its
    sessions on exit (:meth:`close`).
    """

    def __init__(self, client: Any, *, layers: Iterable[int] | None = None, max_tokens: int = 1,
                 wait_s: float = DEFAULT_WAIT_S, retry_s: float = DEFAULT_RETRY_S, name: str | None = None):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        check_seconds(wait_s=wait_s, retry_s=retry_s)
        self.name = name or default_client_name()
        if client.deployment is not None:  # a client bound to one deployment: every layer
            chosen = () if layers is None else tuple(sorted({int(x) for x in layers}))
            core = LaneCore(client, self.name, chosen, {}, client.deployment, max_tokens, float(retry_s))
        else:
            chosen = served_layers(client, layers)
            routes = client.layer_routes()
            core = LaneCore(client, self.name, chosen, {x: routes.choose(x, None) for x in chosen}, None,
                            max_tokens, float(retry_s))
        self._core = core
        self._close = weakref.finalize(self, core.close)
        try:
            for deployment in core.leases:
                core.acquire(deployment, float(wait_s))
        except BaseException:
            self.close()
            raise

    @property
    def layers(self) -> tuple[int, ...]:
        return self._core.layers

    @property
    def leases(self) -> dict[str, GroupLease]:
        """Each deployment's lease (``grant`` while held)."""
        return self._core.leases

    def forward(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                router_logits: np.ndarray | torch.Tensor | None = None) -> np.ndarray | torch.Tensor:
        """``[T, H]`` output of MoE ``layer`` (blocking); numpy float32 or torch in, same kind out."""
        return self._core.forward(hidden_states, layer, router_logits)

    async def forward_async(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                            router_logits: np.ndarray | torch.Tensor | None = None) -> Any:
        """:meth:`forward` without blocking the event loop (it runs in a thread)."""
        return await asyncio.to_thread(self.forward, hidden_states, layer, router_logits)

    def status(self) -> dict[str, Any]:
        return self._core.status()

    def close(self) -> None:
        """Leave every session and release every lease (idempotent)."""
        self._close()

    def __enter__(self) -> Lane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Lane:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)
