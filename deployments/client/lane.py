"""Lanes, the client side: per-layer calls straight to a leased TP group on a Ray Compiled Graph.

    with MoEClient("default").lane(max_tokens=16) as lane:
        out = lane.forward(x_TH, layer)               # numpy or torch in, the same kind out
        out = await lane.forward_async(x_TH, layer)

A decode step calls the tier once per MoE layer; through Serve each call pays the handle's
router, the replica's event loop and a hop to the ranks. A lane leases one replica's TP group
per deployment it needs (the app's routing table, as :class:`MoEClient` routes) through the
Serve path -- the control plane -- and then compiles its own graph over that group's ranks:
input -> every rank's ``lane_forward`` -> output, on shared-memory channels. Each call is one
execution of that graph. The group side (``deployments.serve.lanes``) explains the lease.

Rules a caller can rely on:

* Same answer as the Serve path, bit for bit (same ranks, same runners, same tail plan), and
  the same input checks (made on the ranks, ``common.requests``); a bad input raises
  :class:`MoERequestError` and the lane stays usable.
* A lease is requested with ``wait_s`` (the router steers it to a replica that is not leased);
  a deployment whose groups all stay held runs this lane's calls on the Serve path, and the lane
  asks again every ``retry_s`` (a non-waiting request). ``status()`` says which path each
  deployment takes and why.
* The lane renews its lease every half term while it calls; a replica with others waiting
  stops renewing after one term, and the lane then tears its graph down and takes the Serve
  path (asking again after ``retry_s``). Closing the lane (or its context) releases every lease.
* A call that fails on the lane for any reason but its input (a rank died, the replica was
  replaced, a stalled rank past the call timeout) drops that lease and is retried once on the
  Serve path, which has its own retry (``common.layer_routing``): with a healthy replica left
  the caller sees no error.
* One call at a time per lane (a lock); use one lane per concurrent caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch
from ray.dag import InputNode, MultiOutputNode

from moe_runtime.units import torch_dtype

from ..common.errors import ServeInputError, error_message, root_cause
from ..common.requests import to_tensor
from ..common.wire import WireTensor, copy_graph_outputs, join_rank_outputs
from .client import DEFAULT_RETRY_S, DEFAULT_WAIT_S, _translate

if TYPE_CHECKING:
    from .client import MoEClient

logger = logging.getLogger(__name__)

TEARDOWN_TIMEOUT_S = 30.0
LEASE_ATTEMPT_S = 1.0  # one lease request's wait on the replica it reached


def default_client_name() -> str:
    return f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class _GroupLane:
    """One deployment's part of a lane: its lease and compiled graph, or the Serve path."""

    def __init__(self, lane: Lane, deployment: str):
        self.lane, self.deployment = lane, deployment
        self.grant: dict[str, Any] | None = None
        self.dag: Any = None
        self.renewed_at = 0.0  # time.monotonic() when the last granted renewal was *sent*
        self.next_try = 0.0
        self.next_wait = 0.0  # how long the next due lease request waits for the group
        self.why_serve = "not leased yet"
        self.calls = self.serve_calls = self.fallbacks = self.leases = 0

    # -- lease ----------------------------------------------------------------------------

    def acquire(self, wait_s: float) -> bool:
        """Ask the deployment for a lease and compile the graph on its ranks."""
        lane = self.lane
        handle = lane.client.group_handle(self.deployment)
        deadline = time.monotonic() + wait_s
        while True:
            # Short waits, asked again: the router's view of which replicas are leased lags by
            # up to its stats period, so a later ask may reach a free replica.
            attempt_s = min(max(0.0, deadline - time.monotonic()), LEASE_ATTEMPT_S)
            sent = time.monotonic()
            try:
                grant = handle.lease_lane.remote(lane.name, lane.max_tokens, attempt_s).result(
                    timeout_s=attempt_s + lane.client.timeout_s)
            except Exception as e:
                _translate(e)
            if grant["granted"] or time.monotonic() >= deadline:
                break
        if not grant["granted"]:
            self.why_serve = f"lease refused by replica {grant['replica']}: {grant['reason']}"
            self.next_try = time.monotonic() + lane.retry_s
            logger.info("lane %s: %s: %s; Serve path until it is asked again in %.0f s", lane.name,
                        self.deployment, self.why_serve, lane.retry_s)
            return False
        lease_id = grant["lease_id"]
        try:
            with InputNode() as inp:
                node = MultiOutputNode([w.lane_forward.bind(inp[0], inp[1], inp[2], lease_id)
                                        for w in grant["workers"]])
            self.dag = node.experimental_compile()
        except Exception as e:
            self._release(grant)
            self.why_serve = f"compiled graph unavailable: {error_message(e)}"
            self.next_try = float("inf")  # a graph that cannot be built will not be built later
            logger.warning("lane %s: %s: %s; Serve path", lane.name, self.deployment, self.why_serve)
            return False
        self.grant, self.renewed_at = grant, sent
        lane._last_call = time.monotonic()  # idle time counts from the lease, not from before the compile
        self.leases += 1
        self.why_serve = ""
        logger.info("lane %s: %s leased replica %s (TP %d, lease %s, term %.1f s)", lane.name,
                    self.deployment, grant["replica"], grant["world"], lease_id, grant["term_s"])
        return True

    def _renew(self) -> bool:
        grant = self.grant
        sent = time.monotonic()
        why = f"lease {grant['lease_id']} not renewed (others wait for the group, or it ended)"
        try:
            ok = ray.get(grant["workers"][0].lane_renew.remote(grant["lease_id"]),
                         timeout=self.lane.client.timeout_s)
        except Exception as e:
            ok, why = False, f"lease renewal failed: {error_message(e)}"
        if ok:
            self.renewed_at = sent
            return True
        self.drop(why)
        return False

    def drop(self, why: str) -> None:
        """Tear the graph down and release the lease; the Serve path until asked again."""
        grant, dag = self.grant, self.dag
        self.grant = self.dag = None
        self.why_serve = why
        self.next_try = time.monotonic() + self.lane.retry_s
        if dag is None:
            return
        routine = self.lane.closing or "not renewed" in why or why.startswith("idle")
        log = logger.info if routine else logger.warning
        log("lane %s: %s leaves replica %s: %s", self.lane.name, self.deployment, grant["replica"], why)
        # Teardown waits for every rank's graph loop; a dead or stalled rank must not block the
        # caller, so it runs aside (the lease then expires on the replica if it cannot finish).
        thread = threading.Thread(target=self._teardown, args=(dag, grant), daemon=True)
        thread.start()
        thread.join(timeout=TEARDOWN_TIMEOUT_S if self.lane.closing else 0.5)

    def _teardown(self, dag: Any, grant: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # ranks gone: the lease ends on the replica anyway
            dag.teardown()
        self._release(grant)

    @staticmethod
    def _release(grant: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            ray.get(grant["workers"][0].lane_release.remote(grant["lease_id"]), timeout=10)

    # -- calls ----------------------------------------------------------------------------

    def ready(self) -> bool:
        """True when this call can go on the lane (leasing or renewing first if due)."""
        now = time.monotonic()
        if self.dag is None:
            if now < self.next_try:
                return False
            wait_s, self.next_wait = self.next_wait, 0.0
            return self.acquire(wait_s)
        if now - self.renewed_at >= self.grant["term_s"] / 2:
            return self._renew()
        return True

    def call(self, layer: int, x: WireTensor, logits: WireTensor | None) -> torch.Tensor:
        """One execution of the graph; rank outputs joined (copied out of the channels)."""
        results = ray.get(self.dag.execute(layer, x, logits), timeout=self.grant["call_timeout_s"])
        self.calls += 1
        return join_rank_outputs(copy_graph_outputs(results))[0]

    def status(self) -> dict[str, Any]:
        grant = self.grant
        return {"path": "lane" if grant is not None else "serve",
                "replica": None if grant is None else grant["replica"],
                "lease_id": None if grant is None else grant["lease_id"],
                "why_serve": self.why_serve or None, "lane_calls": self.calls,
                "serve_calls": self.serve_calls, "fallbacks": self.fallbacks, "leases": self.leases}


class Lane:
    """Per-layer calls to the app's TP groups on leased compiled graphs; see the module doc.

    Built by :meth:`MoEClient.lane`; a context manager (sync or async) that releases its
    leases on exit (:meth:`close`).
    """

    def __init__(self, client: MoEClient, *, layers: Iterable[int] | None = None, max_tokens: int = 1,
                 wait_s: float = DEFAULT_WAIT_S, retry_s: float = DEFAULT_RETRY_S, name: str | None = None):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        for what, v in (("wait_s", wait_s), ("retry_s", retry_s)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
                raise ValueError(f"{what} must be a number of seconds >= 0, got {v!r}")
        self.client, self.max_tokens, self.retry_s = client, max_tokens, float(retry_s)
        self.name = name or default_client_name()
        self.closing = False
        self._lock = threading.Lock()
        self._last_call = time.monotonic()
        routes = client.layer_routes()
        self._by_layer: dict[int, _GroupLane] = {}
        self.groups: dict[str, _GroupLane] = {}
        self._only: _GroupLane | None = None  # a client bound to one deployment: every layer
        if client.deployment is not None:
            self._only = self.groups[client.deployment] = _GroupLane(self, client.deployment)
            self.layers = () if layers is None else tuple(sorted({int(x) for x in layers}))
        else:
            served = {x for ls in routes.layers.values() for x in ls}
            wanted = sorted(served) if layers is None else sorted({int(x) for x in layers})
            unknown = [x for x in wanted if x not in served]
            if unknown:
                raise ValueError(f"layer(s) {unknown} are not served by app {client.app_name!r} "
                                 f"(it serves {sorted(served)})")
            self.layers = tuple(wanted)
            for layer in self.layers:
                name = routes.choose(layer, None)
                if name not in self.groups:
                    self.groups[name] = _GroupLane(self, name)
                self._by_layer[layer] = self.groups[name]
        try:
            for group in self.groups.values():
                group.acquire(float(wait_s))
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._drop_when_idle, name=f"lane-idle-{self.name}", daemon=True).start()

    # -- calls ----------------------------------------------------------------------------

    def forward(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                router_logits: np.ndarray | torch.Tensor | None = None) -> np.ndarray | torch.Tensor:
        """``[T, H]`` output of MoE ``layer`` (blocking); numpy float32 or torch in, same kind out."""
        if self.closing:
            raise RuntimeError(f"lane {self.name} is closed")
        group = self._only or (self._by_layer.get(layer) if isinstance(layer, int) else None)
        with self._lock:
            self._last_call = time.monotonic()
            if group is None or not group.ready():
                if group is not None:
                    group.serve_calls += 1
                return self.client.forward(hidden_states, layer, router_logits)
            x, logits = self._wire(group, hidden_states, router_logits)
            try:
                out = group.call(layer, x, logits)
            except Exception as e:
                cause = root_cause(e)
                if isinstance(cause, ServeInputError):
                    _translate(cause)
                group.fallbacks += 1
                group.serve_calls += 1
                group.drop(f"lane call failed: {type(cause).__name__}: {error_message(cause)}")
                return self.client.forward(hidden_states, layer, router_logits)
        return out.float().numpy() if isinstance(hidden_states, np.ndarray) else out

    async def forward_async(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                            router_logits: np.ndarray | torch.Tensor | None = None) -> Any:
        """:meth:`forward` without blocking the event loop (it runs in a thread)."""
        return await asyncio.to_thread(self.forward, hidden_states, layer, router_logits)

    def _wire(self, group: _GroupLane, hidden_states: Any, router_logits: Any) -> tuple[WireTensor, Any]:
        # The Serve path's conversions (numpy float32 rounded to the deployment dtype); the ranks
        # check the rest exactly as the replica would.
        x = to_tensor(hidden_states, "hidden_states", torch_dtype(group.grant["dtype"]))
        logits = None
        if router_logits is not None:
            logits = WireTensor.from_torch(to_tensor(router_logits, "router_logits", None))
        return WireTensor.from_torch(x), logits

    # -- lifetime -------------------------------------------------------------------------

    def _drop_when_idle(self) -> None:
        """An idle compiled graph's loops poll their channels, a core per rank: a lane that has
        not been called for half a lease term tears its graphs down and releases the groups
        (the next call leases again, waiting up to ``LEASE_ATTEMPT_S``) rather than burn the
        ranks' CPUs until its lease expires."""
        while not self.closing:
            leased = [g for g in self.groups.values() if g.grant is not None]
            term = min((g.grant["term_s"] for g in leased), default=DEFAULT_WAIT_S)
            time.sleep(term / 4)
            if not leased or time.monotonic() - self._last_call < term / 2:
                continue
            with self._lock:
                if self.closing or time.monotonic() - self._last_call < term / 2:
                    continue
                for group in leased:
                    group.drop("idle for half a lease term")
                    # the next call leases again at once, waiting up to one attempt for the group
                    # (free a moment ago; a health check or the release may still hold it)
                    group.next_try, group.next_wait = 0.0, LEASE_ATTEMPT_S


    def status(self) -> dict[str, Any]:
        return {"client": self.name, "max_tokens": self.max_tokens, "layers": list(self.layers),
                "deployments": {name: g.status() for name, g in self.groups.items()}}

    def close(self) -> None:
        """Tear every graph down and release every lease (idempotent)."""
        self.closing = True
        with self._lock:
            for group in self.groups.values():
                group.drop("lane closed")

    def __enter__(self) -> Lane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Lane:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    def __del__(self) -> None:
        if not getattr(self, "closing", True):
            with contextlib.suppress(Exception):
                self.close()
