"""Python clients of the MoE app: Serve handles (``MoEClient``) and their per-layer lanes
(``MoEClient.lane``, ``lane.Lane``), HTTP (``HTTPMoEClient``,
``AsyncHTTPMoEClient``), and ``afd`` (a decoder whose MoE layers run on the tier)."""

from .client import (
    DEFAULT_TIMEOUT_S,
    AsyncHTTPMoEClient,
    HTTPMoEClient,
    MoEClient,
    MoEOverloadedError,
    MoERequestError,
    MoEServeError,
    MoEServerError,
)

__all__ = [
    "DEFAULT_TIMEOUT_S", "AsyncHTTPMoEClient", "HTTPMoEClient", "MoEClient", "MoEOverloadedError",
    "MoERequestError", "MoEServeError", "MoEServerError",
]
