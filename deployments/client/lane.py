"""Lanes: per-layer calls straight to a leased TP group on a Ray Compiled Graph.

    with MoEClient("default").lane(max_tokens=16) as lane:
        out = lane.forward(x_TH, layer)               # numpy or torch in, the same kind out
        out = await lane.forward_async(x_TH, layer)

A decode step calls the tier once per MoE layer; through Serve each call pays the handle's
router, the replica's event loop and a hop to the ranks. A lane leases one replica's TP group
per deployment it needs (the app's routing table, as :class:`MoEClient` routes) through the
Serve path -- the control plane -- and then compiles its own graph over that group's ranks:
input -> every rank's ``lane_forward`` -> output, on shared-memory channels. Each call is one
execution of that graph. A lane is the one-caller case of a cohort (``client.cohort``): the same
leases (``client.leases``) and the same rank-side forward, with the caller itself as the worker.

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
  path (asking again after ``retry_s``). A lane not called for half a term drops its leases
  (an idle graph keeps a core per rank busy) and leases again at its next call. Closing the
  lane (or its context, or dropping the last reference to it) releases every lease.
* The retry rule is the tier's one (``common.retry``): a call that fails because the leased
  group broke (a rank died or failed, or the call outlived the group's call bound, which the
  lane reports so the replica breaks the group) is sent once more, on the Serve path, to
  another replica; with a healthy replica left the caller sees no error. A call the ranks
  refused because the lease had ended never ran: it goes to the Serve path as a first attempt.
* One call at a time per lane (a lock); use one lane per concurrent caller.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import ray
import torch
from ray.dag import InputNode, MultiOutputNode

from ..common.errors import (
    ServeInputError,
    error_message,
    root_cause,
)
from ..common.requests import as_logits, as_rows
from ..common.retry import resend_after
from ..common.wire import WireTensor, part_rows
from ..config.timeouts import TEARDOWN_S
from .errors import raise_for
from .leases import (
    DEFAULT_RETRY_S,
    DEFAULT_WAIT_S,
    GroupLease,
    LeaseHolder,
    bind_group_forward,
    check_seconds,
    default_client_name,
    group_failure,
    kept_renewed,
    lease_ended,
    served_layers,
    teardown_then,
)


class LaneCore(LeaseHolder):
    """A lane's leases, graphs and counters (what :class:`Lane` delegates to)."""

    def __init__(self, client: Any, name: str, layers: tuple[int, ...], by_layer: dict[int, str],
                 only: str | None, max_tokens: int, retry_s: float):
        deployments = [only] if only is not None else sorted(set(by_layer.values()))
        super().__init__(name, {d: GroupLease(client, d, name, max_tokens, retry_s) for d in deployments})
        self.client, self.layers, self.by_layer, self.only = client, layers, by_layer, only
        self.max_tokens = max_tokens
        self.dags: dict[str, Any] = {}
        self.counts = {d: {"lane_calls": 0, "serve_calls": 0, "fallbacks": 0} for d in deployments}

    # -- leases and graphs ----------------------------------------------------------------

    def acquire(self, deployment: str, wait_s: float, avoid_replica: str | None = None) -> bool:
        lease = self.leases[deployment]
        if not lease.acquire(wait_s, avoid_replica):
            return False
        try:
            with kept_renewed([lease]), InputNode() as inp:  # (layer, x, router_logits)
                dag = MultiOutputNode(bind_group_forward(lease.grant, inp[0], inp[2], [inp[1]]))
                self.dags[deployment] = dag.experimental_compile()
        except Exception as e:
            GroupLease.release(lease.take(f"compiled graph unavailable: {error_message(e)}"))
            lease.next_try = float("inf")  # a graph that cannot be built will not be built later
            return False
        self.last_call = time.monotonic()  # idle time counts from the lease, not from before the compile
        return True

    def drop(self, deployment: str, why: str) -> None:
        """Tear the graph down and release the lease; the Serve path until asked again."""
        grant = self.leases[deployment].take(why)
        dag = self.dags.pop(deployment, None)
        if dag is not None:
            teardown_then(dag, lambda: GroupLease.release(grant), TEARDOWN_S if self.closing else 0.5,
                          self.name)

    def drop_idle(self, why: str) -> None:
        for deployment, lease in self.leases.items():
            if lease.held:
                self.drop(deployment, why)

    def ready(self, deployment: str) -> bool:
        """True when this call can go on the lane (leasing or renewing first if due)."""
        lease = self.leases[deployment]
        if not lease.held:
            if not lease.due():
                return False
            wait_s, lease.next_wait = lease.next_wait, 0.0
            return self.acquire(deployment, wait_s)
        if lease.renew_due() and not lease.renew():
            self.drop(deployment, lease.why_not)
            return False
        return True

    # -- calls ----------------------------------------------------------------------------

    def forward(self, hidden_states: Any, layer: Any, router_logits: Any) -> Any:
        if self.closing:
            raise RuntimeError(f"lane {self.name} is closed")
        deployment = self.only or (self.by_layer.get(layer) if isinstance(layer, int) else None)
        with self.lock:
            self.last_call = time.monotonic()
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
                results = ray.get(self.dags[deployment].execute(layer, x, logits),
                                  timeout=lease.grant["call_timeout_s"])
            except Exception as e:
                return self._after_failure(deployment, e, hidden_states, layer, router_logits)
            self.counts[deployment]["lane_calls"] += 1
        out = part_rows(results, 0)
        return out.float().numpy() if isinstance(hidden_states, np.ndarray) else out

    def _after_failure(self, deployment: str, exc: BaseException, hidden_states: Any, layer: Any,
                       router_logits: Any) -> Any:
        if isinstance(root_cause(exc), ServeInputError):
            raise_for(exc)
        lease, counts = self.leases[deployment], self.counts[deployment]
        counts["fallbacks"] += 1
        counts["serve_calls"] += 1
        if lease_ended(exc):  # refused before it ran: a first attempt on the Serve path
            self.drop(deployment, f"lane call refused: {error_message(exc)}")
            return self.client.forward(hidden_states, layer, router_logits)
        failure = group_failure(exc, lease, f"lane call to layer {layer}")
        self.drop(deployment, f"lane call failed: {error_message(failure)}")
        again = resend_after(failure)  # the group is broken: once more, elsewhere
        return self.client.forward_once(hidden_states, layer, router_logits,
                                        avoid_replica=again.avoid_replica)

    def _wire(self, lease: GroupLease, hidden_states: Any, router_logits: Any) -> tuple[WireTensor, Any]:
        # The Serve path's conversions (numpy float32 rounded to the deployment dtype); the ranks
        # check the rest exactly as the replica would.
        x = as_rows(hidden_states, "hidden_states", lease.grant["dtype"])
        logits = None if router_logits is None else WireTensor(as_logits(router_logits), "float32")
        return x, logits

    def close(self) -> None:
        """Tear every graph down and release every lease (idempotent)."""
        self.closing = True
        with self.lock:
            self.drop_idle("lane closed")

    def status(self) -> dict[str, Any]:
        return {"client": self.name, "max_tokens": self.max_tokens, "layers": list(self.layers),
                "deployments": {d: {**lease.status(), **self.counts[d]} for d, lease in self.leases.items()}}


class Lane:
    """Per-layer calls to the app's TP groups on leased compiled graphs; see the module doc.

    Built by :meth:`MoEClient.lane`; a context manager (sync or async) that releases its
    leases on exit (:meth:`close`).
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
        core.watch_idle()

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
        """Tear every graph down and release every lease (idempotent)."""
        self._close()

    def __enter__(self) -> Lane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Lane:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)
