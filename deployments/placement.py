"""Where TP groups can run: the Ray cluster as the app builder sees it, the ``accelerator``
choice, and a placement check that refuses at build time what Ray could never place.

Ray Serve never gives up on a replica whose placement group cannot be placed: it logs a
warning every 30 s and waits (``deployment_state.py``, "taken more than 30s to be scheduled").
A TP group asking for GPU bundles on a Ray instance without GPUs therefore hung ``serve run``
forever. Here the builder looks at the cluster first:

* :func:`current_cluster_view` — the nodes of the connected Ray cluster, or, when ``serve run``
  has not connected yet (the import-path form builds the app *before* ``ray.init``), of the
  cluster it is about to join (``RAY_ADDRESS`` or a running local instance), or the fresh local
  instance it will start (this machine's CPUs and GPUs as Ray detects them, with
  ``RAY_OVERRIDE_RESOURCES``); plus the node types a cluster launcher may add (the deployments'
  ``cluster_config`` files, the autoscaler's config in the GCS, or the head's
  ``~/ray_bootstrap_config.yaml``).
* :func:`choose_accelerator` — ``auto`` is ``gpu`` when some node has GPUs or the launcher can
  add one with GPUs, else ``cpu``.
* :func:`check_placeable` — one replica's bundles must fit one node (``STRICT_PACK``) that exists
  or can be added, and the app's minimum replicas must fit the cluster's total; otherwise a
  ``ValueError`` names the missing resources and the command that provides them.

A group that *can* be placed but waits for capacity (the launcher adding a node, another
deployment releasing GPUs) is Serve's normal pending state; the shared capacity budget of
``cluster_spec.share_gpus`` keeps an app from asking for more than its cluster can hold.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moe_runtime.logs import log_once

from . import logger
from .options import placement_bundles, uses_gpus
from .spec import AppArgs, DeploymentSpec

Resources = dict[str, float]
# The cluster launcher writes the filled-out config here on the head node.
BOOTSTRAP_CONFIG = Path("~/ray_bootstrap_config.yaml").expanduser()
# Ray's bookkeeping resources, never asked for by a deployment.
_IGNORED = ("memory", "object_store_memory", "node:")


@dataclass(frozen=True)
class NodeType:
    """Per-node resources of a node type the launcher may add, and how many at most."""

    name: str
    resources: Mapping[str, float]
    max_nodes: int


@dataclass(frozen=True)
class ClusterView:
    """The nodes a deployment can be placed on: those alive now and those the launcher may add."""

    source: str  # what was inspected, for messages
    nodes: tuple[Mapping[str, float], ...]
    addable: tuple[NodeType, ...] = ()
    fresh_local: bool = False  # the local instance `serve run` / `serve.run` will start

    def gpus(self) -> float:
        return sum(n.get("GPU", 0) for n in self.nodes)

    def addable_gpu_types(self) -> list[NodeType]:
        return [t for t in self.addable if t.resources.get("GPU", 0) > 0 and t.max_nodes > 0]

    def candidates(self) -> list[Mapping[str, float]]:
        """Every node shape a placement group could land on."""
        return [*self.nodes, *(t.resources for t in self.addable if t.max_nodes > 0)]

    def totals(self) -> Resources:
        """Per resource: what the cluster holds at most, now or once the launcher has added every
        node it may. A node type's maximum includes its nodes already up, so live nodes of a
        launcher shape are not counted twice; the others (the head) are added to it."""
        def add(into: Resources, node: Mapping[str, float], times: float = 1) -> None:
            for k, v in node.items():
                into[k] = into.get(k, 0) + v * times

        live: Resources = {}
        launched: Resources = {}
        shapes = [dict(t.resources) for t in self.addable]
        for node in self.nodes:
            add(live, node)
            if self.addable and not any(node.get("GPU", 0) == s.get("GPU", 0) for s in shapes):
                add(launched, node)
        for t in self.addable:
            add(launched, t.resources, t.max_nodes)
        return {k: max(live.get(k, 0), launched.get(k, 0)) for k in {*live, *launched}}


def _clean(resources: Mapping[str, Any]) -> Resources:
    return {k: float(v) for k, v in resources.items() if not k.startswith(_IGNORED)}


def launcher_node_types(config: Mapping[str, Any]) -> list[NodeType]:
    """Worker node types of a cluster-launcher config (the head is already a live node)."""
    from .cluster_spec import node_capacities

    return [NodeType(c.name, _clean(c.resources), c.max_workers)
            for c in node_capacities(dict(config)) if not c.is_head and c.max_workers > 0]


def _gcs_node_types() -> list[NodeType]:
    """The autoscaler's node types as it reported them to the GCS (None when no autoscaler)."""
    from ray._private.state import state

    config = state.get_cluster_config()
    if config is None:
        return []
    return [NodeType(g.name or f"group{i}", _clean(dict(g.resources)),
                     10**6 if g.max_count < 0 else int(g.max_count))
            for i, g in enumerate(config.node_group_configs)]


