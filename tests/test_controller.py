"""The controller: pure decisions for a table of configs, and ``auto`` measured on a real TP group.

The pure half needs no Ray: synthetic model configs (``preset_config``) at TP 1, 2 and 8, with
the conditions of the shardability rule broken one at a time, forced tails legal and illegal,
and the autoscaling bounds clamped to a cluster's MI300X capacity.

The Ray half serves one ``auto`` deployment (TP 2 on logical GPUs, gloo) whose warm-up
measurement runs on an injected clock (:func:`scripted_clock`): each tail "costs" what
``COST_MS`` says, so the plan is known in advance — a different tail wins each token range —
and the test checks that the replica serves every range with its tail, equal to the
single-device forward, and reports the plan, its reason and the timings in ``status()``,
``GET /v1/status`` and Ray's Prometheus endpoint.

Tolerance (float32): the TP 2 tails differ from the single-device forward only by the order
of the reductions (two partial sums, then an all-reduce; single_allreduce folds the norm's
scale after the sum), a few fp32 ulps on O(1) values; ``1e-5`` leaves a ~10x margin.
"""

from __future__ import annotations

import inspect
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deployments.config.spec import DeploymentSpec
from deployments.control.decide import AUTO_MEASURED, MeasureSettings, TailDecision, decide, measured_plan
from moe_runtime.synthetic import preset_config
from moe_runtime.tp.tuning import resolve_clock

ROOT = Path(__file__).resolve().parents[1]
MI300X = "accelerator_type:AMD-Instinct-MI300X-OAM"
ALL_BUT_SP = ("sharded", "replicated", "overlap", "single_allreduce")
NOT_SHARDED = ("replicated", "overlap", "single_allreduce")


def one(spec: dict, model: dict | None = None, cluster=None):
    model = model if model is not None else preset_config("tiny")
    spec = {"name": "moe", **spec}
    return decide([spec], model, cluster)[spec["name"]]


# -- tail decisions: a table of configs ------------------------------------------------------

# (id, spec fields, model overrides, plan: tiers' tails or AUTO_MEASURED, candidates, reason parts)
TABLE = [
    ("tp1-auto", {"tp_size": 1}, {}, ("replicated",), NOT_SHARDED,
     ["TP size is 1: there is nothing to shard", "TP 1: no collectives"]),
    ("tp2-auto", {"tp_size": 2}, {}, AUTO_MEASURED, ALL_BUT_SP,
     ["measured at warm-up", "every condition of the reference runner holds"]),
    ("tp8-auto", {"tp_size": 8}, {}, AUTO_MEASURED, ALL_BUT_SP, ["TP 8 group"]),
    ("tp8-H%P", {"tp_size": 8}, {"hidden_size": 132}, AUTO_MEASURED, NOT_SHARDED,
     ["132 rows do not divide by TP size 8 (132 % 8 = 4)"]),
    ("tp2-no-shared", {"tp_size": 2}, {"num_shared_experts": 0}, AUTO_MEASURED, NOT_SHARDED,
     ["no shared experts (num_shared_experts = 0)"]),
    ("tp2-sp", {"tp_size": 2, "sequence_parallel": True}, {}, ("sequence_parallel",), ("sequence_parallel",),
     ["sequence_parallel requested", "the only legal tail"]),
    # Our router folds routed_scaling_factor into the top-k weights (as K3 does), so the runner
    # sees 1.0 and the sharded tail stays legal.
    ("tp2-scaling", {"tp_size": 2}, {"routed_scaling_factor": 2.5}, AUTO_MEASURED, ALL_BUT_SP,
     ["every condition of the reference runner holds"]),
    ("tp2-scaling-forced", {"tp_size": 2, "tail": "sharded"}, {"routed_scaling_factor": 2.5}, ("sharded",),
     ALL_BUT_SP, ["sharded tail is legal: every condition"]),
    ("tp8-forced-sharded", {"tp_size": 8, "tail": "sharded"}, {}, ("sharded",), ALL_BUT_SP, ["every condition"]),
    ("tp2-forced-overlap", {"tp_size": 2, "tail": "overlap"}, {}, ("overlap",), ALL_BUT_SP, ["overlap requested"]),
    ("tp8-H%P-forced-1ar", {"tp_size": 8, "tail": "single_allreduce"}, {"hidden_size": 132}, ("single_allreduce",),
     NOT_SHARDED, ["single_allreduce requested"]),
    ("tp2-auto-off", {"tp_size": 2, "auto_tune_tokens": []}, {}, ("sharded",), ALL_BUT_SP,
     ["auto: sharded tail is legal", "measurement is off"]),
    ("tp2-preshard", {"tp_size": 2, "preshard_up_proj": True}, {}, ("sharded",), ("sharded",),
     ["the only legal tail"]),
]


