"""HTTP ingress (binary, no pickle) and app-handle front door of the TP-group deployments.

Routes:

* ``POST /v1/layers/{layer}/forward``: the app's default (first) deployment, or the first
  deployment serving ``layer`` when the default does not (apps split by layer ranges).
* ``POST /v1/{deployment}/layers/{layer}/forward``: a named deployment (``prefill``, ``decode``).
  Body: safetensors with ``hidden_states [T, H]`` and optionally ``router_logits [T, E]``;
  answer: safetensors with ``output [T, H]``. ``hidden_states`` is F32 (any deployment: it
  takes the numpy path of the handle API, so a bfloat16 deployment rounds it and answers F32)
  or BF16 (bfloat16 deployments only; answered in BF16).
* ``POST /v1/sessions/move``: JSON ``{session, deployment, from, replica, secret, peer}`` from a
  session's peer whose group failed; answers ``{"group": ...}``, the session's group on a healthy
  replica (the same for every peer of the session: ``cluster.moves``), 503 while none can take
  it (the peer asks again), 403 a wrong secret, 404 an unknown or ended session.
* ``GET /v1/status``: JSON status of every deployment, and every replica's warm-up record
  (``warmup``: a starting replica's progress, or whether its tail plan was measured or reused).
  ``GET /healthz``: 200 when every deployment answers with a usable TP group, 503 otherwise (JSON
  details either way).
* ``GET /openapi.json``: the OpenAPI schema of these routes (forward bodies declared as binary).

Authentication (optional): when the environment variable named by ``http_token_env`` (default
``LMS_HTTP_TOKEN``) is set where an ingress replica runs, the forward and status routes require
``Authorization: Bearer <that value>`` (compared in constant time) and answer 401 otherwise;
``/healthz`` and ``/openapi.json`` stay open (they reveal no data). The token never leaves the
replica's environment: not in the app's arguments, ``status()``, logs or reprs.
``http_token_required: true`` makes a replica without the variable refuse to start. The
app-handle path (inside the Ray cluster) is not token-checked: access to the cluster is its door.

Errors are JSON ``{"error": message, "type": class, "status": code}``: 400 malformed body /
missing or unexpected tensor / bad shape, dtype or values, 404 unknown layer, deployment or
route, 413 too many tokens or a body over ``max_body_bytes``; 5xx are ours (503: the TP group
broke and its replica is being replaced, or the deployment's queue is full
(``max_queued_requests``; with a ``Retry-After`` header); 504: a call outlived its bound); 401
a missing or wrong token (with ``WWW-Authenticate: Bearer``).
"""

import asyncio
import dataclasses
import hmac
import math
import os
import re
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from safetensors import SafetensorError, TensorSpec
from safetensors import deserialize as st_deserialize
from safetensors import serialize as st_serialize
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_runtime.units import SAFETENSORS_DTYPES, VIEW_AS, format_layers

from .. import logger
from ..cluster import kv, moves
from ..common.errors import (
    RequestTimeoutError,
    ServeInputError,
    TooLargeError,
    UnknownLayerError,
    error_message,
    http_status,
    retry_after_s,
    root_cause,
)
from ..common.layer_routing import LayerRoutes
from ..common.retry import call_with_retry_async
from ..common.wire import WireTensor
from ..config.timeouts import INGRESS_HEALTH_S

SAFETENSORS_MEDIA_TYPE = "application/octet-stream"
INPUT_TENSORS = ("hidden_states", "router_logits")
HTTP_TOKEN_ENV = "LMS_HTTP_TOKEN"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# docs_url / redoc_url off (no HTML UI to serve); the schema itself stays at /openapi.json.
api = FastAPI(title="latent-moe-serve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")


class MoveRequest(BaseModel):
    """A peer's ask to move its session off a failed group (``cluster.moves``)."""

    model_config = ConfigDict(populate_by_name=True)
    session: str
    deployment: str
    from_: str = Field(alias="from")  # the failed group's session id
    replica: str
    secret: str
    peer: int | None = None