def _local_node() -> Resources:
    """The resources of the local instance Ray would start on this machine (its own detection)."""
    from ray._private import accelerators, utils

    resources: Resources = {"CPU": float(utils.get_num_cpus())}
    for manager in accelerators.get_all_accelerator_managers():
        name = manager.get_resource_name()
        count = manager.get_current_node_num_accelerators() or 0
        resources[name] = max(resources.get(name, 0.0), float(count))
    override = os.environ.get("RAY_OVERRIDE_RESOURCES")
    if override:
        resources.update(_clean(json.loads(override)))
    return {k: v for k, v in resources.items() if v > 0 or k in ("CPU", "GPU")}


def _gcs_nodes(address: str) -> list[Resources]:
    from ray._raylet import GcsClient

    infos = GcsClient(address=address).get_all_node_info(timeout=10)
    return [_clean(dict(i.resources_total)) for i in infos.values() if i.state == 0]  # 0: ALIVE


def current_cluster_view(launcher_configs: Iterable[str | Path] = ()) -> ClusterView | None:
    """The cluster the app will be deployed on (None when it cannot be inspected)."""
    import ray

    from .cluster_spec import load_cluster_config

    addable: list[NodeType] = []
    for path in launcher_configs:
        addable.extend(launcher_node_types(load_cluster_config(path)))
    try:
        if ray.is_initialized():
            nodes = [_clean(n["Resources"]) for n in ray.nodes() if n["Alive"]]
            address = ray.get_runtime_context().gcs_address
            if not addable:
                addable = _gcs_node_types()
            if not addable and BOOTSTRAP_CONFIG.is_file():  # filled out by the launcher: no schema check
                addable = launcher_node_types(yaml.safe_load(BOOTSTRAP_CONFIG.read_text()))
            return ClusterView(f"the Ray cluster at {address}", tuple(nodes), tuple(addable))
        from ray._private.services import canonicalize_bootstrap_address

        address = canonicalize_bootstrap_address(os.environ.get("RAY_ADDRESS"))
        if address is None:
            return ClusterView("the local Ray instance `serve run` starts on this machine (none is running)",
                               (_local_node(),), tuple(addable), fresh_local=True)
        return ClusterView(f"the Ray cluster at {address}", tuple(_gcs_nodes(address)), tuple(addable))
    except Exception as e:  # an unreachable or foreign cluster: Serve will report it itself
        log_once(
            f"placement: could not inspect the Ray cluster ({type(e).__name__}: {e})", logger, logging.WARNING
        )
        return None


def choose_accelerator(spec: DeploymentSpec, view: ClusterView | None) -> tuple[str, str]:
    """``(gpu | cpu, why)`` for a deployment's ``accelerator`` on ``view``."""
    if spec.accelerator != "auto":
        return spec.accelerator, f"accelerator: {spec.accelerator} was requested"
    if view is None:
        return "gpu", "accelerator auto: the cluster could not be inspected, so GPU bundles as on MI300X"
    if view.gpus() > 0:
        return "gpu", f"accelerator auto: {view.source} has {view.gpus():g} GPU(s)"
    types = view.addable_gpu_types()
    if types:
        t = types[0]
        return "gpu", (f"accelerator auto: {view.source} has no GPU now, but the launcher can add "
                       f"node type {t.name!r} with {t.resources['GPU']:g} GPU(s)")
    return "cpu", (f"accelerator auto: {view.source} has no GPU and no node type the launcher can add "
                   "has one, so the ranks run on CPU bundles (gloo)")


def resolve_accelerators(args: AppArgs, view: ClusterView | None) -> tuple[AppArgs, dict[str, str]]:
    """``args`` with every deployment's ``accelerator`` resolved to gpu/cpu, and the reasons."""
    specs, reasons = [], {}
    for spec in args.deployments:
        choice, why = choose_accelerator(spec, view)
        log_once(f"placement: deployment {spec.name!r} runs on {choice}: {why}", logger)
        specs.append(spec.model_copy(update={"accelerator": choice}))
        reasons[spec.name] = why
    return args.model_copy(update={"deployments": specs}), reasons


