"""Token-aware autoscaling policy on synthetic Ray contexts; no Ray instance is started."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray.serve.request_router import ReplicaID

from deployments.common.private_api import deployment_id
from deployments.control.autoscaling import (
    OPEN_SESSIONS,
    QUEUED_TOKENS,
    TOKENS_PER_S,
    TokenScalingParams,
    desired_replicas,
)

DEP = deployment_id("moe", "app")
# 1000 queued tokens per replica wanted, no throughput target unless a test sets one.
P = TokenScalingParams(target_queued_tokens_per_replica=1000, upscale_delay_s=0, downscale_delay_s=60)


def queued(*tokens: float) -> list[dict[str, float]]:
    return [{QUEUED_TOKENS: t, TOKENS_PER_S: 0.0} for t in tokens]


def ctx(
    target: int,
    queued_tokens: list[float] | None = None,
    *,
    rate: list[float] | None = None,
    low: int = 1,
    high: int = 8,
    state: dict | None = None,
    now: float = 1000.0,
    config: AutoscalingConfig | None = None,
) -> AutoscalingContext:
    """A context as Ray 2.60's controller builds it, with our metrics per replica."""
    n = len(queued_tokens if queued_tokens is not None else rate or [])
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(n)]
    metrics = {}
    if queued_tokens is not None:
        metrics[QUEUED_TOKENS] = dict(zip(ids, queued_tokens, strict=True))
    if rate is not None:
        metrics[TOKENS_PER_S] = dict(zip(ids, rate, strict=True))
    return AutoscalingContext(
        deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
        current_num_replicas=max(n, 1), target_num_replicas=target, running_replicas=ids,
        total_num_requests=1.0, total_queued_requests=0.0,
        aggregated_metrics=metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=low, capacity_adjusted_max_replicas=high,
        policy_state=state or {}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=now, config=config,
    )


# --- parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("autoscaling", "tp_size", "message"),
    [
        # The bounds are the spec's (validated once, there); the capacity is control.capacity's.
        ({"min_replicas": 5, "max_replicas": 8}, 8, "min_replicas 5 > 4 TP groups of 8 GPUs the cluster can host"),
        ({"min_replicas": 1, "max_replicas": 2}, 16, "a TP group of 16 cannot fit on a node with 8 GPUs"),
        ({"min_replicas": 3, "max_replicas": 2}, 8, "max_replicas 2 < min_replicas 3"),
        ({"target_ongoing_requests": 0}, 8, "target_ongoing_requests"),
    ],
)
def test_bounds_and_capacity_errors(autoscaling: dict, tp_size: int, message: str) -> None:
    from deployments.config.spec import DeploymentSpec
    from deployments.control.capacity import app_capacity
    from deployments.control.launcher import load_cluster_config

    cluster = load_cluster_config(Path(__file__).resolve().parents[1] / "cluster.yaml")  # 4 x 8 MI300X
    with pytest.raises(ValueError, match=message):
        spec = DeploymentSpec(tp_size=tp_size, autoscaling=autoscaling)
        app_capacity([spec], {spec.name: cluster})


def test_capacity_clamps_max_replicas() -> None:
    from deployments.config.spec import DeploymentSpec
    from deployments.control.capacity import app_capacity
    from deployments.control.launcher import load_cluster_config

    cluster = load_cluster_config(Path(__file__).resolve().parents[1] / "cluster.yaml")
    spec = DeploymentSpec(tp_size=8, autoscaling={"min_replicas": 1, "max_replicas": 16})
    (capacity,) = app_capacity([spec], {spec.name: cluster}).values()
    assert (capacity.tp_groups, capacity.max_replicas) == (4, 4) and "16 -> 4" in capacity.reason


def test_a_scale_down_never_goes_below_the_replicas_holding_sessions() -> None:
    """No Serve load at all, but two of three replicas hold open sessions: demand is 2, so a
    scale-down stops at 2 and never drops a replica a session still uses while others are free."""
    metrics = [{QUEUED_TOKENS: 0.0, TOKENS_PER_S: 0.0, OPEN_SESSIONS: n} for n in (1.0, 0.0, 3.0)]
    target, _ = desired_replicas(metrics, current=3, min_replicas=1, max_replicas=8, params=P, state={},
                                 now=0.0)
    assert target == 3  # the down timer starts
    target, _ = desired_replicas(metrics, 3, 1, 8, P, {"token_downscale_since": 0.0}, now=61.0)
    assert target == 2
    idle = [{**m, OPEN_SESSIONS: 0.0} for m in metrics]
    assert desired_replicas(idle, 3, 1, 8, P, {"token_downscale_since": 0.0}, now=61.0)[0] == 1