class ErrorBody(BaseModel):
    """Every error answer: the message, the error's class and the HTTP status."""

    error: str
    type: str
    status: int


ERROR_WHY = {
    400: "malformed or invalid input",
    401: "missing or wrong bearer token",
    404: "unknown layer or deployment",
    413: "too many tokens or body too large",
    503: "TP group failed or queue full",
    504: "timed out",
}
ERROR_RESPONSES = {code: {"model": ErrorBody, "description": why} for code, why in ERROR_WHY.items()}
FORWARD_OPENAPI = {
    "requestBody": {
        "required": True,
        "description": "safetensors file with hidden_states [T, H] (F32, or BF16 for bfloat16 "
                       "deployments) and optionally router_logits [T, E]",
        "content": {SAFETENSORS_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
    },
}
FORWARD_RESPONSES = {
    200: {"description": "safetensors file with output [T, H]",
          "content": {SAFETENSORS_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}},
    **ERROR_RESPONSES,
}


class BearerToken:
    """The ingress's shared secret: compared in constant time, never shown (repr, str, logs)."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str):
        self._secret = secret.encode()

    def __repr__(self) -> str:
        return "BearerToken(<hidden>)"

    __str__ = __repr__

    def matches(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value is ``Bearer <the secret>``."""
        scheme, _, value = (authorization or "").partition(" ")
        # compare_digest runs in time independent of where the values differ (not of the length).
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self._secret)


def check_token_env(name: str) -> str:
    if not isinstance(name, str) or not ENV_NAME.match(name):
        raise ValueError(
            f"http_token_env must name an environment variable ([A-Za-z_][A-Za-z0-9_]*), got {name!r}"
        )
    return name


def token_from_env(name: str = HTTP_TOKEN_ENV, required: bool = False) -> BearerToken | None:
    """The token in environment variable ``name`` (None when unset or empty); ``required``: a
    ValueError when it is missing, naming the variable (never its value)."""
    value = os.environ.get(check_token_env(name), "")
    if not value:
        if required:
            raise ValueError(
                f"http_token_required is set but ${name} is empty or unset where the ingress runs: set it "
                "in the environment of every Ray node (or the app's runtime_env) before deploying"
            )
        return None
    if value != value.strip() or not value.isprintable():
        raise ValueError(f"${name} must be printable with no surrounding whitespace (its value is not shown)")
    return BearerToken(value)


def unauthorized(token_env: str) -> JSONResponse:
    message = f"missing or wrong bearer token: send 'Authorization: Bearer <the ingress's ${token_env}>'"
    return JSONResponse({"error": message, "type": "Unauthorized", "status": 401}, status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})


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


def decode_body(body: bytes) -> tuple[np.ndarray | WireTensor, WireTensor | None]:
    """``hidden_states`` (and optional ``router_logits``) from a safetensors body, as they travel
    to the deployments: F32 ``hidden_states`` as a numpy array (the handle API's numpy path),
    anything else as a :class:`WireTensor`. Read with numpy alone (no torch in the ingress)."""
    if not body:
        raise ServeInputError("empty body: expected safetensors with a 'hidden_states' tensor")
    try:
        tensors = dict(st_deserialize(body))
    except (SafetensorError, ValueError) as e:
        raise ServeInputError(f"body is not a valid safetensors file: {e}") from None
    unexpected = sorted(set(tensors) - set(INPUT_TENSORS))
    if unexpected:
        raise ServeInputError(f"unexpected tensor(s) {unexpected}; the body may hold {list(INPUT_TENSORS)}")
    if "hidden_states" not in tensors:
        raise ServeInputError(f"missing tensor 'hidden_states' (the body holds {sorted(tensors)})")
    hidden = body_tensor("hidden_states", tensors["hidden_states"])
    logits = tensors.get("router_logits")
    return (hidden.array if hidden.dtype == "float32" else hidden,
            None if logits is None else body_tensor("router_logits", logits))


