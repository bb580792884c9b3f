"""The controller (DESIGN §5.3): each deployment's tail plan and Serve options, and their record.

Two halves:

* :func:`decide` (pure, no Ray): for a table of deployment specs and a model config, the
  tail decision of each deployment — legality by the shardability rule of
  ``moe_runtime.plan`` first; a forced tail is kept when legal and refused (``ValueError``
  with the rule's reason) when not; ``auto`` becomes either a static plan (TP 1, a single
  legal candidate, or measurement turned off with ``auto_tune_tokens: []``) or
  "measured at warm-up" over the legal candidates — plus the Serve options: placement-group
  bundles and the autoscaling config (explicit ``target_ongoing_requests``, ``max_replicas``
  clamped to the TP groups the cluster's MI300X GPUs can host, ``cluster_spec.max_tp_groups``).
* Warm-up measurement (Ray): :func:`tune_group` has every rank of a fresh TP group time each
  legal tail at ``auto_tune_tokens`` (the workers run ``moe_runtime.tuning.measure_runners``,
  same arguments on every rank: the tails run collectives), builds the plan from rank 0's timings
  (``plan_from_timings``: fastest tail per token range) and sets it on every rank and every
  served layer (one layer's timings stand for all: the layers have the same shapes).

The clock of the measurement is injectable (``tune_clock: "module:callable"``, resolved on the
workers; default ``time.perf_counter``) so that tests are deterministic: while a tail is being
timed, ``moe_runtime.tuning.current_measurement()`` returns ``(tail, tokens)``, which a fake
clock may read.

Decisions are logged once, returned by the replicas' ``status()`` (``GET /v1/status``) and
exported as Ray metrics (``deployments.metrics``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_runtime.checkpoint import resolve_expert_formats
from moe_runtime.config import LatentMoEConfig
from moe_runtime.logs import log_once
from moe_runtime.planning.budget import Budget, cpu_budget, gpu_budget
from moe_runtime.planning.cost import STARTUP_FLOOR_S, bounded_token_counts, forward_cost_s
from moe_runtime.planning.cost import startup_timeout_s as derived_startup_timeout_s
from moe_runtime.planning.memory import MemoryPlan, plan_memory
from moe_runtime.tp.plan import Shardability, TailPlan, legal_tails, shardability_for
from moe_runtime.tp.tuning import plan_from_timings

from . import logger
from .spec import DeploymentSpec, resolve_deployment

if TYPE_CHECKING:
    from .cluster_spec import GroupDemand, Share

Timings = dict[str, dict[int, float]]
AUTO_MEASURED = "auto: measured at warm-up"
# Share of the startup bound the warm-up measurement may take by the planner's estimate (the
# estimate uses deliberately slow device figures; the measurement's own bound is the whole).
MEASURE_SHARE = 0.5



@dataclass(frozen=True)
class MeasureSettings:
    """How ``auto`` is measured at warm-up: token counts, repetitions, clock import path."""

    token_counts: tuple[int, ...]
    reps: int
    clock: str | None = None  # "module:callable"; None: time.perf_counter

    def __post_init__(self) -> None:
        if not self.token_counts or any(t < 1 for t in self.token_counts):
            raise ValueError(f"token_counts must be positive token counts, got {list(self.token_counts)}")
        if self.reps < 1:
            raise ValueError(f"reps must be >= 1, got {self.reps}")

    def to_dict(self) -> dict[str, Any]:
        return {"token_counts": list(self.token_counts), "reps": self.reps,
                "clock": self.clock or "time:perf_counter"}


@dataclass(frozen=True)
class TailDecision:
    """The controller's tail decision for one deployment.

    ``plan`` is what the replicas run: the static plan, or — once :func:`tune_group` has run —
    the measured one. ``measure`` is set when ``auto`` is to be (or was) measured.
    """

    requested: str
    tp_size: int
    sequence_parallel: bool
    preshard_up_proj: bool
    candidates: tuple[str, ...]  # legal tails, in order of preference
    shardability: Shardability
    plan: TailPlan
    measure: MeasureSettings | None = None
    measured: bool = False
    why_static: str | None = None  # auto without measurement: why
    bound: str | None = None  # token counts left out of the measurement: why

    @property
    def pending(self) -> bool:
        """``auto`` whose plan is still to be measured on the TP group."""
        return self.measure is not None and not self.measured

    @property
    def choice(self) -> str:
        return AUTO_MEASURED if self.pending else self.plan.describe()

    @property
    def reason(self) -> str:
        if self.pending:
            tokens = ", ".join(str(t) for t in self.measure.token_counts)
            return (
                f"{AUTO_MEASURED}: the fastest of the legal tails {list(self.candidates)} per token "
                f"range, timed at T = {tokens} on the TP {self.tp_size} group "
                f"(sharded tail: {self.shardability.reason})"
            )
        return self.plan.reason

    def with_measurement(self, plan: TailPlan) -> TailDecision:
        return replace(self, plan=plan, measured=True)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able record (status(), GET /v1/status, logs)."""
        return {
            "requested_tail": self.requested,
            "tp_size": self.tp_size,
            "sequence_parallel": self.sequence_parallel,
            "preshard_up_proj": self.preshard_up_proj,
            "candidates": list(self.candidates),
            "sharded_legal": self.shardability.shardable,
            "shardability": self.shardability.reason,
            "choice": self.choice,
            "reason": self.reason,
            "measured": self.measured,
            "measure": None if self.measure is None else self.measure.to_dict(),
            "measure_bound": self.bound,
            "plan": None if self.pending else self.plan.to_dict(),
            "timings_ms": {t: {str(k): round(v, 4) for k, v in per.items()}
                           for t, per in self.plan.timings_ms.items()},
        }


