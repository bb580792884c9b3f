"""Every time bound from the spec in one place (deployments/config/timeouts.py), the order the
bounds must keep, and config fields an app must not abuse. Pure: no Ray."""

from __future__ import annotations

import pytest

from deployments.config.spec import AppArgs, DeploymentSpec
from deployments.config.timeouts import (
    EVENTS_PUSH_S,
    HEALTH_MARGIN_S,
    HEARTBEAT_S,
    RANK_POLL_S,
    REQUEST_MARGIN_S,
    ROUTING_STATS_PERIOD_S,
    Bounds,
    request_bound,
)
from deployments.control.serve_options import deployment_options


def test_the_defaults_keep_the_order():
    b = DeploymentSpec().bounds
    assert b.collective_s < b.call_s  # a forward is its collectives plus compute
    assert b.collective_s < b.health_s < b.serve_health_s  # Serve waits out the health all-reduce
    assert RANK_POLL_S <= b.call_s and HEARTBEAT_S < RANK_POLL_S  # an idle group's dead rank: within call_s
    assert HEARTBEAT_S >= 1.0 and EVENTS_PUSH_S >= 1.0  # nothing wakes more than once a second while idle
    assert b.close_s >= b.collective_s and b.warmup_s > b.call_s
    assert request_bound(None, [DeploymentSpec()]) == b.call_s + REQUEST_MARGIN_S > b.call_s
    assert ROUTING_STATS_PERIOD_S <= EVENTS_PUSH_S


def test_bounds_follow_the_spec():
    spec = DeploymentSpec(collective_timeout_s=12, call_margin_s=3, warmup_limit_s=40, session_linger_s=2)
    assert Bounds.of(spec) == Bounds(collective_s=12, call_s=15, health_s=12 + HEALTH_MARGIN_S,
                                     serve_health_s=12 + 2 * HEALTH_MARGIN_S, close_s=12, warmup_s=55,
                                     startup_s=spec.bounds.startup_s, linger_s=2)
    # Serve gets the health bound the spec derives (what the replica's probe waits for, plus margin)
    assert deployment_options(spec, "cpu")["health_check_timeout_s"] == spec.bounds.serve_health_s


@pytest.mark.parametrize(("fields", "message"), [
    ({"collective_timeout_s": 60, "health_check_timeout_s": 30},
     r"health_check_timeout_s 30 s must exceed the health all-reduce's bound, collective_timeout_s 60 \+ 5 = 65 s"),
    ({"collective_timeout_s": 1, "call_margin_s": 1}, r"1 \+ call_margin_s 1 = 2 s is below the rank poll bound 5 s"),
    ({"lane_lease_s": 5}, r"lane_lease_s was removed: sessions have no term to renew"),
])
def test_a_config_that_breaks_the_order_fails_at_construction_with_the_arithmetic(fields, message):
    with pytest.raises(ValueError, match=message):
        DeploymentSpec(**fields)


def test_the_ingress_never_gives_up_before_a_group_call_ends():
    specs = [{"name": "a", "collective_timeout_s": 10, "call_margin_s": 5},
             {"name": "b", "collective_timeout_s": 40, "call_margin_s": 20}]
    assert request_bound(None, [DeploymentSpec(**s) for s in specs]) == 60 + REQUEST_MARGIN_S
    with pytest.raises(ValueError, match=r"request_timeout_s 50 s must exceed the slowest group call, .* = 60 s"):
        AppArgs(checkpoint="x", deployments=specs, request_timeout_s=50)
    assert AppArgs(checkpoint="x", deployments=specs, request_timeout_s=61).request_timeout_s == 61


def test_the_warmup_clock_comes_only_from_the_tests_package():
    assert DeploymentSpec(tune_clock="tests.test_lane:scripted_clock").tune_clock.startswith("tests.")
    with pytest.raises(ValueError, match="only a clock of the project's tests package"):
        DeploymentSpec(tune_clock="os:getpid")
