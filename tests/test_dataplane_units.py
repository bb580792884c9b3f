"""Data-plane pieces testable without a cluster: option pass-through, batching knobs, the
counters/metrics object, backpressure errors on every client path, the dashboard."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from ray.serve.exceptions import BackPressureError

from deployments.client import HTTPMoEClient, MoEOverloadedError, MoEServerError
from deployments.client.errors import raise_for
from deployments.common.errors import (
    GroupTimeoutError,
    GroupUnavailableError,
    RequestTimeoutError,
    http_status,
    retry_after_s,
)
from deployments.common.retry import Resend, resend_after
from deployments.config.spec import BATCHING_KNOBS, DeploymentSpec, with_batching
from deployments.control.serve_options import MAX_CONSTRUCTOR_RETRIES, deployment_options
from deployments.serve.check_options import check_serve_options
from deployments.serve.metrics import METRIC_NAMES, ReplicaStats

ROOT = Path(__file__).resolve().parents[1]


def test_computed_options_bound_queues_retries_and_carry_the_batching_knobs():
    opts = deployment_options(DeploymentSpec(max_batch_tokens=512), "cpu")
    assert opts["max_queued_requests"] == 256 and opts["backpressure_config"] == {"retry_after_s": 1.0}
    assert opts["max_constructor_retry_count"] == MAX_CONSTRUCTOR_RETRIES
    assert opts["user_config"] == {"max_batch_tokens": 512, "batch_wait_timeout_s": 0.002,
                                   "max_tokens_per_request": 8192}
    assert opts["request_router_config"]["request_router_class"] == "deployments.serve.router:HealthyReplicaRouter"


def test_deployment_config_is_merged_over_the_computed_options():
    spec = DeploymentSpec(num_replicas=2, deployment_config={
        "max_queued_requests": 8, "max_constructor_retry_count": 1,
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 3}})
    opts = deployment_options(spec, "cpu")
    check_serve_options(opts, spec.deployment_config, "test")
    assert opts["max_queued_requests"] == 8 and opts["max_constructor_retry_count"] == 1
    # The given autoscaling config replaces the computed num_replicas (Serve takes one of them).
    assert "num_replicas" not in opts and opts["autoscaling_config"]["max_replicas"] == 3
    assert "placement_group_bundles" in opts  # everything not overridden stays


@pytest.mark.parametrize(("override", "message"), [
    ({"max_queud_requests": 3}, r"unknown Serve option\(s\) \['max_queud_requests'\]"),
    ({"name": "other"}, r"unknown Serve option\(s\) \['name'\]"),
    ({"max_constructor_retry_count": 0}, "max_constructor_retry_count"),
    ({"max_queued_requests": "many"}, "max_queued_requests"),
    ({"placement_group_strategy": "SIDEWAYS"}, "placement group strategy SIDEWAYS"),
    ({"user_config": {"max_batch_tokens": 0}}, "(?s)user_config of deployment 'moe'.*max_batch_tokens"),
    ({"user_config": {"wait": 1}}, r"unknown key\(s\) \['wait'\]"),
])
def test_bad_deployment_config_fails_at_build_time(override, message):
    spec = DeploymentSpec(deployment_config=override)
    with pytest.raises(ValueError, match=message):  # merged here, then checked by Serve's own models
        check_serve_options(deployment_options(spec, "gpu"), spec.deployment_config, f"deployment {spec.name!r}")


def test_with_batching_validates_like_the_spec():
    spec = DeploymentSpec(name="decode")
    assert with_batching(spec, None) == spec
    new = with_batching(spec, {"max_batch_tokens": 64, "batch_wait_timeout_s": 0.0})
    assert (new.max_batch_tokens, new.batch_wait_timeout_s, new.tp_size) == (64, 0.0, spec.tp_size)
    with pytest.raises(ValueError, match="(?s)user_config of deployment 'decode'.*batch_wait_timeout_s"):
        with_batching(spec, {"batch_wait_timeout_s": 5.0})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['tp_size'\]"):
        with_batching(spec, {"tp_size": 2})  # only the batching knobs change live
    assert set(BATCHING_KNOBS) <= set(DeploymentSpec.model_fields)


def test_replica_stats_count_once_for_status():
    stats = ReplicaStats()
    stats.admitted(5)
    stats.admitted(3)
    assert stats.to_dict()["queued_tokens"] == 8
    stats.forward_done(1, 8, 2, "sharded", 0.004)
    stats.released(5, answered=True)
    stats.released(3, answered=False)
    stats.error("server")
    d = stats.to_dict()
    assert (d["requests"], d["tokens"], d["forwards"], d["queued_tokens"]) == (2, 5, 1, 0)
    assert d["errors"] == {"client": 0, "server": 1} and d["tails"] == {"sharded": 1}
    assert d["batch_tokens"]["histogram"] == {"<=8": 1} and d["forward_ms"]["recent"] == [4.0]
    assert d["by_layer"] == {"1": {"forwards": 1, "requests": 2, "tokens": 8}}


def test_backpressure_is_a_typed_503_with_retry_after():
    refused = BackPressureError(num_queued_requests=4, max_queued_requests=4, retry_after_s=1.0)
    assert http_status(refused) == 503 and retry_after_s(refused) == 1.0 and resend_after(refused) is None
    with pytest.raises(MoEOverloadedError) as info:
        raise_for(refused)
    assert info.value.status == 503 and info.value.retry_after_s == 1.0 and "backpressure" in info.value.message

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": "dropped due to backpressure", "status": 503},
                              headers={"Retry-After": "2"})

    client = HTTPMoEClient(client=httpx.Client(transport=httpx.MockTransport(handler), base_url="http://t"))
    with client, pytest.raises(MoEOverloadedError) as info:
        client.forward(torch.ones(1, 4), 1)
    assert info.value.retry_after_s == 2.0


def test_only_a_broken_group_is_retried_and_never_on_its_replica():
    assert resend_after(GroupUnavailableError("rank 1 died", "r1")) == Resend("r1")
    # a group call past its bound broke the group: it runs nothing more, so another replica may answer
    assert resend_after(GroupTimeoutError("timed out", "r2")) == Resend("r2")
    assert resend_after(RequestTimeoutError("no answer in 90 s")) is None  # the caller's own wait: it may still run
    assert resend_after(ValueError("bad shape")) is None
    from ray.exceptions import ActorDiedError

    assert resend_after(ActorDiedError()) == Resend(None)  # the replica died under the request
    assert http_status(ActorDiedError()) == 503  # unavailable while Serve replaces it, not a server bug
    with pytest.raises(MoEServerError):
        raise_for(GroupUnavailableError("rank 1 died"))


def test_dashboard_covers_every_metric():
    text = (ROOT / "deployments/dashboards/moe_tier.json").read_text()
    dashboard = json.loads(text)
    assert dashboard["panels"]
    for name in METRIC_NAMES:
        assert f"ray_{name}" in text, name


def test_live_batching_changes_stay_within_the_planned_forward(tiny_ckpt):
    from deployments.app import decide_app
    from deployments.serve.deployment import check_planned_tokens

    _, (resolved,), (decision,) = decide_app(
        {"checkpoint": str(tiny_ckpt), "max_batch_tokens": 64, "max_tokens_per_request": 128}
    )
    assert decision.memory is not None and decision.memory.workspace.tokens == 128
    check_planned_tokens(with_batching(resolved.spec, {"max_batch_tokens": 16}), decision)  # lower: fine
    check_planned_tokens(with_batching(resolved.spec, {"max_batch_tokens": 128}), decision)  # = planned
    with pytest.raises(ValueError, match="forwards of up to 4096 tokens .* exceed the 128 tokens"):
        check_planned_tokens(with_batching(resolved.spec, {"max_tokens_per_request": 4096}), decision)


def test_the_router_steers_around_broken_and_avoided_replicas_and_sends_sessions_to_the_least_loaded():
    from types import SimpleNamespace

    from deployments.serve.router import steer

    def replica(name: str, healthy: bool = True, rows: int = 0):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name),
                               routing_stats={"healthy": healthy, "session_rows": rows})

    a, b, c = replica("a"), replica("b"), replica("c")
    assert steer([a, b, c], None) is None  # nothing to steer around: Serve's own choice
    assert steer([a, b, c], "a") == [b, c]  # a re-sent call never goes back to the replica that failed it
    assert steer([a, b], "a") == [b]
    assert steer([a], "a") is None  # no other replica: the failed one refuses it itself
    broken, busy = replica("x", healthy=False), replica("y", rows=64)
    assert steer([broken, a], None) == [a]
    assert steer([busy, a], None) is None  # sessions never keep a Serve call away from a replica
    assert steer([busy, a], None, new_session=True) == [a]  # a new session: the least-loaded one
    assert steer([busy, replica("z", rows=8), broken], None, new_session=True)[0].replica_id.unique_id == "z"
    assert steer([broken], None) is None  # only broken ones: its clear 503 rather than a hang
    assert steer([b, broken], "b") == [broken]  # avoided beats everything: the broken one answers 503