@dataclass(frozen=True)
class Decision:
    """Everything the controller decides for one deployment."""

    deployment: str
    role: str | None
    tail: TailDecision
    capacity: int | None  # TP groups of this size the cluster can host (None: unknown)
    options: dict[str, Any]  # keyword arguments of Deployment.options
    # Set when the app's shared capacity budget lowered max_replicas (cluster_spec.share_gpus).
    budget_reason: str | None = None
    # Where the ranks run (gpu | cpu) and why (deployments.placement); None: not resolved.
    accelerator: str | None = None
    accelerator_reason: str | None = None
    memory: MemoryPlan | None = None  # per-rank bytes vs budget (None: format unknown)
    memory_note: str = ""  # the budget's device and why; or why memory was not planned
    startup_timeout_s: float = STARTUP_FLOOR_S  # set, or derived from the planner's bytes

    @property
    def plan(self) -> TailPlan | str:
        """The plan, or ``AUTO_MEASURED`` while it is to be measured at warm-up."""
        return AUTO_MEASURED if self.tail.pending else self.tail.plan

    @property
    def reason(self) -> str:
        return self.tail.reason

    def to_dict(self) -> dict[str, Any]:
        options = self.options
        return {
            "deployment": self.deployment,
            "role": self.role,
            **self.tail.to_dict(),
            "cluster_capacity_tp_groups": self.capacity,
            "capacity_budget": self.budget_reason,
            "accelerator": self.accelerator,
            "accelerator_reason": self.accelerator_reason,
            "placement_group_bundles": options["placement_group_bundles"],
            "placement_group_strategy": options["placement_group_strategy"],
            "num_replicas": options.get("num_replicas"),
            "autoscaling_config": options.get("autoscaling_config"),
            "memory": None if self.memory is None else self.memory.to_dict(),
            "memory_note": self.memory_note,
            "startup_timeout_s": self.startup_timeout_s,
        }

    def describe(self) -> str:
        scale = options_scale(self.options)
        budget = f" ({self.budget_reason})" if self.budget_reason else ""
        return (
            f"deployment {self.deployment!r}: TP {self.tail.tp_size}, tail {self.tail.choice} "
            f"({self.reason}); {scale}{budget}"
        )