def body_tensor(name: str, entry: dict[str, Any]) -> WireTensor:
    """One deserialized safetensors entry (``dtype`` code, ``shape``, ``data``) over its bytes."""
    code = entry["dtype"]
    dtype = SAFETENSORS_DTYPES.get(code)  # the deployments check which they serve
    if dtype is None:
        raise ServeInputError(f"tensor {name!r} has safetensors dtype {code}, which this server does not "
                              "read (hidden_states: F32, or BF16 for bfloat16 deployments)")
    array = np.frombuffer(entry["data"], VIEW_AS.get(dtype, dtype)).reshape(entry["shape"])
    return WireTensor(array, dtype)


def encode_body(tensors: dict[str, np.ndarray | WireTensor]) -> bytes:
    """A safetensors body of numpy arrays (answers to F32 requests) and :class:`WireTensor`s."""
    specs, keep = {}, []
    for name, t in tensors.items():
        array, dtype = (t.array, t.dtype) if isinstance(t, WireTensor) else (t, t.dtype.name)
        array = np.ascontiguousarray(array)
        keep.append(array)  # serialize reads the bytes through their address
        specs[name] = TensorSpec(dtype=dtype, shape=array.shape, data_ptr=array.ctypes.data,
                                 data_len=array.nbytes)
    return bytes(st_serialize(specs))


def parse_layer(layer: str) -> int:
    try:
        return int(layer)
    except ValueError:
        raise UnknownLayerError(f"layer must be an integer, got {layer!r}") from None


