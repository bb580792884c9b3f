"""Capacity: one rule for what the app's TP groups need and how many of them the cluster holds.

Pure (no Ray). Everything here is computed once per app at build time (``decide``):

* :func:`min_replicas` — the one minimum-replica rule: the replicas Serve starts and keeps,
  ``max(min_replicas, initial_replicas)`` with autoscaling, else ``num_replicas`` (default 1).
* :func:`replica_resources` — what one TP group (one replica's placement group) asks of its node.
* :func:`check_placeable` — on a live cluster view: each replica fits some node (now or
  addable), and the app's minimums (plus the ingress CPUs) fit the cluster's totals.
* :func:`app_capacity` — against cluster-launcher configs: the TP groups of each size the
  MI300X nodes can host, a deployment's minimum within them, and the shared budget of the
  deployments counting against one config (:func:`share_gpus`): minimums that do not fit
  together are refused, maximums clamped with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config.spec import AppArgs, DeploymentSpec
from .accelerator import Accelerator
from .cluster_view import ClusterView, Resources
from .launcher import max_tp_groups, mi300x_gpus
from .serve_options import placement_bundles


def min_replicas(spec: DeploymentSpec) -> int:
    """The replicas a deployment runs at least (the one rule every capacity check uses)."""
    if spec.autoscaling is not None:
        a = spec.autoscaling
        return max(a.min_replicas, a.initial_replicas or 0)
    return spec.num_replicas or 1


def max_replicas(spec: DeploymentSpec) -> int:
    return spec.autoscaling.max_replicas if spec.autoscaling is not None else spec.num_replicas or 1


@dataclass(frozen=True)
class GroupDemand:
    """One deployment's claim on the cluster: TP groups of ``tp_size`` GPUs, min..max of them."""

    name: str
    tp_size: int
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True)
class Share:
    """A deployment's part of the shared budget: its maximum replicas, and why when clamped."""

    max_replicas: int
    reason: str | None = None