def options_scale(options: Mapping[str, Any]) -> str:
    auto = options.get("autoscaling_config")
    if auto is None:
        return f"{options.get('num_replicas', 1)} replica(s)"
    return (
        f"replicas {auto['min_replicas']}..{auto['max_replicas']}, "
        f"target_ongoing_requests {auto['target_ongoing_requests']}"
    )


# -- the pure half -----------------------------------------------------------------------------


def measure_settings(spec: DeploymentSpec) -> MeasureSettings | None:
    """The warm-up measurement of ``spec``'s tokens/reps/clock (None: measurement turned off)."""
    if not spec.auto_tune_tokens:
        return None
    return MeasureSettings(tuple(spec.auto_tune_tokens), spec.auto_tune_reps, spec.tune_clock)


def tail_decision(
    spec: DeploymentSpec,
    cfg: LatentMoEConfig,
    cost_s: Callable[[int], float] | None = None,
    budget_s: float | None = None,
) -> TailDecision:
    """Legality first (ValueError when a forced tail is illegal), then auto: static or measured.

    ``cost_s``: estimated seconds of one forward at T tokens (the planner's, see
    ``moe_runtime.memory.forward_cost_s``); with it, only the token counts whose estimated
    measurement fits ``budget_s`` are measured, and auto stays static when fewer than two do.
    """
    P = spec.tp_size
    static = resolve_deployment(spec, "<config>", cfg).plan  # raises with the deployment's name
    candidates = legal_tails(cfg, P, spec.preshard_up_proj, spec.sequence_parallel)
    rule = shardability_for(cfg, P, spec.preshard_up_proj, spec.sequence_parallel)
    base = TailDecision(spec.tail, P, spec.sequence_parallel, spec.preshard_up_proj, candidates, rule, static)
    if spec.tail != "auto":
        return base
    settings = measure_settings(spec)
    why = None
    if P == 1:
        why = "TP 1: no collectives, so the tails do not differ"
    elif len(candidates) == 1:
        why = f"{candidates[0]} is the only legal tail"
    elif settings is None:
        why = "measurement is off (auto_tune_tokens is empty)"
    bound = None
    if why is None and cost_s is not None and budget_s is not None:
        calls = (settings.reps + 1) * len(candidates)  # time_tails: a warm-up call + reps per tail
        kept, estimate = bounded_token_counts(settings.token_counts, cost_s, calls, budget_s)
        left = [T for T in settings.token_counts if T not in kept]
        if left:
            full = sum(calls * cost_s(T) for T in settings.token_counts)
            bound = (
                f"measuring T = {list(settings.token_counts)} ({calls} forwards each) is estimated at "
                f"{full:.0f} s, over the {budget_s:.0f} s allowed ({MEASURE_SHARE:g} x startup bound)"
            )
            if len(kept) < 2:
                why = f"{bound}; fewer than two token counts fit, so the static rule applies"
            else:
                bound += f"; measured at T = {kept} only (estimated {estimate:.0f} s)"
                settings = replace(settings, token_counts=tuple(kept))
    if why is not None:
        return replace(base, why_static=why, plan=replace(static, reason=f"{static.reason} ({why})"))
    return replace(base, measure=settings, bound=bound)


def build_accelerator(spec: DeploymentSpec) -> tuple[str, str]:
    """Where the ranks will compute, as known at build time: ``("gpu" | "cpu", why)``.

    GPU when the spec pins an ``accelerator_type``, when this (building) process sees a GPU,
    or when the Ray cluster it is attached to reports an accelerator type (real GPUs do;
    logical ``--num-gpus`` on a CPU machine do not). Otherwise CPU: the ranks hold "GPUs" that
    are logical and compute on the node's CPUs (deployments.workers.pick_device).
    """
    if spec.accelerator == "cpu":
        return "cpu", "accelerator: cpu"
    if spec.accelerator_type:
        return "gpu", f"workers are pinned to accelerator_type {spec.accelerator_type}"
    import torch

    if torch.cuda.is_available():
        return "gpu", "the building process sees a GPU"
    import ray

    if ray.is_initialized() and any(k.startswith("accelerator_type:") for k in ray.cluster_resources()):
        return "gpu", "the Ray cluster reports an accelerator type"
    return "cpu", "no accelerator_type pinned and no GPU visible here or in the Ray cluster"


