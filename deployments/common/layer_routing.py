"""Layer -> deployment routing and the one retry rule, shared by every caller of the TP groups:
``MoEClient`` (direct handles), the ingress (HTTP and app-handle calls) and the AFD decoder.

Routing: the app's table ``{deployment: served layers}`` (the ingress's ``routing()``, built
from the resolved specs); a call goes to the named deployment, else the default when it serves
the layer, else the first that does (apps split by layer ranges), else the default (which then
says what is wrong).

Retry: a forward is attempted at most ``MAX_ATTEMPTS`` = 2 times on any path, once more only
when it met a broken TP group or a replica that died (``errors.retryable``; forwards are
idempotent). The retry is made
by the hop nearest the replicas: ``MoEClient`` when it calls a deployment directly, the ingress
for HTTP and ``MoEClient(via_ingress=True)`` (which then does not retry itself). A replica whose
group broke answers after ``BROKEN_ANSWER_DELAY_S``, by when the request router
(``deployments.serve.router``, stats every ``ROUTING_STATS_PERIOD_S``) routes the retry to a
usable replica.

Pure: no Ray import.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import UnknownDeploymentError, retryable

MAX_ATTEMPTS = 2
ROUTING_STATS_PERIOD_S = 0.5
BROKEN_ANSWER_DELAY_S = 3 * ROUTING_STATS_PERIOD_S

T = TypeVar("T")


@dataclass(frozen=True)
class LayerRoutes:
    """The app's routing table: each deployment's served layers, and the default deployment."""

    layers: Mapping[str, tuple[int, ...]]
    default: str

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> LayerRoutes:
        """From ``{"default": name, "layers": {name: [layers]}}`` (the ingress's ``routing()``)."""
        return cls({n: tuple(int(x) for x in ls) for n, ls in table["layers"].items()}, table["default"])

    @classmethod
    def single(cls, deployment: str, layers: Iterable[int] | None = None) -> LayerRoutes:
        """One deployment; ``layers`` None: every layer goes to it (it says which it serves)."""
        return cls({deployment: tuple(layers) if layers is not None else ()}, deployment)

    def to_dict(self) -> dict[str, Any]:
        return {"default": self.default, "layers": {n: list(ls) for n, ls in self.layers.items()}}

    def choose(self, layer: Any, deployment: str | None = None) -> str:
        """The deployment to call for ``layer`` (or the named one, which must exist)."""
        if deployment is not None:
            if deployment not in self.layers:
                raise UnknownDeploymentError(
                    f"unknown deployment {deployment!r}; this app serves {list(self.layers)}"
                )
            return deployment
        if layer in self.layers[self.default]:
            return self.default
        return next((name for name, served in self.layers.items() if layer in served), self.default)


def call_with_retry(call: Callable[[], T]) -> T:
    """``call()``, once more when it met a broken TP group (at most ``MAX_ATTEMPTS``)."""
    for _ in range(MAX_ATTEMPTS - 1):
        try:
            return call()
        except Exception as e:
            if not retryable(e):
                raise
    return call()


async def call_with_retry_async(call: Callable[[], Awaitable[T]]) -> T:
    """The asyncio twin of :func:`call_with_retry`."""
    for _ in range(MAX_ATTEMPTS - 1):
        try:
            return await call()
        except Exception as e:
            if not retryable(e):
                raise
    return await call()


async def sleep_before_broken_answer() -> None:
    """Replica side: let the router learn of the broken group before the caller retries."""
    await asyncio.sleep(BROKEN_ANSWER_DELAY_S)
