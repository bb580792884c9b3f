"""HTTP ingress (binary, no pickle) and app-handle front door of the TP-group deployments.

Routes:

* ``POST /v1/layers/{layer}/forward``: the app's default (first) deployment, or the first
  deployment serving ``layer`` when the default does not (apps split by layer ranges).
* ``POST /v1/{deployment}/layers/{layer}/forward``: a named deployment (``prefill``, ``decode``).
  Body: safetensors with ``hidden_states [T, H]`` and optionally ``router_logits [T, E]``;
  answer: safetensors with ``output [T, H]``. ``hidden_states`` is F32 (any deployment: it
  takes the numpy path of the handle API, so a bfloat16 deployment rounds it and answers F32)
  or BF16 (bfloat16 deployments only; answered in BF16).
* ``GET /v1/status``: JSON status of every deployment, and every replica's warm-up record
  (``warmup``: a starting replica's progress, or whether its tail plan was measured or reused).
  ``GET /healthz``: 200 when every deployment answers with a usable TP group, 503 otherwise (JSON
  details either way).

Errors are JSON ``{"error": message, "type": class, "status": code}``: 400 malformed body /
missing or unexpected tensor / bad shape, dtype or values, 404 unknown layer, deployment or
route, 413 too many tokens or a body over ``max_body_bytes``; 5xx are ours (503: the TP group
broke and its replica is being replaced, or the deployment's queue is full
(``max_queued_requests``; with a ``Retry-After`` header); 504: a call outlived its bound).
"""

import asyncio
import math
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from safetensors import SafetensorError
from safetensors.numpy import save as st_save_numpy
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_runtime.units import format_layers

from .. import logger
from ..cluster import kv
from ..common.errors import (
    GroupTimeoutError,
    ServeInputError,
    TooLargeError,
    UnknownLayerError,
    error_message,
    http_status,
    retry_after_s,
    root_cause,
)
from ..common.layer_routing import LayerRoutes, call_with_retry_async
from ..common.wire import WireTensor

SAFETENSORS_MEDIA_TYPE = "application/octet-stream"
INPUT_TENSORS = ("hidden_states", "router_logits")
HEALTH_TIMEOUT_S = 5.0

api = FastAPI(title="latent-moe-serve", docs_url=None, redoc_url=None)


def error_response(exc: BaseException) -> JSONResponse:
    cause = root_cause(exc)
    status = http_status(cause)
    retry = retry_after_s(cause)
    headers = None if retry is None else {"Retry-After": str(max(0, math.ceil(retry)))}
    return JSONResponse({"error": error_message(cause), "type": type(cause).__name__, "status": status},
                        status_code=status, headers=headers)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    return JSONResponse({"error": message, "type": "HTTPException", "status": exc.status_code},
                        status_code=exc.status_code)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse({"error": str(exc.errors()), "type": "RequestValidationError", "status": 400},
                        status_code=400)