def memory_budget(spec: DeploymentSpec, accelerator: str, node_bytes: int | None = None) -> Budget:
    """Per-rank bytes a deployment may use on ``accelerator`` ("gpu" | "cpu")."""
    if accelerator == "gpu":
        return gpu_budget(spec.device_memory_gb, spec.memory_fraction)
    if accelerator == "cpu":
        return cpu_budget(spec.tp_size, spec.memory_fraction, node_bytes)
    raise ValueError(f"accelerator must be 'gpu' or 'cpu', got {accelerator!r}")


def memory_decision(
    spec: DeploymentSpec,
    cfg: LatentMoEConfig,
    checkpoint: str | Path | None,
    accelerator: tuple[str, str],
) -> tuple[MemoryPlan | None, str]:
    """The per-rank memory plan of ``spec`` against its budget (ValueError with the arithmetic
    when it does not fit), or None with the reason it cannot be planned."""
    layers = spec.layers or cfg.moe_layers
    fmt = None if spec.experts_format == "auto" else spec.experts_format
    kind, why = accelerator
    try:
        for layer in layers:
            cfg.check_moe_layer(layer)
        formats = resolve_expert_formats(cfg, layers, checkpoint, fmt)
        if formats is None:
            return None, (
                "memory not checked: the checkpoint holds no weights and experts_format is auto "
                "(state experts_format: mxfp4 or dense to check it)"
            )
        plan = plan_memory(
            cfg, formats, spec.dtype, spec.tp_size, spec.preshard_up_proj, spec.max_forward_tokens,
            budget=memory_budget(spec, kind),
        )
    except ValueError as e:
        raise ValueError(f"deployment {spec.name!r}: {e}") from None
    plan.check(f"deployment {spec.name!r}")
    return plan, f"{kind} budget ({why})"


def cluster_tp_groups(cluster: Mapping[str, Any] | str | Path | None, tp_size: int) -> int | None:
    """TP groups of ``tp_size`` a cluster-launcher config (dict or YAML path) can host."""
    if cluster is None:
        return None
    from .cluster_spec import load_cluster_config, max_tp_groups

    config = load_cluster_config(cluster) if isinstance(cluster, str | Path) else dict(cluster)
    return max_tp_groups(config, tp_size)


def _demand(spec: DeploymentSpec) -> GroupDemand:
    from .cluster_spec import GroupDemand

    if spec.autoscaling is None:
        n = spec.num_replicas or 1
        return GroupDemand(spec.name, spec.tp_size, n, n)
    a = spec.autoscaling
    return GroupDemand(spec.name, spec.tp_size, a.min_replicas, a.max_replicas)


def shared_budget(
    specs: Sequence[DeploymentSpec], cluster: Mapping[str, Any] | str | Path | None
) -> dict[str, Share]:
    """The shared capacity budget of the deployments that count against a cluster config:
    ``cluster`` for all of them, else each one's ``autoscaling.cluster_config`` (deployments
    naming the same file share it). Deployments without a cluster are not budgeted."""
    from .cluster_spec import load_cluster_config, share_gpus

    groups: dict[str, tuple[dict[str, Any], list[DeploymentSpec]]] = {}
    for spec in specs:
        source = cluster
        if source is None and spec.autoscaling is not None:
            source = spec.autoscaling.cluster_config
        if source is None:
            continue
        key = "<given>" if cluster is not None else str(source)
        if key not in groups:
            config = load_cluster_config(source) if isinstance(source, str | Path) else dict(source)
            groups[key] = (config, [])
        groups[key][1].append(spec)
    shares: dict[str, Share] = {}
    for config, members in groups.values():
        shares.update(share_gpus([_demand(s) for s in members], config))
    return shares


