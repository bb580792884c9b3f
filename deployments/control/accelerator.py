"""The one accelerator decision of a deployment: a pure function of its spec and a cluster view.

Two facts, decided together once at build time and carried on the controller's ``Decision`` to
placement (bundles), the memory budget, the warm-up cost estimate, the workers and ``status()``:

* ``layout`` — the placement-group bundles: ``gpu`` (one ``{"GPU": 1}`` per rank) or ``cpu``
  (one ``{"CPU": worker_cpus}`` per rank). ``auto`` is ``gpu`` when some node has GPUs or the
  launcher can add a node type with GPUs (or when there is no view: the production MI300X
  layout), else ``cpu``.
* ``compute`` — where the ranks compute: ``gpu`` only with the GPU layout on GPUs Ray detected
  as real (an ``accelerator_type:*`` resource on a GPU node, or a pinned ``accelerator_type``);
  logical GPUs (``ray start --num-gpus`` on a CPU machine, as in tests) compute on ``cpu``.
  The memory budget and the cost estimate follow ``compute``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.spec import DeploymentSpec
from .cluster_view import ClusterView


@dataclass(frozen=True)
class Accelerator:
    layout: str  # "gpu" | "cpu": the bundles
    compute: str  # "gpu" | "cpu": where the ranks compute (memory budget, cost, worker device)
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "compute": self.compute, "reason": self.reason}


def _layout(spec: DeploymentSpec, view: ClusterView | None) -> tuple[str, str]:
    if spec.accelerator != "auto":
        return spec.accelerator, f"accelerator: {spec.accelerator} was requested"
    if view is None:
        return "gpu", "accelerator auto: no cluster view was given, so GPU bundles as on MI300X"
    if view.gpus() > 0:
        return "gpu", f"accelerator auto: {view.source} has {view.gpus():g} GPU(s)"
    types = view.addable_gpu_types()
    if types:
        t = types[0]
        return "gpu", (f"accelerator auto: {view.source} has no GPU now, but the launcher can add "
                       f"node type {t.name!r} with {t.resources['GPU']:g} GPU(s)")
    return "cpu", (f"accelerator auto: {view.source} has no GPU and no node type the launcher can add "
                   "has one, so the ranks run on CPU bundles (gloo)")


def decide_accelerator(spec: DeploymentSpec, view: ClusterView | None) -> Accelerator:
    """Bundles and compute device of ``spec`` on ``view`` (None: no view, the MI300X layout)."""
    layout, why = _layout(spec, view)
    if layout == "cpu":
        return Accelerator("cpu", "cpu", why)
    if spec.accelerator_type:
        pinned = f"{why}; workers are pinned to accelerator_type {spec.accelerator_type}"
        return Accelerator("gpu", "gpu", pinned)
    if view is None:
        return Accelerator("gpu", "gpu", why)
    real = view.accelerator_types()
    if real:
        return Accelerator("gpu", "gpu", f"{why}; its GPU nodes carry {real[0]}")
    return Accelerator("gpu", "cpu", f"{why}; no GPU node carries an accelerator_type resource, so the GPUs "
                                     "are logical and the ranks compute on the node's CPUs")
