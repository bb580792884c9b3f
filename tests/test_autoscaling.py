"""Token-aware autoscaling policy on synthetic Ray contexts; no Ray instance is started."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.autoscaling import (
    POLICY_IMPORT_PATH,
    QUEUED_TOKENS,
    TOKENS_PER_S,
    TokenAutoscalingPolicy,
    TokenScalingParams,
    build_autoscaling_config,
    desired_replicas,
    token_autoscaling_policy,
)

DEP = DeploymentID(name="moe", app_name="app")
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
    ("kwargs", "message"),
    [
        ({"target_queued_tokens_per_replica": 0}, "target_queued_tokens_per_replica must be a finite number > 0, got 0"),
        ({"target_queued_tokens_per_replica": math.inf}, "got inf"),
        ({"target_tokens_per_s_per_replica": -5.0}, "target_tokens_per_s_per_replica must be"),
        ({"target_tokens_per_s_per_replica": True}, "got True"),
        ({"upscale_delay_s": -1}, "upscale_delay_s must be a finite number of seconds >= 0, got -1"),
        ({"downscale_delay_s": math.nan}, "downscale_delay_s must be"),
    ],
)
def test_params_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenScalingParams(**kwargs)


def test_policy_class_rejects_unknown_kwargs() -> None:
    with pytest.raises(ValueError, match="unexpected keyword argument 'target'"):
        TokenAutoscalingPolicy(target=3)


def test_bad_bounds() -> None:
    with pytest.raises(ValueError, match="min 3, max 2"):
        desired_replicas(queued(1), 2, 3, 2, P, {}, 0.0)


# --- the pure decision --------------------------------------------------------------------


def test_no_metrics_holds_current() -> None:
    pending = {"token_downscale_since": 5.0}
    target, state = desired_replicas([], 3, 1, 8, P, pending, 100.0)
    assert target == 3
    assert state["token_downscale_since"] is None  # unknown demand breaks the idle streak
    assert pending == {"token_downscale_since": 5.0}  # input state untouched


def test_burst_scales_up_at_once() -> None:
    # 5500 queued tokens / 1000 per replica -> 6 replicas, from 2, in one tick.
    assert desired_replicas(queued(5000, 500), 2, 1, 8, P, {}, 0.0)[0] == 6


def test_burst_waits_for_upscale_delay() -> None:
    params = TokenScalingParams(target_queued_tokens_per_replica=1000, upscale_delay_s=10)
    target, state = desired_replicas(queued(4000), 1, 1, 8, params, {}, 100.0)
    assert target == 1
    target, state = desired_replicas(queued(4000), 1, 1, 8, params, state, 105.0)
    assert target == 1
    target, state = desired_replicas(queued(4000), 1, 1, 8, params, state, 110.0)
    assert target == 4


def test_idle_scales_down_only_after_continuous_delay() -> None:
    state: dict = {}
    for now in (0.0, 30.0, 59.0):  # idle, but not yet for downscale_delay_s = 60
        target, state = desired_replicas(queued(0, 0, 0), 3, 1, 8, P, state, now)
        assert target == 3
    target, state = desired_replicas(queued(0, 0, 0), 3, 1, 8, P, state, 60.0)
    assert target == 1  # min_replicas


def test_demand_in_between_restarts_the_idle_timer() -> None:
    _, state = desired_replicas(queued(0, 0, 0), 3, 1, 8, P, {}, 0.0)
    _, state = desired_replicas(queued(1000, 1000, 1000), 3, 1, 8, P, state, 30.0)  # busy again
    target, state = desired_replicas(queued(0, 0, 0), 3, 1, 8, P, state, 60.0)
    assert target == 3  # idle streak started over at t=60
    target, _ = desired_replicas(queued(0, 0, 0), 3, 1, 8, P, state, 120.0)
    assert target == 1


def test_partial_downscale_keeps_what_demand_needs() -> None:
    _, state = desired_replicas(queued(900, 900), 6, 1, 8, P, {}, 0.0)
    assert desired_replicas(queued(900, 900), 6, 1, 8, P, state, 60.0)[0] == 2


def test_never_above_capacity_nor_below_min() -> None:
    assert desired_replicas(queued(10**9), 2, 1, 4, P, {}, 0.0)[0] == 4
    _, state = desired_replicas(queued(0), 3, 2, 4, P, {}, 0.0)
    assert desired_replicas(queued(0), 3, 2, 4, P, state, 1e6)[0] == 2
    # A current size outside the bounds is pulled back in, even with no metrics.
    assert desired_replicas([], 9, 2, 4, P, {}, 0.0)[0] == 4
    assert desired_replicas([], 0, 2, 4, P, {}, 0.0)[0] == 2


def test_throughput_target() -> None:
    params = TokenScalingParams(target_queued_tokens_per_replica=1000, target_tokens_per_s_per_replica=20_000)
    metrics = [{QUEUED_TOKENS: 0.0, TOKENS_PER_S: 30_000.0}] * 3  # 90k tok/s -> 5 replicas
    assert desired_replicas(metrics, 2, 1, 8, params, {}, 0.0)[0] == 5
    assert desired_replicas(metrics, 2, 1, 8, P, {}, 0.0)[0] == 2  # no target: rate ignored


def test_bad_metric_values_are_ignored() -> None:
    metrics = [{QUEUED_TOKENS: math.nan}, {QUEUED_TOKENS: -50.0}, {}, {QUEUED_TOKENS: 2500.0}]
    assert desired_replicas(metrics, 1, 1, 8, P, {}, 0.0)[0] == 3


# --- on Ray's context ---------------------------------------------------------------------


def test_context_adapter_reads_aggregated_metrics_and_bounds() -> None:
    policy = TokenAutoscalingPolicy(target_queued_tokens_per_replica=1000, downscale_delay_s=60)
    assert policy(ctx(2, [3000, 2500]))[0] == 6
    assert policy(ctx(2, [10**6], high=5))[0] == 5  # capacity-adjusted max
    assert policy(ctx(4, None))[0] == 4  # no replica reported yet
    assert policy(ctx(4, [0, 0], low=3, high=2))[0] == 3  # Ray lets the lower bound win
    # Idle: the state Ray hands back carries the timer from tick to tick.
    target, state = policy(ctx(3, [0, 0, 0], now=0.0))
    assert target == 3
    assert policy(ctx(3, [0, 0, 0], now=60.0, state=state))[0] == 1


def test_throughput_only_metrics_from_context() -> None:
    policy = TokenAutoscalingPolicy(target_tokens_per_s_per_replica=10_000)
    assert policy(ctx(1, rate=[25_000.0, 10_000.0]))[0] == 4


def test_plain_function_uses_default_params() -> None:
    # Defaults: 8192 queued tokens per replica, scale up at once.
    assert token_autoscaling_policy(ctx(1, [8192 * 3]))[0] == 3


# --- the autoscaling_config dict ------------------------------------------------------------


def test_ray_accepts_the_config_and_runs_the_policy() -> None:
    # Private Ray 2.60 internals, used on purpose: they are the controller's code path.
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve._private.config import DeploymentConfig
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.schema import DeploymentSchema

    params = TokenScalingParams(target_queued_tokens_per_replica=1000, downscale_delay_s=60)
    raw = build_autoscaling_config(min_replicas=1, max_replicas=16, capacity=4,
                                   target_ongoing_requests=8, params=params)
    config = AutoscalingConfig(**raw)
    assert (config.min_replicas, config.max_replicas) == (1, 4)  # clamped to capacity
    assert config.target_ongoing_requests == 8
    assert (config.upscale_delay_s, config.downscale_delay_s) == (0.0, 0.0)
    assert config.policy.policy_function == POLICY_IMPORT_PATH
    DeploymentSchema(name="moe", autoscaling_config=raw)  # the `serve run` YAML schema too

    # The controller side: the config survives the proto round trip with its kwargs, and
    # Ray's wrapper (factors, its delays, bounds) adds no delay of its own on top of ours.
    config = DeploymentConfig.from_proto_bytes(
        DeploymentConfig(autoscaling_config=raw).to_proto_bytes()
    ).autoscaling_config
    assert config.policy.policy_kwargs == asdict(params)
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    assert policy(ctx(1, [3000], config=config))[0] == 3  # burst: at once
    target, state = policy(ctx(3, [0, 0, 0], now=0.0, config=config))
    assert target == 3
    target, state = policy(ctx(3, [0, 0, 0], now=30.0, state=state, config=config))
    assert target == 3
    target, _ = policy(ctx(3, [0, 0, 0], now=60.0, state=state, config=config))
    assert target == 1


def test_request_count_mode_keeps_ray_delays() -> None:
    params = TokenScalingParams(upscale_delay_s=5, downscale_delay_s=120)
    raw = build_autoscaling_config(min_replicas=0, max_replicas=2, capacity=None,
                                   target_ongoing_requests=4, params=params, token_aware=False)
    config = AutoscalingConfig(**raw)
    assert config.policy.is_default_policy_function()
    assert (config.upscale_delay_s, config.downscale_delay_s) == (5, 120)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_replicas": 5, "capacity": 4}, "min_replicas 5 > 4 TP groups the cluster can host"),
        ({"capacity": 0}, "the cluster can host 0 TP groups"),
        ({"min_replicas": 3, "max_replicas": 2}, "got min 3, max 2"),
        ({"target_ongoing_requests": 0}, "target_ongoing_requests must be > 0"),
    ],
)
def test_build_config_errors(kwargs: dict, message: str) -> None:
    args = {"min_replicas": 1, "max_replicas": 8, "capacity": 4, "target_ongoing_requests": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        build_autoscaling_config(**args)
