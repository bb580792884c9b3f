"""Layer -> deployment routing, shared by every caller of the TP groups: ``MoEClient`` (direct
handles), the ingress (HTTP and app-handle calls), lanes, cohorts and the AFD decoder.

Routing: the app's table ``{deployment: served layers}`` (the ingress's ``routing()``, built
from the resolved specs); a call goes to the named deployment, else the default when it serves
the layer, else the first that does (apps split by layer ranges), else the default (which then
says what is wrong).

Pure: no Ray import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import UnknownDeploymentError


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