def decode_body(body: bytes) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden_states`` (and optional ``router_logits``) from a safetensors body."""
    if not body:
        raise ServeInputError("empty body: expected safetensors with a 'hidden_states' tensor")
    try:
        tensors = st_load(body)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise ServeInputError(f"body is not a valid safetensors file: {e}") from None
    unexpected = sorted(set(tensors) - set(INPUT_TENSORS))
    if unexpected:
        raise ServeInputError(f"unexpected tensor(s) {unexpected}; the body may hold {list(INPUT_TENSORS)}")
    if "hidden_states" not in tensors:
        raise ServeInputError(f"missing tensor 'hidden_states' (the body holds {sorted(tensors)})")
    return tensors["hidden_states"], tensors.get("router_logits")


def encode_body(tensors: dict[str, torch.Tensor | np.ndarray]) -> bytes:
    """A safetensors body; all torch or all numpy (numpy answers to F32 requests)."""
    if all(isinstance(v, np.ndarray) for v in tensors.values()):
        return st_save_numpy({k: np.ascontiguousarray(v) for k, v in tensors.items()})
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def parse_layer(layer: str) -> int:
    try:
        return int(layer)
    except ValueError:
        raise UnknownLayerError(f"layer must be an integer, got {layer!r}") from None


@serve.ingress(api)
class MoEIngress:
    """Routes HTTP and app-handle calls to the TP-group deployments by name."""

    def __init__(
        self, groups: dict[str, Any], routes: LayerRoutes, max_body_bytes: int, request_timeout_s: float
    ):
        self.groups = groups  # name -> DeploymentHandle
        self.routes = routes  # name -> served layers, and the default deployment
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s = request_timeout_s
        logger.info(
            "ingress: deployments %s (default %r), body limit %d bytes, request timeout %.0f s",
            list(groups), routes.default, max_body_bytes, request_timeout_s,
        )

    def route(self, deployment: str | None, layer: Any) -> str:
        return self.routes.choose(layer, deployment)

    async def _call(self, what: str, response) -> Any:
        try:
            return await asyncio.wait_for(response, self.request_timeout_s)
        except TimeoutError:
            response.cancel()
            raise GroupTimeoutError(f"{what} got no answer within {self.request_timeout_s:.0f} s") from None

    # -- app-handle API -------------------------------------------------------------------

    async def forward(
        self, hidden_states: Any, layer: int, router_logits: Any = None, deployment: str | None = None
    ) -> Any:
        try:
            return await self._forward(self.route(deployment, layer), hidden_states, layer, router_logits)
        except Exception as e:
            raise root_cause(e) from None

    async def _forward(self, name: str, hidden_states: Any, layer: int, router_logits: Any) -> Any:
        # The ingress is the hop nearest the replicas on this path: it makes the one retry
        # (common.layer_routing).
        def attempt():
            response = self.groups[name].forward.remote(hidden_states, layer, router_logits)
            return self._call(f"layer {layer} of {name!r}", response)

        return await call_with_retry_async(attempt)

    def layer_routes(self) -> dict[str, Any]:
        """The app's routing table, for clients that route by layer themselves (``MoEClient``)."""
        return self.routes.to_dict()

    async def health(self) -> dict[str, Any]:
        """Each deployment's group health, as one of its replicas reports it."""

        async def one(name: str, handle) -> tuple[str, dict]:
            try:
                return name, await asyncio.wait_for(handle.health.remote(), HEALTH_TIMEOUT_S)
            except Exception as e:
                return name, {"healthy": False, "error": error_message(e)}

        results = dict(await asyncio.gather(*(one(n, h) for n, h in self.groups.items())))
        deployments = {n: {"layers": format_layers(self.routes.layers[n]), **r} for n, r in results.items()}
        return {"ok": all(r["healthy"] for r in results.values()), "default": self.routes.default,
                "deployments": deployments}

    async def status(self) -> dict[str, Any]:
        """Every deployment's ``status()``; with several replicas, whichever replica the handle
        picks answers for its deployment (its own counters and workers)."""

        async def one(name: str, handle) -> tuple[str, dict]:
            try:
                return name, await self._call(f"status of {name!r}", handle.status.remote())
            except Exception as e:
                return name, {"deployment": name, "healthy": False, "error": error_message(e)}

        results = await asyncio.gather(*(one(n, h) for n, h in self.groups.items()))
        return {"default_deployment": self.routes.default, "deployments": dict(results),
                "warmup": self.warmup()}

    def warmup(self) -> dict[str, list[dict[str, Any]]]:
        """Each deployment's replicas' warm-up records (measuring with progress, measured or
        reused), from the cluster's store: a starting replica cannot answer status() itself."""
        records: dict[str, list[dict[str, Any]]] = {name: [] for name in self.groups}
        for record in kv.entries(kv.PROGRESS_PREFIX).values():
            records.setdefault(record["deployment"], []).append(record)
        return records

    # -- HTTP -----------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise TooLargeError(f"body of {declared} bytes exceeds the limit of {self.max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise TooLargeError(f"body exceeds the limit of {self.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _http_forward(self, request: Request, layer: str, deployment: str | None) -> Response:
        try:
            layer_id = parse_layer(layer)
            name = self.route(deployment, layer_id)
            x, logits = decode_body(await self._read_body(request))
            # F32 travels as numpy: the deployment's numpy rules apply (see serve/deployment.py).
            hidden = x.numpy() if x.dtype == torch.float32 else WireTensor.from_torch(x)
            if logits is not None:
                logits = WireTensor.from_torch(logits)
            out = await self._forward(name, hidden, layer_id, logits)
            if isinstance(out, WireTensor):
                out = out.to_torch()
            return Response(encode_body({"output": out}), media_type=SAFETENSORS_MEDIA_TYPE)
        except Exception as e:
            if http_status(e) >= 500:
                logger.warning("HTTP forward failed: %s", error_message(e))
            return error_response(e)

    @api.post("/v1/layers/{layer}/forward")
    async def http_forward_default(self, layer: str, request: Request) -> Response:
        return await self._http_forward(request, layer, None)

    @api.post("/v1/{deployment}/layers/{layer}/forward")
    async def http_forward(self, deployment: str, layer: str, request: Request) -> Response:
        return await self._http_forward(request, layer, deployment)

    @api.get("/v1/status")
    async def get_status(self) -> JSONResponse:
        return JSONResponse(await self.status())

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        """200 when every deployment answers with a usable TP group, else 503 with the details."""
        health = await self.health()
        return JSONResponse(health, status_code=200 if health["ok"] else 503)


Ingress = serve.deployment(MoEIngress)
