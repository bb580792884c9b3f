"""The controller (DESIGN §5.3): every deployment's decisions, made once at build time. Pure: no Ray.

:func:`decide` takes the deployment specs, the model config, the cluster view and the
launcher configs, and decides per deployment, each concept in one place:

* the spec checked against the model (``config.resolve``): layers, TP size, the static tail;
* where the ranks run (``control.accelerator``): bundles and compute device;
* memory: the planner's bytes per rank against the budget of that compute device
  (``moe_runtime.planning``), refused with the arithmetic when it does not fit;
* the tail: legality by the shardability rule first (a forced illegal tail is refused), then
  ``auto`` either static (TP 1, a single legal candidate, measurement off, or too little time)
  or "measured at warm-up" on the replica's group (``deployments.serve.tuning.tune_group``);
  a standard (Qwen3-MoE, DeepSeek-V3) layer has no tails: one fixed plan, never measured;
* capacity (``control.capacity``): the app's shared budget of cluster GPUs;
* the Serve options (``control.serve_options``): bundles, autoscaling, batching knobs.

Decisions are logged once, returned by the replicas' ``status()`` (``GET /v1/status``) and
exported as Ray metrics (``deployments.serve.metrics``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from moe_runtime.families import LayerConfig, config_from_raw, is_standard
from moe_runtime.logs import log_once
from moe_runtime.planning.budget import Budget, cpu_budget, gpu_budget
from moe_runtime.planning.cost import STARTUP_FLOOR_S, bounded_token_counts, forward_cost_s
from moe_runtime.planning.cost import startup_timeout_s as derived_startup_timeout_s
from moe_runtime.planning.memory import MemoryPlan, plan_memory
from moe_runtime.tp.plan import (
    Shardability,
    TailPlan,
    Timings,
    legal_tails,
    plan_from_timings,
    shardability_for,
)
from moe_runtime.units import format_layers

from .. import logger
from ..config.resolve import ResolvedDeployment, resolve_deployment
from ..config.spec import DeploymentSpec
from .accelerator import Accelerator, decide_accelerator
from .capacity import Capacity, app_capacity
from .cluster_view import ClusterView
from .launcher import load_cluster_config
from .serve_options import deployment_options

CONFIG_ONLY = "<config>"  # the checkpoint of a decision made from a config alone

AUTO_MEASURED = "auto: measured at warm-up"
# Where a replica's tail plan came from (status(): controller.plan_source).
STATIC, MEASURED, REUSED = "static", "measured", "reused"


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
    estimate_s: float | None = None  # the planner's estimate of the whole measurement
    plan_source: str = STATIC  # static | measured (on this replica) | reused (a stored measurement)
    measured_at: float | None = None  # unix time of the measurement behind the plan

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

    def with_measurement(self, plan: TailPlan, source: str, at: float) -> TailDecision:
        """The decision once warm-up ran: ``plan`` measured here, or ``reused`` from the store."""
        return replace(self, plan=plan, measured=True, plan_source=source, measured_at=at)

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
            "measure_estimate_s": None if self.estimate_s is None else round(self.estimate_s, 1),
            "plan_source": self.plan_source,
            "measured_at": self.measured_at,
            "plan": None if self.pending else self.plan.to_dict(),
            "timings_ms": {t: {str(k): round(v, 4) for k, v in per.items()}
                           for t, per in self.plan.timings_ms.items()},
        }


@dataclass(frozen=True)
class Decision:
    """Everything the controller decides for one deployment, carried to its replicas."""

    resolved: ResolvedDeployment  # the spec checked against the model (its startup bound set)
    tail: TailDecision
    accelerator: Accelerator
    capacity: Capacity
    options: dict[str, Any]  # keyword arguments of Deployment.options
    memory: MemoryPlan | None = None  # per-rank bytes vs budget (None: format unknown)
    memory_note: str = ""  # the budget's device and why; or why memory was not planned
    startup_timeout_s: float = STARTUP_FLOOR_S  # set, or derived from the planner's bytes

    @property
    def deployment(self) -> str:
        return self.resolved.spec.name

    @property
    def spec(self) -> DeploymentSpec:
        return self.resolved.spec

    @property
    def plan(self) -> TailPlan | str:
        """The plan, or ``AUTO_MEASURED`` while it is to be measured at warm-up."""
        return AUTO_MEASURED if self.tail.pending else self.tail.plan

    @property
    def reason(self) -> str:
        return self.tail.reason

    def with_tail(self, tail: TailDecision) -> Decision:
        """This decision with the replica's (measured) tail decision."""
        return replace(self, tail=tail)

    def to_dict(self) -> dict[str, Any]:
        options = self.options
        return {
            "deployment": self.deployment,
            "role": self.spec.role,
            "layer_family": self.resolved.family,
            **self.tail.to_dict(),
            "cluster_capacity_tp_groups": self.capacity.tp_groups,
            "capacity_share": self.capacity.reason,
            "accelerator": self.accelerator.layout,
            "compute": self.accelerator.compute,
            "accelerator_reason": self.accelerator.reason,
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
        share = f" ({self.capacity.reason})" if self.capacity.reason else ""
        return (
            f"deployment {self.deployment!r}: TP {self.tail.tp_size}, layers "
            f"{format_layers(self.resolved.layers)}, tail {self.tail.choice} ({self.reason}); {scale}{share}"
        )


def options_scale(options: Mapping[str, Any]) -> str:
    auto = options.get("autoscaling_config")
    if auto is None:
        return f"{options.get('num_replicas', 1)} replica(s)"
    return (
        f"replicas {auto['min_replicas']}..{auto['max_replicas']}, "
        f"target_ongoing_requests {auto['target_ongoing_requests']}"
    )


def measure_settings(spec: DeploymentSpec) -> MeasureSettings | None:
    """The warm-up measurement of ``spec``'s tokens/reps/clock (None: measurement turned off)."""
    if not spec.auto_tune_tokens:
        return None
    return MeasureSettings(tuple(spec.auto_tune_tokens), spec.auto_tune_reps, spec.tune_clock)


def tail_decision(
    resolved: ResolvedDeployment,
    cfg: LayerConfig,
    cost_s: Callable[[int], float] | None = None,
    limit_s: float | None = None,
) -> TailDecision:
    """Legality first (the static plan of ``resolved``: a forced illegal tail was refused when it
    was resolved), then auto: static or measured.

    ``cost_s``: estimated seconds of one forward at T tokens (``moe_runtime.planning.cost``);
    with it, only the ascending token counts whose estimated measurement fits ``limit_s`` (the
    spec's ``warmup_limit_s``) are measured, the rule-based tail serving above them; auto stays
    static when not even the smallest fits.
    """
    spec, static = resolved.spec, resolved.plan
    P = spec.tp_size
    if is_standard(cfg):  # its one plan (resolve_deployment refused any latent-only option)
        rule = Shardability(False, (f"a {cfg.family} layer has no latent up-projection to shard: no "
                                    "latent tail applies",))
        return TailDecision(spec.tail, P, False, False, static.tails, rule, static, why_static=static.reason)
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
    bound, estimate = None, None
    if why is None and cost_s is not None and limit_s is not None:
        calls = (settings.reps + 1) * len(candidates)  # time_tails: a warm-up call + reps per tail
        kept, estimate = bounded_token_counts(settings.token_counts, cost_s, calls, limit_s)
        left = [T for T in settings.token_counts if T not in kept]
        if left:
            full = sum(calls * cost_s(T) for T in settings.token_counts)
            bound = (
                f"measuring T = {list(settings.token_counts)} ({calls} forwards each) is estimated at "
                f"{full:.0f} s, over the warm-up limit of {limit_s:.0f} s (warmup_limit_s)"
            )
            if not kept:
                why = f"{bound}; not even T = {settings.token_counts[0]} fits, so the static rule applies"
            else:
                bound += (f"; measured at T = {kept} only (estimated {estimate:.0f} s), the static rule's "
                          f"{static.tails[-1]} above T = {kept[-1]}")
                settings = replace(settings, token_counts=tuple(kept))
    if why is not None:
        return replace(base, why_static=why, plan=replace(static, reason=f"{static.reason} ({why})"))
    return replace(base, measure=settings, bound=bound, estimate_s=estimate)


def memory_budget(spec: DeploymentSpec, compute: str, node_bytes: int | None = None) -> Budget:
    """Per-rank bytes a deployment may use where its ranks compute ("gpu" | "cpu")."""
    if compute == "gpu":
        return gpu_budget(spec.device_memory_gb, spec.memory_fraction)
    if compute == "cpu":
        return cpu_budget(spec.tp_size, spec.memory_fraction, node_bytes)
    raise ValueError(f"compute must be 'gpu' or 'cpu', got {compute!r}")


def memory_decision(
    resolved: ResolvedDeployment, cfg: LayerConfig, accelerator: Accelerator
) -> tuple[MemoryPlan | None, str]:
    """The per-rank memory plan of a deployment against its budget (ValueError with the arithmetic
    when it does not fit), or None with the reason it cannot be planned."""
    if is_standard(cfg):
        return None, (f"memory not checked: the planner sizes latent-MoE layers; this is a {cfg.family} "
                      "model (each rank loads its slices of the served layers, status() reports the bytes "
                      "held)")
    # The checkpoint reader loads torch: imported where the plan is made, never by a group
    # replica, which imports this module for its decision's records (serve.deployment).
    from moe_runtime.checkpoint import resolve_expert_formats

    spec = resolved.spec
    fmt = None if spec.experts_format == "auto" else spec.experts_format
    try:
        checkpoint = None if resolved.checkpoint == CONFIG_ONLY else resolved.checkpoint
        formats = resolve_expert_formats(cfg, resolved.layers, checkpoint, fmt)
        if formats is None:
            return None, (
                "memory not checked: the checkpoint holds no weights and experts_format is auto "
                "(state experts_format: mxfp4 or dense to check it)"
            )
        plan = plan_memory(
            cfg, formats, spec.dtype, spec.tp_size, spec.preshard_up_proj, spec.max_forward_tokens,
            budget=memory_budget(spec, accelerator.compute), backend=spec.backend,
            compute=accelerator.compute,  # the backend's own copies, where the ranks compute
        )
    except ValueError as e:
        raise ValueError(f"deployment {spec.name!r}: {e}") from None
    plan.check(f"deployment {spec.name!r}")
    return plan, f"{accelerator.compute} budget ({accelerator.reason})"


def launcher_config_of(
    spec: DeploymentSpec, cluster: Mapping[str, Any] | str | Path | None, loaded: dict[str, dict[str, Any]]
) -> Mapping[str, Any] | None:
    """The cluster-launcher config ``spec`` counts against: ``cluster`` for every deployment, else
    its ``autoscaling.cluster_config`` file (each file read once: deployments naming the same file
    share it)."""
    source = cluster
    if source is None and spec.autoscaling is not None:
        source = spec.autoscaling.cluster_config
    if source is None or isinstance(source, Mapping):
        return source
    key = str(source)
    if key not in loaded:
        try:
            loaded[key] = load_cluster_config(source)
        except ValueError as e:
            raise ValueError(f"deployment {spec.name!r}: {e}") from None
    return loaded[key]


def decide(
    deployments: Sequence[DeploymentSpec | Mapping[str, Any]],
    model: LayerConfig | Mapping[str, Any],
    cluster: Mapping[str, Any] | str | Path | None = None,
    checkpoint: str | Path | None = None,
    view: ClusterView | None = None,
) -> dict[str, Decision]:
    """The controller's decision for every deployment of a table, by name (pure, no Ray).

    ``model``: the checkpoint's config (``LatentMoEConfig``, a standard layer's config, or a
    ``config.json`` dict of either: ``moe_runtime.families``);
    ``checkpoint``: its folder (the experts format is read from its tensor names; None or a
    config-only folder: the spec's ``experts_format``). ``cluster``: a cluster-launcher config
    (dict, or a YAML path, validated) that every deployment counts against; None: each spec's
    ``autoscaling.cluster_config``, if any. ``view``: the cluster the app is placed on (None: the
    MI300X layout is assumed). Errors are ``ValueError`` naming the deployment, with the numbers.
    """
    cfg = config_from_raw(dict(model)) if isinstance(model, Mapping) else model
    where = str(checkpoint) if checkpoint is not None else CONFIG_ONLY
    specs: list[DeploymentSpec] = []
    for raw in deployments:
        spec = raw if isinstance(raw, DeploymentSpec) else DeploymentSpec.model_validate(dict(raw))
        if any(s.name == spec.name for s in specs):
            raise ValueError(f"deployment names must be unique, {spec.name!r} repeats")
        specs.append(spec)
    loaded: dict[str, dict[str, Any]] = {}
    capacity = app_capacity(specs, {s.name: launcher_config_of(s, cluster, loaded) for s in specs})
    decisions: dict[str, Decision] = {}
    for spec in specs:
        resolved = resolve_deployment(spec, where, cfg)
        accelerator = decide_accelerator(spec, view)
        memory, note = memory_decision(resolved, cfg, accelerator)
        startup = spec.startup_timeout_s or derived_startup_timeout_s(memory)
        cost = None if memory is None else partial(forward_cost_s, memory, cfg, device=accelerator.compute)
        tail = tail_decision(resolved, cfg, cost, spec.warmup_limit_s)
        # The replicas read the startup bound from their spec: the set or derived one.
        resolved = replace(resolved, spec=spec.model_copy(update={"startup_timeout_s": startup}))
        try:
            options = deployment_options(spec, accelerator.layout, capacity[spec.name].max_replicas)
        except ValueError as e:
            raise ValueError(f"deployment {spec.name!r}: {e}") from None
        decision = Decision(resolved, tail, accelerator, capacity[spec.name], options, memory, note, startup)
        log_once(f"controller: {decision.describe()}", logger)
        log_once(f"controller: deployment {spec.name!r} runs on {accelerator.compute} "
                 f"({accelerator.layout} bundles): {accelerator.reason}", logger)
        if memory is not None:
            log_once(f"controller: deployment {spec.name!r} memory: {memory.arithmetic()} ({note})", logger)
        else:
            log_once(f"controller: deployment {spec.name!r}: {note}", logger)
        decisions[spec.name] = decision
    return decisions


def measured_plan(decision: TailDecision, timings: Timings, unmeasured: Sequence[int] = ()) -> TailPlan:
    """The per-range plan of rank 0's ``timings``, restricted to the decision's candidates; above
    the largest measured count the static rule's tail serves when ``unmeasured`` counts (cut by
    the warm-up limit) or the decision's bound left larger batches unmeasured."""
    unknown = sorted(set(timings) - set(decision.candidates))
    if unknown:
        raise ValueError(
            f"timings for tails {unknown} that are not legal candidates {list(decision.candidates)}"
        )
    plan = plan_from_timings(
        timings, reason=f"auto: measured at warm-up on the TP {decision.tp_size} group over {list(timings)}"
    )
    if unmeasured or decision.bound is not None:
        largest = max(T for per in timings.values() for T in per)
        why = (f"T = {list(unmeasured)} not measured within warmup_limit_s" if unmeasured
               else "larger counts were left out by the warm-up limit")
        plan = plan.with_fallback_above(largest, decision.plan.tails[-1], why)
    return plan
