"""The Serve-handle client of the MoE app (inside the Ray cluster), and the lanes and cohorts
it opens.

    client = MoEClient()                       # app "default": routed by layer, straight to the groups
    client = MoEClient.direct("decode")        # bound to one TP-group deployment
    client = MoEClient(via_ingress=True)       # through the app's ingress (one hop more)
    out = client.forward(x_TH, layer=1)        # numpy or torch in, the same kind out
    out = await client.forward_async(x_TH, 1)
    with client.lane(max_tokens=16) as lane:  # per-layer calls on the data plane (decode)
        out = lane.forward(x_TH, layer=1)
    with client.cohort(workers, max_tokens=4) as cohort:   # many attention workers, one batch per layer
        results = cohort.step(inputs)

Errors are ``client.errors``'; every path follows the one retry rule (``common.retry``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..common.layer_routing import LayerRoutes
from ..common.retry import call_with_retry, call_with_retry_async
from ..common.wire import WireTensor
from ..config.timeouts import CLIENT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from ..config.timeouts import DEFAULT_RETRY_S, DEFAULT_WAIT_S, SESSION_MOVE_S
from .cohort import DEFAULT_MAX_TOKENS, Cohort
from .errors import raise_for
from .lane import Lane
from .session import Session


class MoEClient:
    """Serve-handle client of the MoE app.

    Forwards go straight to the TP-group deployment that serves the layer (the app's routing
    table, ``common.layer_routing.LayerRoutes``, is fetched from the ingress once), so only HTTP
    pays the ingress hop; ``via_ingress=True`` sends them through the ingress instead.
    ``status()`` asks the ingress (every deployment). The retry rule (``common.retry``: once
    more, to another replica, only after the group that ran the call broke) is applied by the
    hop nearest the replicas: this client on the direct path, the ingress with ``via_ingress``.
    """

    def __init__(self, app_name: str = "default", *, deployment: str | None = None, via_ingress: bool = False,
                 timeout_s: float = DEFAULT_TIMEOUT_S, handle: Any = None, routes: LayerRoutes | None = None):
        from ray import serve

        self.app_name, self.deployment, self.via_ingress = app_name, deployment, via_ingress
        self.timeout_s = timeout_s
        self.handle = handle if handle is not None else serve.get_app_handle(app_name)  # the ingress
        self.routes = routes  # fetched from the ingress on first use when None
        self._groups: dict[str, Any] = {}  # deployment -> its DeploymentHandle

    @classmethod
    def direct(cls, deployment: str, app_name: str = "default",
               timeout_s: float = DEFAULT_TIMEOUT_S) -> MoEClient:
        """Bound to TP-group deployment ``deployment``: forwards and ``status()`` go to it."""
        from ray import serve

        handle = serve.get_deployment_handle(deployment, app_name)
        client = cls(app_name, deployment=deployment, timeout_s=timeout_s, handle=handle,
                     routes=LayerRoutes.single(deployment))
        client._groups[deployment] = handle
        return client

    def layer_routes(self) -> LayerRoutes:
        """The app's routing table (asked from the ingress once)."""
        if self.routes is None:
            try:
                table = self.handle.layer_routes.remote().result(timeout_s=self.timeout_s)
            except Exception as e:
                raise_for(e)
            self.routes = LayerRoutes.from_dict(table)
        return self.routes

    async def layer_routes_async(self) -> LayerRoutes:
        if self.routes is None:
            try:
                table = await asyncio.wait_for(self.handle.layer_routes.remote(), self.timeout_s)
            except Exception as e:
                raise_for(e)
            self.routes = LayerRoutes.from_dict(table)
        return self.routes

    def _group(self, layer: int):
        return self.group_handle(self.routes.choose(layer, self.deployment))

    def group_handle(self, deployment: str):
        """The Serve handle of TP-group deployment ``deployment`` (cached)."""
        if deployment not in self._groups:
            from ray import serve

            self._groups[deployment] = serve.get_deployment_handle(deployment, self.app_name)
        return self._groups[deployment]

    def lane(self, layers: Iterable[int] | None = None, *, max_tokens: int = 1,
             wait_s: float = DEFAULT_WAIT_S, retry_s: float = DEFAULT_RETRY_S,
             name: str | None = None, move_s: float = SESSION_MOVE_S) -> Lane:
        """A per-layer lane (``client.lane``): a session of one peer per deployment serving
        ``layers`` (None: every layer of the app), called over the data plane; calls of up to
        ``max_tokens`` tokens; ``move_s``: how long its peer looks for a healthy group when its
        group fails. A context manager; ``close()`` closes the sessions."""
        return Lane(self, layers=layers, max_tokens=max_tokens, wait_s=wait_s, retry_s=retry_s, name=name,
                    move_s=move_s)

    def cohort(self, workers: Sequence[Any], layers: Iterable[int] | None = None, *,
               max_tokens: int = DEFAULT_MAX_TOKENS, wait_s: float = DEFAULT_WAIT_S,
               retry_s: float = DEFAULT_RETRY_S, step_timeout_s: float | None = None,
               name: str | None = None, move_s: float = SESSION_MOVE_S) -> Cohort:
        """A cohort (``client.cohort``): ``workers`` (``AttentionWorker`` actors) are the peers of
        one session and decode together, every MoE layer of ``layers`` (None: every layer of the
        app) one forward of all their rows, at most ``max_tokens`` rows per worker and step;
        ``move_s``: how long their peers look for a healthy group when theirs fails; a step
        running longer than ``step_timeout_s`` (default: a layer's answer bound, one move and a
        probe) is stuck. A context manager; ``close()`` closes its session."""
        return Cohort(self, workers, layers=layers, max_tokens=max_tokens, wait_s=wait_s, retry_s=retry_s,
                      step_timeout_s=step_timeout_s, name=name, move_s=move_s)

    def session(self, peers: int, layers: Iterable[int] | None = None, *, max_tokens: int = 1,
                wait_s: float = DEFAULT_WAIT_S, name: str | None = None,
                idle_after_s: float | None = None, linger_s: float | None = None, url: str | None = None,
                move_s: float = SESSION_MOVE_S) -> Session:
        """A session for ``peers`` independent peer processes (``client.session``): on one TP
        group per deployment serving ``layers`` (None: every layer of the app; all or none), at
        most ``max_tokens`` rows per peer and layer. Hand ``session.ticket`` to the peers; each
        joins with ``deployments.client.join(ticket, index)``. ``idle_after_s``: an elastic
        session, whose peers may join late, idle, leave or die without holding the others (for
        engines that step on their own, such as vLLM's). ``linger_s``: it ends once none of its
        peers has been connected this long (default: the deployment's ``session_linger_s``).
        ``url``: the app's HTTP address its peers move through when a group fails (default: the
        Serve proxy's; "": no moves); ``move_s``: how long they look for a healthy group.
        A context manager; ``close()`` ends it."""
        return Session(self, peers, layers=layers, max_tokens=max_tokens, wait_s=wait_s, name=name,
                       idle_after_s=idle_after_s, linger_s=linger_s, url=url, move_s=move_s)

    def _forward_call(self, hidden_states: Any, layer: int, router_logits: Any, avoid_replica: str | None):
        # torch travels as WireTensor (zero-copy numpy for Ray); numpy and the rest as given.
        if isinstance(hidden_states, torch.Tensor):
            hidden_states = WireTensor.from_torch(hidden_states)
        if isinstance(router_logits, torch.Tensor):
            router_logits = WireTensor.from_torch(router_logits)
        if self.via_ingress:
            return self.handle.forward.remote(hidden_states, layer, router_logits, deployment=self.deployment)
        group = self._group(layer)
        return group.forward.remote(hidden_states, layer, router_logits, avoid_replica=avoid_replica)

    def forward(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                router_logits: np.ndarray | torch.Tensor | None = None) -> np.ndarray | torch.Tensor:
        """``[T, H]`` output of MoE ``layer`` (blocking; not from inside an event loop)."""
        if self.via_ingress:  # the ingress applies the retry rule
            return self.forward_once(hidden_states, layer, router_logits)
        self.layer_routes()
        try:
            out = call_with_retry(lambda avoid: self._send(hidden_states, layer, router_logits, avoid))
        except Exception as e:
            raise_for(e)
        return out.to_torch() if isinstance(out, WireTensor) else out

    def forward_once(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                     router_logits: np.ndarray | torch.Tensor | None = None, *,
                     avoid_replica: str | None = None) -> np.ndarray | torch.Tensor:
        """One attempt of :meth:`forward`, never on ``avoid_replica`` (for callers that apply
        the retry rule themselves, or leave it to the ingress: ``via_ingress``)."""
        if not self.via_ingress:
            self.layer_routes()
        try:
            out = self._send(hidden_states, layer, router_logits, avoid_replica)
        except Exception as e:
            raise_for(e)
        return out.to_torch() if isinstance(out, WireTensor) else out

    def _send(self, hidden_states: Any, layer: int, router_logits: Any, avoid_replica: str | None) -> Any:
        call = self._forward_call(hidden_states, layer, router_logits, avoid_replica)
        return call.result(timeout_s=self.timeout_s)

    async def forward_async(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                            router_logits: np.ndarray | torch.Tensor | None = None) -> Any:
        async def attempt(avoid_replica: str | None):
            call = self._forward_call(hidden_states, layer, router_logits, avoid_replica)
            return await asyncio.wait_for(call, self.timeout_s)

        if not self.via_ingress:
            await self.layer_routes_async()
        try:
            out = await (attempt(None) if self.via_ingress else call_with_retry_async(attempt))
        except Exception as e:
            raise_for(e)
        return out.to_torch() if isinstance(out, WireTensor) else out

    def status(self) -> dict[str, Any]:
        try:
            return self.handle.status.remote().result(timeout_s=self.timeout_s)
        except Exception as e:
            raise_for(e)

    async def status_async(self) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(self.handle.status.remote(), self.timeout_s)
        except Exception as e:
            raise_for(e)