def decide(
    deployments: Sequence[DeploymentSpec | Mapping[str, Any]],
    model: LatentMoEConfig | Mapping[str, Any],
    cluster: Mapping[str, Any] | str | Path | None = None,
    checkpoint: str | Path | None = None,
) -> dict[str, Decision]:
    """The controller's decision for every deployment of a table, by name (pure, no Ray).

    ``model``: the checkpoint's config (``LatentMoEConfig`` or a ``config.json`` dict).
    ``cluster``: a cluster-launcher config (dict, or a YAML path, validated) whose MI300X
    capacity caps ``max_replicas``; None uses each spec's ``autoscaling.cluster_config`` file,
    if any. The deployments counted against one cluster share its GPUs: minimums that do not
    fit together are refused, maximums that do not are clamped with the reason
    (:func:`shared_budget`). A fixed ``num_replicas`` above the capacity is an error, as is a
    forced tail that the shardability rule (or a pre-sharded Wup) makes illegal, and a
    deployment whose layers do not fit its per-rank memory budget (``memory_decision``; the
    experts format comes from ``checkpoint``'s tensor names, or the spec's ``experts_format``).
    The startup bound is derived from the planner's bytes unless the spec sets it.
    """
    from .options import deployment_options

    cfg = model if isinstance(model, LatentMoEConfig) else LatentMoEConfig.from_dict(dict(model))
    specs: list[DeploymentSpec] = []
    tails: dict[str, TailDecision] = {}
    capacities: dict[str, int | None] = {}
    memories: dict[str, tuple[MemoryPlan | None, str, float]] = {}
    for raw in deployments:
        spec = raw if isinstance(raw, DeploymentSpec) else DeploymentSpec.model_validate(dict(raw))
        if spec.name in tails:
            raise ValueError(f"deployment names must be unique, {spec.name!r} repeats")
        accelerator = build_accelerator(spec)
        plan, note = memory_decision(spec, cfg, checkpoint, accelerator)
        startup = spec.startup_timeout_s or derived_startup_timeout_s(plan)
        cost = None if plan is None else partial(forward_cost_s, plan, cfg, device=accelerator[0])
        tails[spec.name] = tail_decision(spec, cfg, cost, MEASURE_SHARE * startup)
        memories[spec.name] = (plan, note, startup)
        file = spec.autoscaling.cluster_config if spec.autoscaling is not None else None
        try:  # once per decision: the options below reuse it
            capacity = cluster_tp_groups(cluster if cluster is not None else file, spec.tp_size)
        except ValueError as e:
            raise ValueError(f"deployment {spec.name!r}: {e}") from None
        if capacity is not None and spec.autoscaling is None and (spec.num_replicas or 1) > capacity:
            raise ValueError(
                f"deployment {spec.name!r}: num_replicas {spec.num_replicas or 1} > {capacity} TP groups "
                f"of {spec.tp_size} GPUs the cluster can host"
            )
        if capacity is not None and spec.autoscaling is not None and spec.autoscaling.min_replicas > capacity:
            raise ValueError(
                f"deployment {spec.name!r}: min_replicas {spec.autoscaling.min_replicas} > {capacity} TP "
                f"groups of {spec.tp_size} GPUs the cluster can host"
            )
        specs.append(spec)
        capacities[spec.name] = capacity
    shares = shared_budget(specs, cluster)
    decisions: dict[str, Decision] = {}
    for spec in specs:
        share = shares.get(spec.name)
        try:
            options = deployment_options(spec, share.max_replicas if share else capacities[spec.name])
        except ValueError as e:
            raise ValueError(f"deployment {spec.name!r}: {e}") from None
        plan, note, startup = memories[spec.name]
        decision = Decision(spec.name, spec.role, tails[spec.name], capacities[spec.name], options,
                            budget_reason=share.reason if share else None,
                            accelerator=None if spec.accelerator == "auto" else spec.accelerator,
                            memory=plan, memory_note=note, startup_timeout_s=startup)
        log_once(f"controller: {decision.describe()}", logger)
        if plan is not None:
            log_once(f"controller: deployment {spec.name!r} memory: {plan.arithmetic()} ({note})", logger)
        else:
            log_once(f"controller: deployment {spec.name!r}: {note}", logger)
        decisions[spec.name] = decision
    return decisions