@serve.ingress(api)
class MoEIngress:
    """Routes HTTP and app-handle calls to the TP-group deployments by name."""

    def __init__(
        self, groups: dict[str, Any], routes: LayerRoutes, max_body_bytes: int, request_timeout_s: float,
        token_env: str = HTTP_TOKEN_ENV, token_required: bool = False,
    ):
        self.groups = groups  # name -> DeploymentHandle
        self.routes = routes  # name -> served layers, and the default deployment
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s = request_timeout_s
        self.token_env = token_env
        self._token = token_from_env(token_env, token_required)  # read here: where the ingress runs
        logger.info(
            "ingress: deployments %s (default %r), body limit %d bytes, request timeout %.0f s, HTTP %s",
            list(groups), routes.default, max_body_bytes, request_timeout_s, self.http_auth()["mode"],
        )

    def http_auth(self) -> dict[str, Any]:
        """How the HTTP routes are guarded (never the token itself)."""
        env = self.token_env
        if self._token is None:
            return {"mode": f"open (no ${env} set)", "token_env": env, "required": False}
        return {"mode": f"bearer token from ${env}", "token_env": env, "required": True}

    def _refused(self, request: Request) -> JSONResponse | None:
        """A 401 answer unless the request carries the token (None: let it through)."""
        if self._token is None or self._token.matches(request.headers.get("authorization")):
            return None
        return unauthorized(self.token_env)

    def route(self, deployment: str | None, layer: Any) -> str:
        return self.routes.choose(layer, deployment)

    async def _call(self, what: str, response) -> Any:
        try:
            return await asyncio.wait_for(response, self.request_timeout_s)
        except TimeoutError:
            response.cancel()
            raise RequestTimeoutError(f"{what} got no answer within {self.request_timeout_s:.0f} s") from None

    # -- app-handle API -------------------------------------------------------------------

    async def forward(
        self, hidden_states: Any, layer: int, router_logits: Any = None, deployment: str | None = None
    ) -> Any:
        try:
            return await self._forward(self.route(deployment, layer), hidden_states, layer, router_logits)
        except Exception as e:
            raise root_cause(e) from None

    async def _forward(self, name: str, hidden_states: Any, layer: int, router_logits: Any) -> Any:
        # The ingress is the hop nearest the replicas on this path: it applies the retry rule
        # (common.retry).
        def attempt(avoid_replica: str | None):
            response = self.groups[name].forward.remote(hidden_states, layer, router_logits,
                                                        avoid_replica=avoid_replica)
            return self._call(f"layer {layer} of {name!r}", response)

        return await call_with_retry_async(attempt)

    def layer_routes(self) -> dict[str, Any]:
        """The app's routing table, for clients that route by layer themselves (``MoEClient``)."""
        return self.routes.to_dict()

    async def health(self) -> dict[str, Any]:
        """Each deployment's group health, as one of its replicas reports it."""

        async def one(name: str, handle) -> tuple[str, dict]:
            try:
                return name, await asyncio.wait_for(handle.health.remote(), INGRESS_HEALTH_S)
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
        return {"default_deployment": self.routes.default, "http_auth": self.http_auth(),
                "deployments": dict(results), "warmup": await asyncio.to_thread(self.warmup)}

    def warmup(self) -> dict[str, list[dict[str, Any]]]:
        """Each deployment's live replicas' warm-up records (measuring with progress, measured or
        reused), from the cluster's store: a starting replica cannot answer status() itself.
        Blocking (GCS reads): :meth:`status` runs it off the event loop."""
        records: dict[str, list[dict[str, Any]]] = {name: [] for name in self.groups}
        for record in kv.live_progress():
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
            # F32 travels as numpy: the deployment's numpy rules apply (see serve/deployment.py).
            hidden, logits = decode_body(await self._read_body(request))
            out = await self._forward(name, hidden, layer_id, logits)
            return Response(encode_body({"output": out}), media_type=SAFETENSORS_MEDIA_TYPE)
        except Exception as e:
            if http_status(e) >= 500:
                logger.warning("HTTP forward failed: %s", error_message(e))
            return error_response(e)

    @api.post("/v1/layers/{layer}/forward", openapi_extra=FORWARD_OPENAPI, responses=FORWARD_RESPONSES,
              response_class=Response)
    async def http_forward_default(self, layer: str, request: Request) -> Response:
        return self._refused(request) or await self._http_forward(request, layer, None)

    @api.post("/v1/{deployment}/layers/{layer}/forward", openapi_extra=FORWARD_OPENAPI,
              responses=FORWARD_RESPONSES, response_class=Response)
    async def http_forward(self, deployment: str, layer: str, request: Request) -> Response:
        return self._refused(request) or await self._http_forward(request, layer, deployment)

    @api.post("/v1/sessions/move")
    async def http_move_session(self, body: MoveRequest) -> JSONResponse:
        """A session's peer whose group failed asks for the session's group on another replica
        (``cluster.moves``). Proven by the session's secret, not the bearer token: a Ray-less
        peer holds its ticket, nothing else."""
        try:
            group = await moves.move(body.model_dump(by_alias=True), self._open_session)
        except moves.MoveRefused as e:
            return JSONResponse({"error": str(e), "type": "MoveRefused", "status": e.status},
                                status_code=e.status)
        logger.info("session %r of %r moved to replica %s (asked by peer %s after %s failed)",
                    body.session, body.deployment, group.replica, body.peer, body.replica)
        return JSONResponse({"group": dataclasses.asdict(group)})

    async def _open_session(self, deployment: str, **opened_with: Any) -> dict[str, Any]:
        handle = self.groups.get(deployment)
        if handle is None:
            raise moves.MoveRefused(404, f"this app has no deployment {deployment!r}")
        try:
            return await self._call(f"a session on {deployment!r}", handle.open_session.remote(**opened_with))
        except Exception as e:  # the replica asked is broken or gone: the peer asks again
            raise moves.MoveRefused(503, f"opening the session on {deployment!r} failed: "
                                         f"{error_message(e)}") from None

    @api.get("/v1/status", responses={401: ERROR_RESPONSES[401]})
    async def get_status(self, request: Request) -> JSONResponse:
        return self._refused(request) or JSONResponse(await self.status())

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        """200 when every deployment answers with a usable TP group, else 503 with the details."""
        health = await self.health()
        return JSONResponse(health, status_code=200 if health["ok"] else 503)


Ingress = serve.deployment(MoEIngress)
