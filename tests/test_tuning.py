"""Measured tail plans: the fastest tail per token count becomes a tier (fake clock, no noise)."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.config import LatentMoEConfig
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.plan import TailPlan, TailTier, plan_from_timings
from moe_runtime.tp.runner import build_rank_runners
from moe_runtime.tp.tuning import time_tails


def test_plan_from_timings_merges_neighbouring_winners():
    timings = {
        "single_allreduce": {1: 1.0, 16: 2.0, 256: 9.0, 2048: 80.0},
        "sharded": {1: 3.0, 16: 4.0, 256: 5.0, 2048: 40.0},
        "replicated": {1: 3.5, 16: 4.5, 256: 8.0, 2048: 70.0},
    }
    plan = plan_from_timings(timings)
    assert plan.tiers == (TailTier(16, "single_allreduce"), TailTier(None, "sharded"))
    assert [plan.tail_for(T) for T in (1, 16, 17, 10_000)] == ["single_allreduce"] * 2 + ["sharded"] * 2
    assert "T=256: sharded 5.00 ms" in plan.reason
    assert plan.to_dict()["timings_ms"]["sharded"][2048] == 40.0


def test_plan_from_timings_rejects_gaps_and_empty():
    with pytest.raises(ValueError, match="no timings"):
        plan_from_timings({})
    with pytest.raises(ValueError, match="missing"):
        plan_from_timings({"sharded": {1: 1.0, 16: 1.0}, "replicated": {1: 2.0}})


class FakeClock:
    """Advances only when a tail runs, by a cost chosen per (tail, T)."""

    def __init__(self, cost):
        self.now, self.cost = 0.0, cost

    def __call__(self) -> float:
        return self.now


def test_time_tails_with_injected_clock(tiny_ckpt, monkeypatch):
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    runner = build_rank_runners(tiny_ckpt, cfg, [1], Collectives(), TailPlan.single("replicated", "t"),
                                dtype=torch.float32)[1]
    cost = {("overlap", 1): 1e-3, ("overlap", 64): 9e-3, ("replicated", 1): 2e-3,
            ("replicated", 64): 3e-3, ("single_allreduce", 1): 5e-3, ("single_allreduce", 64): 5e-3}
    clock = FakeClock(cost)
    real = runner.apply_tail

    def timed(tail, L, S, dtype):
        clock.now += cost[(tail, L.shape[0])]
        return real(tail, L, S, dtype)

    monkeypatch.setattr(runner, "apply_tail", timed)
    timings = time_tails(runner, [1, 64], reps=3, clock=clock)
    expected = {t: {1: cost[(t, 1)] * 1e3, 64: cost[(t, 64)] * 1e3} for t in ("replicated", "overlap", "single_allreduce")}
    assert timings.keys() == expected.keys()
    for tail, per_t in expected.items():  # float sums of the fake clock: exact up to rounding
        assert timings[tail] == pytest.approx(per_t, rel=1e-9)
    plan = plan_from_timings(timings)
    runner.set_plan(plan)
    assert plan.tiers == (TailTier(1, "overlap"), TailTier(None, "replicated"))
    x = torch.randn(64, cfg.hidden_size)
    runner.forward(x)
    assert runner.last_tail == "replicated"
    with pytest.raises(ValueError, match="illegal here"):
        runner.set_plan(TailPlan.single("sharded", "forced"))
