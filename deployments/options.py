"""Serve deployment options as pure functions of the validated arguments (no cluster needed).

A TP-group replica owns a placement group of ``1 + P`` bundles packed on one node:
bundle 0 (``{"CPU": c}``) holds the replica actor, which asks for no GPU; bundle ``1 + r``
holds the worker of rank ``r``: ``{"GPU": 1}`` (plus a sliver of the accelerator-type resource
when one is pinned) on GPUs, ``{"CPU": worker_cpus}`` when ``accelerator`` is ``cpu``.
``STRICT_PACK`` keeps a TP group on one node. An ``accelerator: auto`` not yet resolved against
a cluster (``deployments.placement`` does that at build time) gets the GPU layout.
"""

from __future__ import annotations

from typing import Any

from .routing import ROUTER_CLASS, ROUTING_STATS_PERIOD_S
from .spec import BATCHING_KNOBS, AutoscalingSpec, DeploymentSpec, with_batching

# Ray's convention for "must run on this accelerator type" (what ``accelerator_type=`` sets).
# Ray gives the resource 1 per node, so P ranks of a node ask P x 0.001 of it together.
ACCELERATOR_FRACTION = 0.001
CPU_RANK_CPUS = 0.25  # default worker_cpus of a CPU rank (see DeploymentSpec.worker_cpus)
# A replica whose constructor fails (bad checkpoint path, placement) is retried this many times
# before the deploy fails; Serve's default (20, with backoff) takes far longer to say so.
MAX_CONSTRUCTOR_RETRIES = 3
RETRY_AFTER_S = 1.0  # Retry-After of a request refused by max_queued_requests


def accelerator_resource(accelerator_type: str) -> str:
    return f"accelerator_type:{accelerator_type}"


def uses_gpus(spec: DeploymentSpec) -> bool:
    return spec.accelerator != "cpu"


def rank_bundle(spec: DeploymentSpec) -> dict[str, float]:
    """The placement-group bundle of one rank."""
    if not uses_gpus(spec):
        return {"CPU": spec.worker_cpus or CPU_RANK_CPUS}
    bundle: dict[str, float] = {"GPU": 1}
    if spec.worker_cpus:
        bundle["CPU"] = spec.worker_cpus
    if spec.accelerator_type:
        bundle[accelerator_resource(spec.accelerator_type)] = ACCELERATOR_FRACTION
    return bundle


def worker_resources(spec: DeploymentSpec) -> dict[str, Any]:
    """What one worker actor asks for: exactly its bundle (see :func:`placement_bundles`)."""
    bundle = rank_bundle(spec)
    extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0), "resources": extra}


def placement_bundles(spec: DeploymentSpec) -> list[dict[str, float]]:
    """``[{"CPU": c}] + [rank bundle] * P``: the replica's bundle, then one per rank."""
    return [{"CPU": spec.replica_cpus}] + [rank_bundle(spec) for _ in range(spec.tp_size)]


def autoscaling_config(spec: DeploymentSpec, capacity: int | None = None) -> dict[str, Any]:
    """Ray's ``autoscaling_config`` dict, via the project's token-aware builder.

    ``capacity``: TP groups of this size the cluster can host (None: unknown); it caps
    ``max_replicas``.
    """
    from .autoscaling import TokenScalingParams, build_autoscaling_config

    a: AutoscalingSpec = spec.autoscaling or AutoscalingSpec()
    params = TokenScalingParams(
        target_queued_tokens_per_replica=a.target_queued_tokens_per_replica,
        target_tokens_per_s_per_replica=a.target_tokens_per_s_per_replica,
        upscale_delay_s=a.upscale_delay_s,
        downscale_delay_s=a.downscale_delay_s,
    )
    config = build_autoscaling_config(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        capacity=capacity,
        target_ongoing_requests=a.target_ongoing_requests,
        params=params,
        token_aware=a.token_aware,
        look_back_period_s=a.look_back_period_s,
    )
    if a.metrics_interval_s is not None:
        config["metrics_interval_s"] = a.metrics_interval_s
    if a.initial_replicas is not None:
        config["initial_replicas"] = min(a.initial_replicas, config["max_replicas"])
    return config