# -- the measurement (Ray) -----------------------------------------------------------------------


def measured_plan(decision: TailDecision, timings: Timings) -> TailPlan:
    """The per-range plan of rank 0's ``timings``, restricted to the decision's candidates."""
    unknown = sorted(set(timings) - set(decision.candidates))
    if unknown:
        raise ValueError(
            f"timings for tails {unknown} that are not legal candidates {list(decision.candidates)}"
        )
    return plan_from_timings(
        timings, reason=f"auto: measured at warm-up on the TP {decision.tp_size} group over {list(timings)}"
    )


def tune_group(workers: Sequence[Any], decision: TailDecision, name: str, timeout_s: float) -> TailDecision:
    """Replica side: measure a pending ``auto`` decision on the group's workers and apply it.

    ``workers``: the rank-ordered ``TPWorker`` actor handles (methods ``measure_tails`` and
    ``set_plan``). Returns the decision unchanged when nothing is to be measured.
    """
    if not decision.pending:
        return decision
    import ray

    refs = [w.measure_tails.remote(decision.measure, list(decision.candidates)) for w in workers]
    timings = ray.get(refs, timeout=timeout_s)[0]  # rank 0's: every rank must adopt one plan
    plan = measured_plan(decision, timings)
    ray.get([w.set_plan.remote(plan) for w in workers], timeout=timeout_s)
    measured = decision.with_measurement(plan)
    log_once(f"controller: deployment {name!r}: tail {plan.describe()} ({plan.reason})", logger)
    return measured


# -- observation ---------------------------------------------------------------------------------


def tp_group_placement(deployment: str | None = None, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """Where every live TP group's ranks run, from the named worker actors (needs ``ray.init``).

    Returns ``{replica_id: {"deployment": name, "nodes": [node id of rank 0, rank 1, ...]}}``;
    a rank that does not answer (its node is gone) shows as None.
    """
    import ray

    from .workers import WORKER_NAMESPACE

    ranks: dict[str, dict[int, str]] = {}
    owners: dict[str, str] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != WORKER_NAMESPACE:
            continue
        name, _, rank = entry["name"].rpartition(":rank")
        dep, _, replica = name.partition(":")
        if not rank.isdigit() or (deployment is not None and dep != deployment):
            continue
        owners[replica] = dep
        ranks.setdefault(replica, {})[int(rank)] = entry["name"]

    def node_of(actor_name: str):
        with contextlib.suppress(Exception):  # gone between the listing and the lookup
            handle = ray.get_actor(actor_name, namespace=WORKER_NAMESPACE)
            return handle.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id())
        return None

    refs = {(rep, r): node_of(n) for rep, by_rank in ranks.items() for r, n in by_rank.items()}
    live = [ref for ref in refs.values() if ref is not None]
    ready, _ = ray.wait(live, num_returns=len(live), timeout=timeout_s) if live else ([], [])
    ready_set = set(ready)
    placement: dict[str, dict[str, Any]] = {}
    for replica, by_rank in sorted(ranks.items()):
        nodes = []
        for r in range(max(by_rank) + 1):
            ref = refs.get((replica, r))
            node = None
            if ref is not None and ref in ready_set:
                with contextlib.suppress(Exception):
                    node = ray.get(ref)
            nodes.append(node)
        placement[replica] = {"deployment": owners[replica], "nodes": nodes}
    return placement
