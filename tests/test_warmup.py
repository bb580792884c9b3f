"""Warm-up decisions without a cluster: the plan key, the fallback above the measured counts,
and the limit on what is measured."""

from __future__ import annotations

from dataclasses import replace

from deployments.config.resolve import resolve_deployment
from deployments.config.spec import DeploymentSpec
from deployments.control.accelerator import Accelerator
from deployments.control.decide import decide, measured_plan
from deployments.control.warmup import code_version, plan_key, plan_key_fields
from moe_runtime.config import LatentMoEConfig
from moe_runtime.tp.plan import TailPlan, TailTier

GPU = Accelerator("gpu", "gpu", "test")


def fields(resolved, accelerator=GPU, counts=(1, 16), reps=3, clock=None):
    return plan_key_fields(resolved, accelerator, ("sharded", "replicated"), counts, reps, clock)


def test_the_plan_key_changes_with_what_determines_the_plan(tiny_ckpt):
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    base = resolve_deployment(DeploymentSpec(tp_size=2), str(tiny_ckpt), cfg)
    key = plan_key(fields(base))
    assert key == plan_key(fields(base))  # stable
    assert code_version() == code_version() and len(code_version()) == 16
    others = [
        fields(resolve_deployment(DeploymentSpec(tp_size=2, dtype="bfloat16"), str(tiny_ckpt), cfg)),
        fields(resolve_deployment(DeploymentSpec(tp_size=2, layers=[1]), str(tiny_ckpt), cfg)),
        fields(resolve_deployment(DeploymentSpec(tp_size=1), str(tiny_ckpt), cfg)),
        fields(base, accelerator=Accelerator("gpu", "cpu", "logical")),
        fields(base, counts=(1,)), fields(base, reps=2), fields(base, clock="time:monotonic"),
    ]
    assert len({key, *(plan_key(f) for f in others)}) == 1 + len(others)
    touched = fields(base)
    touched["checkpoint"]["config_sha256"] = "0" * 64  # another config.json
    assert plan_key(touched) != key


def test_unmeasured_counts_fall_back_to_the_rule_based_tail(tiny_ckpt):
    d = decide([{"tp_size": 2}], LatentMoEConfig.from_pretrained(tiny_ckpt))["moe"].tail
    assert d.pending and d.plan.tails == ("sharded",)  # the static rule
    timings = {"sharded": {1: 3.0}, "replicated": {1: 2.0}, "overlap": {1: 2.5}, "single_allreduce": {1: 1.0}}
    plan = measured_plan(d, timings, unmeasured=[16, 128])
    assert [(t.max_tokens, t.tail) for t in plan.tiers] == [(1, "single_allreduce"), (None, "sharded")]
    assert "above T = 1: sharded (T = [16, 128] not measured within warmup_limit_s)" in plan.reason
    # Measured up to the top: no fallback tier.
    full = measured_plan(replace(d, bound=None), timings)
    assert [(t.max_tokens, t.tail) for t in full.tiers] == [(None, "single_allreduce")]


def test_plans_round_trip_through_json():
    plan = TailPlan((TailTier(16, "overlap"), TailTier(None, "sharded")), "r", {"sharded": {1: 2.0, 16: 3.5}})
    import json

    again = TailPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.timings_ms == plan.timings_ms