@pytest.mark.parametrize(("spec", "model", "plan", "candidates", "reasons"),
                         [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_tail_decisions(spec, model, plan, candidates, reasons):
    decision = one(spec, preset_config("tiny", **model))
    tail = decision.tail
    assert tail.candidates == candidates
    if plan == AUTO_MEASURED:
        assert decision.plan == AUTO_MEASURED and tail.pending and tail.choice == AUTO_MEASURED
        defaults = DeploymentSpec()
        assert tail.measure == MeasureSettings(tuple(defaults.auto_tune_tokens), defaults.auto_tune_reps, None)
        assert f"legal tails {list(candidates)}" in decision.reason
    else:
        assert not tail.pending and tail.measure is None
        assert tuple(t.tail for t in decision.plan.tiers) == plan
    for part in reasons:
        assert part in decision.reason or part in tail.shardability.reason, (part, decision.reason)
    record = decision.to_dict()  # what status() and the logs show
    assert record["choice"] == tail.choice and record["reason"] == decision.reason
    assert record["candidates"] == list(candidates)


@pytest.mark.parametrize(
    ("spec", "model", "message"),
    [
        ({"tp_size": 8, "tail": "sharded"}, {"hidden_size": 132}, "132 % 8 = 4"),
        ({"tp_size": 2, "tail": "sharded"}, {"num_shared_experts": 0}, "no shared experts"),
        ({"tp_size": 1, "tail": "sharded"}, {}, "TP size is 1"),
        ({"tp_size": 2, "tail": "overlap", "preshard_up_proj": True}, {}, "it is pre-sharded"),
        ({"tp_size": 2, "tail": "sharded", "sequence_parallel": True}, {}, "cannot run sequence-parallel"),
        ({"tp_size": 3}, {}, "3"),  # 64 intermediate columns do not split 3 ways
        ({"tp_size": 2, "layers": [0]}, {}, "layer 0"),
    ],
    ids=["H%P", "no-shared", "tp1", "preshard-needs-sharded", "sp-forced", "tp3", "dense-layer"],
)
def test_illegal_configs_fail_with_the_reason(spec, model, message):
    with pytest.raises(ValueError) as info:
        one(spec, preset_config("tiny", **model))
    assert message in str(info.value)


def test_decisions_for_a_two_deployment_table():
    decisions = decide(
        [{"name": "prefill", "role": "prefill", "tp_size": 2, "sequence_parallel": True},
         {"name": "decode", "role": "decode", "tp_size": 2, "auto_tune_tokens": [1, 8, 64], "auto_tune_reps": 5}],
        preset_config("tiny"),
    )
    assert list(decisions) == ["prefill", "decode"]
    assert decisions["prefill"].plan.tails == ("sequence_parallel",)
    assert decisions["decode"].tail.measure == MeasureSettings((1, 8, 64), 5, None)
    with pytest.raises(ValueError, match="'decode' repeats"):
        decide([{"name": "decode"}, {"name": "decode"}], preset_config("tiny"))


# -- Serve options: bundles and autoscaling bounds -------------------------------------------


def cluster(gpus_per_node: int = 8, max_workers: int = 2) -> dict:
    return {
        "cluster_name": "t", "provider": {"type": "aws", "region": "x"}, "max_workers": max_workers,
        "head_node_type": "head",
        "available_node_types": {
            "head": {"resources": {"CPU": 8}, "node_config": {}, "max_workers": 0},
            "mi300x": {"resources": {"CPU": 96, "GPU": gpus_per_node, MI300X: gpus_per_node},
                       "node_config": {}, "min_workers": 0, "max_workers": max_workers},
        },
    }


@pytest.mark.parametrize(("tp_size", "capacity"), [(1, 16), (2, 8), (8, 2)])
def test_max_replicas_is_clamped_to_the_mi300x_capacity(tp_size, capacity):
    spec = {"tp_size": tp_size, "autoscaling": {"min_replicas": 1, "max_replicas": 100,
                                               "target_ongoing_requests": 12}}
    d = one(spec, cluster=cluster())
    auto = d.options["autoscaling_config"]
    assert d.capacity.tp_groups == capacity  # 2 nodes x floor(8 GPUs / tp_size)
    assert auto["max_replicas"] == capacity and auto["min_replicas"] == 1
    assert auto["target_ongoing_requests"] == 12
    assert d.options["placement_group_bundles"] == [{"CPU": 1.0}] + [{"GPU": 1}] * tp_size
    assert d.options["placement_group_strategy"] == "STRICT_PACK"
    assert d.to_dict()["autoscaling_config"]["max_replicas"] == capacity
    # Within the capacity the spec's own bound stays.
    spec["autoscaling"]["max_replicas"] = 1
    assert one(spec, cluster=cluster()).options["autoscaling_config"]["max_replicas"] == 1


def test_capacity_from_the_shipped_cluster_yaml():
    spec = {"tp_size": 8, "autoscaling": {"max_replicas": 64}}
    d = one(spec, cluster=ROOT / "cluster.yaml")  # 4 MI300X nodes x 8 GPUs
    assert d.capacity.tp_groups == 4 and d.options["autoscaling_config"]["max_replicas"] == 4
    # The spec's own cluster_config is read when no cluster is given.
    spec["autoscaling"]["cluster_config"] = str(ROOT / "cluster.yaml")
    assert one(spec).options["autoscaling_config"]["max_replicas"] == 4


def test_autoscaling_windows_pass_through():
    spec = {"tp_size": 2, "autoscaling": {"look_back_period_s": 2, "metrics_interval_s": 0.5}}
    auto = one(spec).options["autoscaling_config"]
    assert (auto["look_back_period_s"], auto["metrics_interval_s"]) == (2, 0.5)
    assert "metrics_interval_s" not in one({"autoscaling": {}}).options["autoscaling_config"]  # Ray's 10 s
    with pytest.raises(ValueError, match="look_back_period_s 5.0 must exceed the metrics push interval 10.0"):
        one({"autoscaling": {"look_back_period_s": 5}})


@pytest.mark.parametrize(
    ("spec", "gpus_per_node", "message"),
    [
        ({"tp_size": 8, "num_replicas": 3}, 8, "'moe': num_replicas 3 > 2 TP groups of 8 GPUs"),
        ({"tp_size": 8, "autoscaling": {"min_replicas": 3, "max_replicas": 4}}, 8, "min_replicas 3 > 2 TP groups"),
        ({"tp_size": 8}, 4, "'moe': a TP group of 8 cannot fit on a node with 4 GPUs"),
    ],
)
def test_capacity_errors(spec, gpus_per_node, message):
    with pytest.raises(ValueError, match=message):
        one(spec, cluster=cluster(gpus_per_node=gpus_per_node))


# -- measured plans (pure) -------------------------------------------------------------------


def test_measured_plan_keeps_the_fastest_tail_per_range():
    d = one({"tp_size": 2}).tail
    timings = {"sharded": {1: 3.0, 16: 3.0, 256: 4.0}, "replicated": {1: 2.0, 16: 3.5, 256: 9.0},
               "overlap": {1: 2.5, 16: 2.0, 256: 9.0}, "single_allreduce": {1: 1.0, 16: 5.0, 256: 20.0}}
    plan = measured_plan(d, timings)
    assert [(t.max_tokens, t.tail) for t in plan.tiers] == [(1, "single_allreduce"), (16, "overlap"),
                                                             (None, "sharded")]
    done = d.with_measurement(plan, "measured", 1.0)
    assert not done.pending and done.measured and done.choice == plan.describe()
    assert done.to_dict()["plan_source"] == "measured" and done.to_dict()["measured_at"] == 1.0
    assert done.to_dict()["timings_ms"]["overlap"] == {"1": 2.5, "16": 2.0, "256": 9.0}
    with pytest.raises(ValueError, match="not legal candidates"):
        measured_plan(one({"tp_size": 2}, preset_config("tiny", num_shared_experts=0)).tail, timings)


def test_clock_resolution():
    assert resolve_clock(None) is time.perf_counter
    assert resolve_clock("time:monotonic") is time.monotonic
    assert resolve_clock(f"{__name__}:scripted_clock") is scripted_clock
    for bad, message in [("time.monotonic", "module:callable"), ("nope_module:x", "cannot be imported"),
                         ("time:timezone", "not callable")]:
        with pytest.raises(ValueError, match=message):
            resolve_clock(bad)


def test_measure_settings_validation():
    with pytest.raises(ValueError, match="positive token counts"):
        MeasureSettings((0, 16), 3)
    with pytest.raises(ValueError, match="reps must be >= 1"):
        MeasureSettings((1,), 0)
    with pytest.raises(ValueError):
        DeploymentSpec(auto_tune_tokens=[16, 0])
    assert isinstance(one({"tp_size": 2}).tail, TailDecision)


# -- auto measured on a real TP 2 group ------------------------------------------------------

# Fake costs (ms) per (tail, tokens): a different tail wins each measured token count.
TUNE_TOKENS = [1, 16, 256]
COST_MS = {
    "single_allreduce": {1: 1.0, 16: 6.0, 256: 30.0},
    "overlap": {1: 2.0, 16: 2.0, 256: 12.0},
    "replicated": {1: 2.5, 16: 3.0, 256: 11.0},
    "sharded": {1: 3.0, 16: 4.0, 256: 5.0},
}
EXPECTED_TIERS = [{"max_tokens": 1, "tail": "single_allreduce"}, {"max_tokens": 16, "tail": "overlap"},
                  {"max_tokens": None, "tail": "sharded"}]
_fake_now = [0.0]


def timed_pair() -> tuple[str, int]:
    """The (tail, tokens) being timed: the loop variables of ``time_tails``, the clock's caller."""
    caller = inspect.currentframe().f_back.f_back
    assert caller.f_code.co_name == "time_tails", caller.f_code.co_name
    return caller.f_locals["tail"], caller.f_locals["T"]


def scripted_clock() -> float:
    """Injected tune clock (resolved on the workers): each reading advances by the cost of the
    pair being timed, so every timed sample (one start and one stop reading) is that cost."""
    tail, tokens = timed_pair()
    _fake_now[0] += COST_MS[tail][tokens] / 1e3
    return _fake_now[0]


def test_the_scripted_clock_times_each_pair_at_its_cost(tiny_ckpt):
    """No Ray: the warm-up measurement of one runner, on the scripted clock resolved by name."""
    from moe_runtime.config import LatentMoEConfig
    from moe_runtime.tp.collectives import Collectives
    from moe_runtime.tp.plan import TailPlan
    from moe_runtime.tp.runner import build_rank_runners
    from moe_runtime.tp.tuning import measure_runners

    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    runner = build_rank_runners(tiny_ckpt, cfg, [1], Collectives(), TailPlan.single("replicated", "t"),
                                dtype=torch.float32)[1]
    tails = [t for t in COST_MS if t in runner.legal_tails]
    timings = measure_runners({1: runner}, TUNE_TOKENS, 2, f"{__name__}:{scripted_clock.__name__}", tails)
    assert len(tails) >= 2 and timings.keys() == set(tails)
    for tail in tails:  # float sums of the scripted clock: exact up to rounding
        assert timings[tail] == pytest.approx({T: COST_MS[tail][T] for T in TUNE_TOKENS}, rel=1e-6)


@pytest.fixture(scope="module")
def auto_app(tiny_ckpt, serve_ports):
    from conftest import TEST_APP  # here: the workers import this module for its clock
    from ray import serve

    from deployments.app import build_app
    from deployments.client import MoEClient
    from moe_runtime.checkpoint import load_layer_weights
    from moe_runtime.config import LatentMoEConfig

    metrics_port, http_port = serve_ports.metrics, serve_ports.http
    args = {
        "checkpoint": str(tiny_ckpt), **TEST_APP, "name": "decode", "tp_size": 2, "tail": "auto",
        "auto_tune_tokens": TUNE_TOKENS, "auto_tune_reps": 2,
        "tune_clock": f"tests.test_controller:{scripted_clock.__name__}",
        "max_batch_tokens": 512, "max_tokens_per_request": 1024, "collective_timeout_s": 20,
        "call_margin_s": 10, "health_check_period_s": 2, "graceful_shutdown_timeout_s": 1,
    }
    serve.run(build_app(args), name="ctl", route_prefix="/")
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    yield SimpleNamespace(
        args=args, client=MoEClient("ctl", timeout_s=60), url=f"http://127.0.0.1:{http_port}",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics", cfg=cfg,
        weights=load_layer_weights(tiny_ckpt, cfg, 1, torch.float32),
    )


@pytest.mark.ray
@pytest.mark.slow
def test_auto_serves_each_range_with_its_measured_tail(auto_app):
    from deployments.client import HTTPMoEClient, MoERequestError
    from moe_runtime.layer import moe_forward

    status = auto_app.client.status()["deployments"]["decode"]
    assert status["tail_plan"]["tiers"] == EXPECTED_TIERS
    ctl = status["controller"]
    assert ctl["requested_tail"] == "auto" and ctl["measured"]
    assert ctl["candidates"] == list(ALL_BUT_SP)
    assert ctl["choice"] == "T in [1, 1] -> single_allreduce; T in [2, 16] -> overlap; T in [17, inf] -> sharded"
    assert ctl["reason"].startswith("auto: measured at warm-up on the TP 2 group")
    # Rank 0's timings are exactly the scripted costs (every sample is one cost).
    assert ctl["timings_ms"] == {t: {str(k): v for k, v in c.items()} for t, c in COST_MS.items()}
    # Memory: the planner's bytes per rank (build time) are what each rank reports it holds.
    planned = status["memory"]["planned"]
    assert planned["fits"] and planned["headroom_bytes_per_rank"] > 0 and ctl["memory"] == planned
    assert status["memory"]["resident_bytes_per_rank"] == [planned["weights_bytes_per_rank"]] * 2

    before = dict(status["counters"]["tails"])
    for T, tail in [(1, "single_allreduce"), (9, "overlap"), (16, "overlap"), (17, "sharded"), (300, "sharded")]:
        x = torch.randn(T, auto_app.cfg.hidden_size, generator=torch.Generator().manual_seed(T))
        out = auto_app.client.forward(x, 1)
        torch.testing.assert_close(out, moe_forward(x, auto_app.weights, auto_app.cfg), rtol=1e-5, atol=1e-5)
        tails = auto_app.client.status()["deployments"]["decode"]["counters"]["tails"]
        assert tails.get(tail, 0) == before.get(tail, 0) + 1, (T, tail, tails)
        before = dict(tails)
    with pytest.raises(MoERequestError):  # one client error, for the errors counter
        auto_app.client.forward(torch.zeros(3, auto_app.cfg.hidden_size + 1), 1)

    with HTTPMoEClient(auto_app.url) as http:
        over_http = http.status()["deployments"]["decode"]
    assert over_http["tail_plan"]["tiers"] == EXPECTED_TIERS
    assert over_http["controller"]["timings_ms"]["sharded"]["256"] == 5.0
    assert over_http["memory"]["planned"]["bytes_per_rank_by_part"] == planned["bytes_per_rank_by_part"]


@pytest.mark.ray
@pytest.mark.slow
def test_metrics_reach_the_prometheus_endpoint(auto_app):
    from waiting import wait_until  # here: the workers import this module for its clock

    # Runs after the serving test (same module): forwards, an error and the decision exist.
    wanted = ["ray_moe_forward_latency_ms_bucket", "ray_moe_batch_tokens_bucket", "ray_moe_tail_batches",
              "ray_moe_queued_tokens", "ray_moe_errors", 'ray_moe_tail_plan{', 'tail="single_allreduce"',
              "ray_moe_tail_timing_ms"]
    auto_app.client.forward(torch.randn(4, auto_app.cfg.hidden_size), 1)
    body = ""

    def exported() -> bool:  # the metrics agent exports every few seconds
        nonlocal body
        body = ""
        with urllib.request.urlopen(auto_app.metrics_url, timeout=10) as response:
            body = response.read().decode()
        return all(name in body for name in wanted)

    wait_until(exported, timeout_s=60, every_s=1, ignoring=(OSError,),
               what=lambda: f"every metric exported; missing {[name for name in wanted if name not in body]}")
    plan_lines = [line for line in body.splitlines() if line.startswith("ray_moe_tail_plan{")]
    assert any('deployment="decode"' in line and 'max_tokens="16"' in line and 'tail="overlap"' in line
               for line in plan_lines), plan_lines


@pytest.mark.ray
@pytest.mark.slow
def test_new_replicas_reuse_the_measured_plan_and_remeasure_forces_one(auto_app):
    """Runs last in this module: it kills the replica (Serve starts a new one, the same plan key),
    then redeploys the app with remeasure_tail."""
    import ray
    from ray import serve
    from waiting import wait_until  # here: the workers import this module for its clock

    from deployments.app import build_app
    from deployments.client import MoEClient
    from deployments.cluster import kv

    first = auto_app.client.status()
    ctl = first["deployments"]["decode"]["controller"]
    assert ctl["plan_source"] == "measured" and ctl["measured_at"] > 0
    assert {r["state"] for r in first["warmup"]["decode"]} == {"measured"}
    assert ctl["measure_estimate_s"] is not None  # the planner's estimate, logged at the start
    # A replica killed (no clean-up of its own): its replacement reuses the plan, and the killed
    # replica's warm-up record goes when the replacement starts.
    (record,) = first["warmup"]["decode"]
    ray.kill(ray.get_actor(record["actor"], namespace=record["namespace"]), no_restart=True)

    def replaced() -> dict | None:
        now = MoEClient("ctl", timeout_s=10).status()
        return now if now["deployments"]["decode"].get("replica") not in (None, record["replica"]) else None

    # Any error counts as "not yet" while Serve replaces the replica.
    again = wait_until(replaced, timeout_s=120, what="the killed replica replaced", every_s=0.5,
                       ignoring=(Exception,))
    reused = again["deployments"]["decode"]
    assert reused["controller"]["plan_source"] == "reused"
    assert reused["controller"]["measured_at"] == ctl["measured_at"]  # the first replica's measurement
    assert reused["tail_plan"]["tiers"] == EXPECTED_TIERS and reused["controller"]["timings_ms"] == ctl["timings_ms"]
    assert [(r["replica"], r["state"]) for r in again["warmup"]["decode"]] == [(reused["replica"], "reused")]
    assert len(kv.entries(kv.PROGRESS_PREFIX)) == 1
    # remeasure_tail: the updated replica measures again, and the one it replaced (ended by
    # Serve) took its record with it: three replicas started and two ended, one record is left.
    serve.run(build_app({**auto_app.args, "remeasure_tail": True}), name="ctl", route_prefix="/")
    status = MoEClient("ctl", timeout_s=60).status()
    forced = status["deployments"]["decode"]["controller"]
    assert forced["plan_source"] == "measured" and forced["measured_at"] > ctl["measured_at"]
    assert [r["replica"] for r in status["warmup"]["decode"]] == [status["deployments"]["decode"]["replica"]]
    assert len(kv.entries(kv.PROGRESS_PREFIX)) == 1