def cluster_capacity(spec: DeploymentSpec) -> int | None:
    """TP groups the autoscaling spec's cluster config can host, or None without one."""
    if spec.autoscaling is None or spec.autoscaling.cluster_config is None:
        return None
    from .cluster_spec import load_cluster_config, max_tp_groups

    return max_tp_groups(load_cluster_config(spec.autoscaling.cluster_config), spec.tp_size)


def deployment_options(spec: DeploymentSpec, capacity: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``Deployment.options`` for one TP-group deployment."""
    options: dict[str, Any] = {
        "name": spec.name,
        "ray_actor_options": {"num_cpus": spec.replica_cpus, "num_gpus": 0},
        "placement_group_bundles": placement_bundles(spec),
        "placement_group_strategy": "STRICT_PACK",
        "max_ongoing_requests": spec.max_ongoing_requests,
        "health_check_period_s": spec.health_check_period_s,
        "health_check_timeout_s": spec.effective_health_check_timeout_s,
        "graceful_shutdown_timeout_s": spec.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 1.0,
        "logging_config": {"enable_access_log": spec.access_log},
        "max_queued_requests": spec.max_queued_requests,
        "backpressure_config": {"retry_after_s": RETRY_AFTER_S},
        "max_constructor_retry_count": MAX_CONSTRUCTOR_RETRIES,
        "user_config": {k: getattr(spec, k) for k in BATCHING_KNOBS},
        "request_router_config": {"request_router_class": ROUTER_CLASS,
                                  "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S},
    }
    if spec.autoscaling is not None:
        if capacity is None:
            capacity = cluster_capacity(spec)
        options["autoscaling_config"] = autoscaling_config(spec, capacity)
    else:
        options["num_replicas"] = spec.num_replicas or 1
    options = merge_serve_options(options, spec.deployment_config, f"deployment {spec.name!r}")
    with_batching(spec, options["user_config"])  # its knobs must be legal before any replica starts
    return options


class _OptionsProbe:
    """A stand-in deployment class: only its options are validated."""


def merge_serve_options(computed: dict[str, Any], overrides: dict[str, Any], where: str) -> dict[str, Any]:
    """``overrides`` (a spec's ``deployment_config``) over the computed options, validated by
    Serve's own models; ``ValueError`` naming the offending option."""
    import inspect

    from ray import serve
    from ray.serve.deployment import Deployment

    internal = {"self", "func_or_class", "name", "version", "_init_args", "_init_kwargs", "_internal"}
    allowed = set(inspect.signature(Deployment.options).parameters) - internal
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"{where}: deployment_config has unknown Serve option(s) {unknown}; "
                         f"allowed: {sorted(allowed)}")
    merged = {**computed, **overrides}
    if "num_replicas" in overrides:  # the one given wins over the computed other
        merged.pop("autoscaling_config", None)
    elif "autoscaling_config" in overrides:
        merged.pop("num_replicas", None)
    try:  # Serve's own validation (DeploymentConfig, replica options), as at deploy time
        serve.deployment(_OptionsProbe).options(**merged)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: invalid Serve options after merging deployment_config: {e}") from None
    return merged


def ingress_options(cpus: float = 0.1, replicas: int = 2, max_ongoing_requests: int = 256,
                    max_queued_requests: int = 1024) -> dict[str, Any]:
    """The HTTP/app-handle ingress: light replicas that forward to the TP groups; two by
    default so that the ingress is not a single point of failure."""
    return {
        "name": "ingress",
        "ray_actor_options": {"num_cpus": cpus, "num_gpus": 0},
        "max_ongoing_requests": max_ongoing_requests,
        "max_queued_requests": max_queued_requests,
        "backpressure_config": {"retry_after_s": RETRY_AFTER_S},
        "num_replicas": replicas,
    }
