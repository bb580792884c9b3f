"""Python clients of the MoE app: Serve handles (in the Ray cluster) and HTTP (anywhere).

Both raise :class:`MoERequestError` (4xx: the request was wrong) or :class:`MoEServerError`
(5xx: ours, e.g. a TP group being replaced) carrying the server's message and status; a
request refused because the deployment's queue is full (``max_queued_requests``) raises
:class:`MoEOverloadedError` (503, ``retry_after_s``).

    client = MoEClient()                       # app "default": routed by layer, straight to the groups
    client = MoEClient.direct("decode")        # bound to one TP-group deployment
    client = MoEClient(via_ingress=True)       # through the app's ingress (one hop more)
    out = client.forward(x_TH, layer=1)        # numpy or torch in, the same kind out
    out = await client.forward_async(x_TH, 1)
    with client.lane(max_tokens=16) as lane:  # per-layer calls on compiled graphs (decode)
        out = lane.forward(x_TH, layer=1)
    with HTTPMoEClient("http://127.0.0.1:8000", token=os.environ["LMS_HTTP_TOKEN"]) as http:
        out = http.forward(x_TH, 1, deployment="prefill")

``token``: the ingress's shared secret (sent as ``Authorization: Bearer <token>``), when the
ingress requires one (``LMS_HTTP_TOKEN`` where it runs); never logged or shown in a repr.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NoReturn

import httpx
import numpy as np
import torch
from ray.serve.exceptions import BackPressureError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..common.errors import error_message, http_status, root_cause
from ..common.layer_routing import LayerRoutes, call_with_retry, call_with_retry_async
from ..common.wire import WireTensor

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_WAIT_S = 5.0  # a lane's wait for a lease before it takes the Serve path
DEFAULT_RETRY_S = 5.0  # and how often it asks again

if TYPE_CHECKING:
    from .lane import Lane


class MoEServeError(Exception):
    """An error answer of the MoE app: ``message`` (the server's), ``status`` (HTTP code)."""

    def __init__(self, message: str, status: int, kind: str | None = None):
        super().__init__(f"[{status}{' ' + kind if kind else ''}] {message}")
        self.message, self.status, self.kind = message, status, kind


class MoERequestError(MoEServeError, ValueError):
    """4xx: the request itself is wrong (shape, dtype, NaN, unknown layer, too large...)."""


class MoEServerError(MoEServeError, RuntimeError):
    """5xx: the server failed (TP group broken and being replaced, timeout, bug)."""


class MoEOverloadedError(MoEServerError):
    """503: refused at once because the deployment's queue is full; retry after ``retry_after_s``."""

    def __init__(self, message: str, status: int, kind: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message, status, kind)
        self.retry_after_s = retry_after_s


def _raise(message: str, status: int, kind: str | None) -> NoReturn:
    cls = MoERequestError if 400 <= status < 500 else MoEServerError
    raise cls(message, status, kind) from None


def _translate(exc: BaseException) -> NoReturn:
    if isinstance(exc, MoEServeError):
        raise exc
    cause = root_cause(exc)
    if isinstance(cause, BackPressureError):
        raise MoEOverloadedError(error_message(cause), http_status(cause), type(cause).__name__,
                                 cause.retry_after_s) from None
    _raise(error_message(cause), http_status(cause), type(cause).__name__)


class MoEClient:
    """Serve-handle client of the MoE app.

    Forwards go straight to the TP-group deployment that serves the layer (the app's routing
    table, ``common.layer_routing.LayerRoutes``, is fetched from the ingress once), so only HTTP
    pays the ingress hop; ``via_ingress=True`` sends them through the ingress instead.
    ``status()`` asks the ingress (every deployment). A forward that meets a broken TP group
    (503, the replica is being replaced) is retried once by the hop nearest the replicas: this
    client on the direct path, the ingress with ``via_ingress`` (at most 2 attempts either way).
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
                _translate(e)
            self.routes = LayerRoutes.from_dict(table)
        return self.routes

    async def layer_routes_async(self) -> LayerRoutes:
        if self.routes is None:
            try:
                table = await asyncio.wait_for(self.handle.layer_routes.remote(), self.timeout_s)
            except Exception as e:
                _translate(e)
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
             name: str | None = None) -> Lane:
        """A per-layer lane (``deployments.client.lane``): one leased TP group per deployment
        serving ``layers`` (None: every layer of the app), called through compiled graphs; calls
        of up to ``max_tokens`` tokens. A context manager; ``close()`` releases the leases."""
        from .lane import Lane

        return Lane(self, layers=layers, max_tokens=max_tokens, wait_s=wait_s, retry_s=retry_s, name=name)

    def _forward_call(self, hidden_states: Any, layer: int, router_logits: Any):
        # torch travels as WireTensor (zero-copy numpy for Ray); numpy and the rest as given.
        if isinstance(hidden_states, torch.Tensor):
            hidden_states = WireTensor.from_torch(hidden_states)
        if isinstance(router_logits, torch.Tensor):
            router_logits = WireTensor.from_torch(router_logits)
        if self.via_ingress:
            return self.handle.forward.remote(hidden_states, layer, router_logits, deployment=self.deployment)
        return self._group(layer).forward.remote(hidden_states, layer, router_logits)

    def forward(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                router_logits: np.ndarray | torch.Tensor | None = None) -> np.ndarray | torch.Tensor:
        """``[T, H]`` output of MoE ``layer`` (blocking; not from inside an event loop)."""
        def attempt():
            return self._forward_call(hidden_states, layer, router_logits).result(timeout_s=self.timeout_s)

        if not self.via_ingress:
            self.layer_routes()
        try:
            out = attempt() if self.via_ingress else call_with_retry(attempt)
        except Exception as e:
            _translate(e)
        return out.to_torch() if isinstance(out, WireTensor) else out

    async def forward_async(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                            router_logits: np.ndarray | torch.Tensor | None = None) -> Any:
        async def attempt():
            call = self._forward_call(hidden_states, layer, router_logits)
            return await asyncio.wait_for(call, self.timeout_s)

        if not self.via_ingress:
            await self.layer_routes_async()
        try:
            out = await (attempt() if self.via_ingress else call_with_retry_async(attempt))
        except Exception as e:
            _translate(e)
        return out.to_torch() if isinstance(out, WireTensor) else out

    def status(self) -> dict[str, Any]:
        try:
            return self.handle.status.remote().result(timeout_s=self.timeout_s)
        except Exception as e:
            _translate(e)

    async def status_async(self) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(self.handle.status.remote(), self.timeout_s)
        except Exception as e:
            _translate(e)


# -- HTTP -----------------------------------------------------------------------------------


def forward_path(layer: int, deployment: str | None = None) -> str:
    return f"/v1/layers/{layer}/forward" if deployment is None else f"/v1/{deployment}/layers/{layer}/forward"


def encode_request(hidden_states: np.ndarray | torch.Tensor,
                   router_logits: np.ndarray | torch.Tensor | None = None) -> bytes:
    """The safetensors body of a forward request (numpy is converted to torch first)."""
    tensors = {"hidden_states": _as_torch(hidden_states)}
    if router_logits is not None:
        tensors["router_logits"] = _as_torch(router_logits)
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def decode_response(response: httpx.Response, as_numpy: bool) -> np.ndarray | torch.Tensor:
    if response.status_code != 200:
        _raise_http(response)
    try:
        out = st_load(response.content)["output"]
    except Exception as e:
        raise MoEServerError(f"malformed response body: {e}", 502) from None
    return out.float().numpy() if as_numpy else out


def _as_torch(value: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    raise TypeError(f"expected a numpy array or torch tensor, got {type(value).__name__}")


def auth_headers(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header for ``token`` (none without one)."""
    if token is None:
        return {}
    if not isinstance(token, str) or not token or token != token.strip() or not token.isprintable():
        raise ValueError("token must be a non-empty printable string without surrounding whitespace")
    return {"Authorization": f"Bearer {token}"}


def _raise_http(response: httpx.Response) -> NoReturn:
    try:
        body = response.json()
        message, kind = body.get("error", response.text), body.get("type")
    except (json.JSONDecodeError, ValueError, AttributeError):
        message, kind = response.text or response.reason_phrase, None
    retry = response.headers.get("retry-after")
    if response.status_code in (429, 503) and retry is not None and retry.isdigit():
        raise MoEOverloadedError(str(message), response.status_code, kind, float(retry)) from None
    _raise(str(message), response.status_code, kind)


class HTTPMoEClient:
    """Blocking HTTP client (httpx); safetensors bodies, no pickle."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, deployment: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, client: httpx.Client | None = None,
                 token: str | None = None):
        self.deployment = deployment
        self._auth = auth_headers(token)
        self.client = client or httpx.Client(base_url=base_url, timeout=timeout_s)

    def forward(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                router_logits: np.ndarray | torch.Tensor | None = None,
                deployment: str | None = None) -> np.ndarray | torch.Tensor:
        body = encode_request(hidden_states, router_logits)
        try:
            r = self.client.post(forward_path(layer, deployment or self.deployment), content=body,
                                 headers={"content-type": "application/octet-stream", **self._auth})
        except httpx.HTTPError as e:
            raise MoEServerError(f"HTTP request failed: {e!r}", 503) from None
        return decode_response(r, isinstance(hidden_states, np.ndarray))

    def status(self) -> dict[str, Any]:
        return self._get_json("/v1/status")

    def healthz(self) -> dict[str, Any]:
        return self._get_json("/healthz")

    def _get_json(self, path: str) -> dict[str, Any]:
        try:
            r = self.client.get(path, headers=self._auth)
        except httpx.HTTPError as e:
            raise MoEServerError(f"HTTP request failed: {e!r}", 503) from None
        if r.status_code != 200:
            _raise_http(r)
        return r.json()

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> HTTPMoEClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncHTTPMoEClient:
    """The asyncio twin of :class:`HTTPMoEClient` (httpx.AsyncClient)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, deployment: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, client: httpx.AsyncClient | None = None,
                 max_connections: int = 64, token: str | None = None):
        self.deployment = deployment
        self._auth = auth_headers(token)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.client = client or httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits)

    async def forward(self, hidden_states: np.ndarray | torch.Tensor, layer: int,
                      router_logits: np.ndarray | torch.Tensor | None = None,
                      deployment: str | None = None) -> np.ndarray | torch.Tensor:
        body = encode_request(hidden_states, router_logits)
        try:
            r = await self.client.post(forward_path(layer, deployment or self.deployment), content=body,
                                       headers={"content-type": "application/octet-stream", **self._auth})
        except httpx.HTTPError as e:
            raise MoEServerError(f"HTTP request failed: {e!r}", 503) from None
        return decode_response(r, isinstance(hidden_states, np.ndarray))

    async def status(self) -> dict[str, Any]:
        r = await self.client.get("/v1/status", headers=self._auth)
        if r.status_code != 200:
            _raise_http(r)
        return r.json()

    async def aclose(self) -> None:
        await self.client.aclose()

    async def __aenter__(self) -> AsyncHTTPMoEClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
