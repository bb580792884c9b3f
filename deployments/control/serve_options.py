"""Serve deployment options as pure functions of the validated spec and the controller's
decisions (no Ray: Serve validates the merged result in ``deployments.serve.check_options``).

A TP-group replica owns a placement group of ``1 + P`` bundles packed on one node:
bundle 0 (``{"CPU": c}``) holds the replica actor, which asks for no GPU; bundle ``1 + r``
holds the worker of rank ``r``: ``{"GPU": 1}`` (plus a sliver of the accelerator-type resource
when one is pinned) with the ``gpu`` layout, ``{"CPU": worker_cpus}`` with the ``cpu`` layout
(the layout is the accelerator decision's, ``deployments.control.accelerator``). ``STRICT_PACK``
keeps a TP group on one node.
"""

from __future__ import annotations

from typing import Any

from ..config.spec import BATCHING_KNOBS, AutoscalingSpec, DeploymentSpec, with_batching
from ..config.timeouts import DRAIN_POLL_S, ROUTING_STATS_PERIOD_S

# Ray's convention for "must run on this accelerator type" (what ``accelerator_type=`` sets).
# Ray gives the resource 1 per node, so P ranks of a node ask P x 0.001 of it together.
ACCELERATOR_FRACTION = 0.001
CPU_RANK_CPUS = 0.25  # default worker_cpus of a CPU rank (see DeploymentSpec.worker_cpus)
# A replica whose constructor fails (bad checkpoint path, placement) is retried this many times
# before the deploy fails; Serve's default (20, with backoff) takes far longer to say so.
MAX_CONSTRUCTOR_RETRIES = 3
RETRY_AFTER_S = 1.0  # Retry-After of a request refused by max_queued_requests
ROUTER_CLASS = "deployments.serve.router:HealthyReplicaRouter"
LAYOUTS = ("gpu", "cpu")


def accelerator_resource(accelerator_type: str) -> str:
    return f"accelerator_type:{accelerator_type}"


def rank_bundle(spec: DeploymentSpec, layout: str) -> dict[str, float]:
    """The placement-group bundle of one rank with the ``gpu`` or ``cpu`` layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "cpu":
        return {"CPU": spec.worker_cpus or CPU_RANK_CPUS}
    bundle: dict[str, float] = {"GPU": 1}
    if spec.worker_cpus:
        bundle["CPU"] = spec.worker_cpus
    if spec.accelerator_type:
        bundle[accelerator_resource(spec.accelerator_type)] = ACCELERATOR_FRACTION
    return bundle


def worker_resources(spec: DeploymentSpec, layout: str) -> dict[str, Any]:
    """What one worker actor asks for: exactly its bundle (see :func:`placement_bundles`)."""
    bundle = rank_bundle(spec, layout)
    extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0), "resources": extra}


def placement_bundles(spec: DeploymentSpec, layout: str) -> list[dict[str, float]]:
    """``[{"CPU": c}] + [rank bundle] * P``: the replica's bundle, then one per rank."""
    return [{"CPU": spec.replica_cpus}] + [rank_bundle(spec, layout) for _ in range(spec.tp_size)]


def autoscaling_config(spec: DeploymentSpec, max_replicas: int | None = None) -> dict[str, Any]:
    """Ray's ``autoscaling_config`` dict, via the project's token-aware builder.

    ``max_replicas``: the bound after the app's capacity budget (``control.capacity``); None:
    the spec's own.
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
        max_replicas=a.max_replicas if max_replicas is None else max_replicas,
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


def deployment_options(spec: DeploymentSpec, layout: str, max_replicas: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``Deployment.options`` for one TP-group deployment, with the spec's
    ``deployment_config`` merged over them (Serve validates the result: ``serve.check_options``)."""
    options: dict[str, Any] = {
        "name": spec.name,
        "ray_actor_options": {"num_cpus": spec.replica_cpus, "num_gpus": 0},
        "placement_group_bundles": placement_bundles(spec, layout),
        "placement_group_strategy": "STRICT_PACK",
        "max_ongoing_requests": spec.max_ongoing_requests,
        "health_check_period_s": spec.health_check_period_s,
        "health_check_timeout_s": spec.bounds.serve_health_s,
        "graceful_shutdown_timeout_s": spec.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
        "logging_config": {"enable_access_log": spec.access_log},
        "max_queued_requests": spec.max_queued_requests,
        "backpressure_config": {"retry_after_s": RETRY_AFTER_S},
        "max_constructor_retry_count": MAX_CONSTRUCTOR_RETRIES,
        "user_config": {k: getattr(spec, k) for k in BATCHING_KNOBS},
        "request_router_config": {"request_router_class": ROUTER_CLASS,
                                  "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S},
    }
    if spec.autoscaling is not None:
        options["autoscaling_config"] = autoscaling_config(spec, max_replicas)
    else:
        options["num_replicas"] = spec.num_replicas or 1
    options = merge_serve_options(options, spec.deployment_config)
    with_batching(spec, options["user_config"])  # its knobs must be legal before any replica starts
    return options


def merge_serve_options(computed: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` (a spec's ``deployment_config``) over the computed options; the one given of
    ``num_replicas`` / ``autoscaling_config`` wins over the computed other."""
    merged = {**computed, **overrides}
    if "num_replicas" in overrides:
        merged.pop("autoscaling_config", None)
    elif "autoscaling_config" in overrides:
        merged.pop("num_replicas", None)
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
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
        "num_replicas": replicas,
    }