def share_gpus(demands: Sequence[GroupDemand], config: dict[str, Any]) -> dict[str, Share]:
    """The shared capacity budget of an app's deployments on one cluster (DESIGN §5.5).

    Deployments share nodes, so their TP groups together must fit the cluster's MI300X GPUs:
    the minimums (sum of min_replicas x tp_size) must fit, or ValueError with the arithmetic;
    when the maximums do not, each deployment keeps its minimum and the GPUs left are shared in
    proportion to what each may add (whole TP groups, leftovers in table order), and the
    clamped ones get the reason. Each is also capped by the groups of its size the nodes can
    host (a group never spans nodes).
    """
    total, spelled = mi300x_gpus(config)
    caps = {d.name: max_tp_groups(config, d.tp_size) for d in demands}
    wanted = {d.name: min(d.max_replicas, caps[d.name]) for d in demands}
    floor_gpus = sum(d.min_replicas * d.tp_size for d in demands)
    terms = " + ".join(f"{d.name} {d.min_replicas} x {d.tp_size}" for d in demands)
    if floor_gpus > total:
        raise ValueError(
            f"the app's minimum TP groups need {floor_gpus} GPUs ({terms}), but the cluster's MI300X "
            f"nodes offer at most {total} ({spelled}, nodes the launcher may add included); lower "
            "min_replicas / num_replicas or raise the launcher's max_workers"
        )
    ceiling = sum(wanted[d.name] * d.tp_size for d in demands)
    shares = {d.name: Share(wanted[d.name], None if wanted[d.name] == d.max_replicas else
                            f"max_replicas {d.max_replicas} -> {wanted[d.name]}: the nodes host at most "
                            f"{caps[d.name]} TP groups of {d.tp_size}") for d in demands}
    if ceiling <= total:
        return shares
    spare = total - floor_gpus
    extra = {d.name: (wanted[d.name] - d.min_replicas) * d.tp_size for d in demands}
    want_extra = sum(extra.values())
    grant = {d.name: int(spare * extra[d.name] / want_extra) // d.tp_size for d in demands}
    left = spare - sum(grant[d.name] * d.tp_size for d in demands)
    added = True
    while added:  # leftovers: one more group at a time where it still fits, in table order
        added = False
        for d in demands:
            if d.min_replicas + grant[d.name] < wanted[d.name] and d.tp_size <= left:
                grant[d.name] += 1
                left -= d.tp_size
                added = True
    asked = " + ".join(f"{d.name} {wanted[d.name]} x {d.tp_size}" for d in demands)
    for d in demands:
        limit = d.min_replicas + grant[d.name]
        if limit < d.max_replicas:
            shares[d.name] = Share(max(limit, 1), (
                f"max_replicas {d.max_replicas} -> {max(limit, 1)}: the app's deployments share the "
                f"cluster's {total} MI300X GPUs ({spelled}); together their maximums ask {ceiling} "
                f"({asked}), their minimums take {floor_gpus}, and the {spare} GPUs left are shared in "
                "proportion to what each deployment may add"
            ))
    return shares


def replica_resources(spec: DeploymentSpec, layout: str) -> Resources:
    """What one replica's placement group asks of its node, all bundles together."""
    need: Resources = {}
    for bundle in placement_bundles(spec, layout):
        for k, v in bundle.items():
            need[k] = need.get(k, 0) + v
    return need


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _remedy(layout: str, missing: Mapping[str, float], need: Mapping[str, float], view: ClusterView) -> str:
    fixes = []
    acc = [k for k in missing if k.startswith("accelerator_type:")]
    if acc:
        fixes.append(f"run on nodes that have {acc[0]} (the MI300X nodes of `ray up cluster.yaml`; "
                     f"`ray start ... --resources='{{\"{acc[0]}\": 1}}'` on hand-started nodes), or drop "
                     "accelerator_type")
    if "GPU" in missing or "CPU" in missing:
        flags = f"--num-cpus {math.ceil(need.get('CPU', 0) + 1)}"
        if layout == "gpu":
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


def check_placeable(args: AppArgs, view: ClusterView | None, accelerators: Mapping[str, Accelerator]) -> None:
    """ValueError unless every deployment's replica fits a node and the minimums fit the cluster."""
    if view is None:
        return
    shapes = view.candidates()
    for spec in args.deployments:
        layout = accelerators[spec.name].layout
        need = replica_resources(spec, layout)
        if any(all(node.get(k, 0) >= v for k, v in need.items()) for node in shapes):
            continue
        best = {k: max((node.get(k, 0) for node in shapes), default=0) for k in need}
        missing = {k: v - best[k] for k, v in need.items() if best[k] < v}
        raise ValueError(
            f"deployment {spec.name!r} cannot be placed: one replica is a STRICT_PACK placement group "
            f"{placement_bundles(spec, layout)}, i.e. one node with {_fmt(need)}; the best node offers "
            f"{_fmt(best)}, missing {_fmt(missing)}. {_remedy(layout, missing, need, view)}"
        )
    _check_minimums(args, view, accelerators)


def _check_minimums(args: AppArgs, view: ClusterView, accelerators: Mapping[str, Accelerator]) -> None:
    total: Resources = {"CPU": args.ingress_cpus}
    terms: dict[str, list[str]] = {}
    for spec in args.deployments:
        n = min_replicas(spec)
        for k, v in replica_resources(spec, accelerators[spec.name].layout).items():
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


@dataclass(frozen=True)
class Capacity:
    """A deployment's place in its cluster config: the TP groups of its size the nodes host
    (``tp_groups``), its maximum replicas after the app's shared budget, and why it was lowered."""

    tp_groups: int | None = None  # None: no cluster config counts this deployment
    max_replicas: int | None = None  # None: the spec's own bound
    reason: str | None = None


def app_capacity(
    specs: Sequence[DeploymentSpec], configs: Mapping[str, Mapping[str, Any] | None]
) -> dict[str, Capacity]:
    """Each deployment's :class:`Capacity` against the cluster config it counts against
    (``configs[name]``: a parsed launcher config, or None). ValueError with the arithmetic when a
    deployment's minimum exceeds what its config hosts, or the minimums sharing one config do."""
    groups: dict[int, tuple[Mapping[str, Any], list[DeploymentSpec]]] = {}
    capacity: dict[str, Capacity] = {}
    for spec in specs:
        config = configs.get(spec.name)
        if config is None:
            capacity[spec.name] = Capacity()
            continue
        try:
            groups_of_size = max_tp_groups(dict(config), spec.tp_size)
        except ValueError as e:
            raise ValueError(f"deployment {spec.name!r}: {e}") from None
        least = min_replicas(spec)
        if least > groups_of_size:
            what = "num_replicas" if spec.autoscaling is None else "min_replicas"
            raise ValueError(
                f"deployment {spec.name!r}: {what} {least} > {groups_of_size} TP groups of "
                f"{spec.tp_size} GPUs the cluster can host"
            )
        capacity[spec.name] = Capacity(groups_of_size)
        groups.setdefault(id(config), (config, []))[1].append(spec)
    for config, members in groups.values():
        demands = [GroupDemand(s.name, s.tp_size, min_replicas(s), max_replicas(s)) for s in members]
        for name, share in share_gpus(demands, dict(config)).items():
            capacity[name] = Capacity(capacity[name].tp_groups, share.max_replicas, share.reason)
    return capacity
