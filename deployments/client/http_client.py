"""HTTP clients of the MoE app (anywhere, through the ingress): safetensors bodies, no pickle.

    with HTTPMoEClient("http://127.0.0.1:8000", token=os.environ["LMS_HTTP_TOKEN"]) as http:
        out = http.forward(x_TH, 1, deployment="prefill")

``token``: the ingress's shared secret (sent as ``Authorization: Bearer <token>``), when the
ingress requires one (``LMS_HTTP_TOKEN`` where it runs); never logged or shown in a repr. Errors
are those of ``client.errors``; the ingress applies the retry rule (``common.retry``).
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

import httpx
import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..config.timeouts import CLIENT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from .errors import MoEServerError, raise_status


def forward_path(layer: int, deployment: str | None = None) -> str:
    return f"/v1/layers/{layer}/forward" if deployment is None else f"/v1/{deployment}/layers/{layer}/forward"


def as_torch(value: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    raise TypeError(f"expected a numpy array or torch tensor, got {type(value).__name__}")


def encode_request(hidden_states: np.ndarray | torch.Tensor,
                   router_logits: np.ndarray | torch.Tensor | None = None) -> bytes:
    """The safetensors body of a forward request (numpy is converted to torch first)."""
    tensors = {"hidden_states": as_torch(hidden_states)}
    if router_logits is not None:
        tensors["router_logits"] = as_torch(router_logits)
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def decode_response(response: httpx.Response, as_numpy: bool) -> np.ndarray | torch.Tensor:
    if response.status_code != 200:
        raise_for_response(response)
    try:
        out = st_load(response.content)["output"]
    except Exception as e:
        raise MoEServerError(f"malformed response body: {e}", 502) from None
    return out.float().numpy() if as_numpy else out


def raise_for_response(response: httpx.Response) -> NoReturn:
    """The client error of a non-200 answer (its JSON ``error``/``type``, ``Retry-After``)."""
    try:
        body = response.json()
        message, kind = body.get("error", response.text), body.get("type")
    except (json.JSONDecodeError, ValueError, AttributeError):
        message, kind = response.text or response.reason_phrase, None
    retry = response.headers.get("retry-after")
    overloaded = response.status_code in (429, 503) and retry is not None and retry.isdigit()
    raise_status(str(message), response.status_code, kind, overloaded, float(retry) if overloaded else None)


def auth_headers(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header for ``token`` (none without one)."""
    if token is None:
        return {}
    if not isinstance(token, str) or not token or token != token.strip() or not token.isprintable():
        raise ValueError("token must be a non-empty printable string without surrounding whitespace")
    return {"Authorization": f"Bearer {token}"}


def unreachable(e: httpx.HTTPError) -> MoEServerError:
    return MoEServerError(f"HTTP request failed: {e!r}", 503)


class HTTPMoEClient:
    """Blocking HTTP client (httpx)."""

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
            raise unreachable(e) from None
        return decode_response(r, isinstance(hidden_states, np.ndarray))

    def status(self) -> dict[str, Any]:
        return self.get_json("/v1/status")

    def healthz(self) -> dict[str, Any]:
        return self.get_json("/healthz")

    def get_json(self, path: str) -> dict[str, Any]:
        try:
            r = self.client.get(path, headers=self._auth)
        except httpx.HTTPError as e:
            raise unreachable(e) from None
        if r.status_code != 200:
            raise_for_response(r)
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
            raise unreachable(e) from None
        return decode_response(r, isinstance(hidden_states, np.ndarray))

    async def status(self) -> dict[str, Any]:
        try:
            r = await self.client.get("/v1/status", headers=self._auth)
        except httpx.HTTPError as e:
            raise unreachable(e) from None
        if r.status_code != 200:
            raise_for_response(r)
        return r.json()

    async def aclose(self) -> None:
        await self.client.aclose()

    async def __aenter__(self) -> AsyncHTTPMoEClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