def replica_resources(spec: DeploymentSpec) -> Resources:
    """What one replica's placement group asks of its node, all bundles together."""
    need: Resources = {}
    for bundle in placement_bundles(spec):
        for k, v in bundle.items():
            need[k] = need.get(k, 0) + v
    return need


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _remedy(spec: DeploymentSpec, missing: Mapping[str, float], need: Mapping[str, float],
            view: ClusterView) -> str:
    fixes = []
    acc = [k for k in missing if k.startswith("accelerator_type:")]
    if acc:
        fixes.append(f"run on nodes that have {acc[0]} (the MI300X nodes of `ray up cluster.yaml`; "
                     f"`ray start ... --resources='{{\"{acc[0]}\": 1}}'` on hand-started nodes), or drop "
                     "accelerator_type")
    if "GPU" in missing or "CPU" in missing:
        flags = f"--num-cpus {math.ceil(need.get('CPU', 0) + 1)}"
        if uses_gpus(spec):
            flags += f" --num-gpus {math.ceil(need.get('GPU', 0))}"
        fixes.append(f"start a Ray instance that has them, e.g. `ray start --head {flags}` "
                     "(logical GPUs on a CPU machine) and run again, which joins it")
    if "GPU" in missing and not acc:
        fixes.append("or serve on CPU: accelerator=cpu (or accelerator=auto)")
    if "CPU" in missing:
        fixes.append("or lower replica_cpus / worker_cpus")
    where = " (none is running, so serve run would start one with this machine's resources)" \
        if view.fresh_local else ""
    return f"{view.source}{where} cannot provide it. To fix: " + "; ".join(fixes)


def check_placeable(args: AppArgs, view: ClusterView | None) -> None:
    """ValueError unless every deployment's replica fits a node and the minimums fit the cluster."""
    if view is None:
        return
    shapes = view.candidates()
    for spec in args.deployments:
        need = replica_resources(spec)
        if any(all(node.get(k, 0) >= v for k, v in need.items()) for node in shapes):
            continue
        best = {k: max((node.get(k, 0) for node in shapes), default=0) for k in need}
        missing = {k: v - best[k] for k, v in need.items() if best[k] < v}
        raise ValueError(
            f"deployment {spec.name!r} cannot be placed: one replica is a STRICT_PACK placement group "
            f"{placement_bundles(spec)}, i.e. one node with {_fmt(need)}; the best node offers "
            f"{_fmt(best)}, missing {_fmt(missing)}. {_remedy(spec, missing, need, view)}"
        )
    _check_minimums(args, view)


def _min_replicas(spec: DeploymentSpec) -> int:
    if spec.autoscaling is not None:
        a = spec.autoscaling
        return max(a.min_replicas, a.initial_replicas or 0)
    return spec.num_replicas or 1


def _check_minimums(args: AppArgs, view: ClusterView) -> None:
    total: Resources = {"CPU": args.ingress_cpus}
    terms: dict[str, list[str]] = {}
    for spec in args.deployments:
        n = _min_replicas(spec)
        for k, v in replica_resources(spec).items():
            total[k] = total.get(k, 0) + n * v
            terms.setdefault(k, []).append(f"{spec.name} {n} x {v:g}")
    have = view.totals()
    short = {k: v for k, v in total.items() if have.get(k, 0) + 1e-9 < v}
    if short:
        k = next(iter(short))
        raise ValueError(
            f"the app's minimum replicas need {k} {short[k]:g} (" + " + ".join(terms.get(k, [])) +
            (f" + ingress {args.ingress_cpus:g}" if k == "CPU" else "") +
            f"), but {view.source} has at most {have.get(k, 0):g}; lower min_replicas / num_replicas, "
            "or add nodes (cluster.yaml max_workers, or `ray start` more resources)"
        )


def place_app(args: AppArgs, view: ClusterView | None) -> tuple[AppArgs, dict[str, str]]:
    """Resolve ``accelerator`` on ``view`` and check the app can be placed (ValueError if not)."""
    args, reasons = resolve_accelerators(args, view)
    check_placeable(args, view)
    return args, reasons


def launcher_configs(specs: Sequence[DeploymentSpec]) -> list[str]:
    """The distinct ``autoscaling.cluster_config`` files of ``specs``."""
    files = {s.autoscaling.cluster_config for s in specs if s.autoscaling and s.autoscaling.cluster_config}
    return sorted(files)
