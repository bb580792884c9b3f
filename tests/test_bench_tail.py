"""scripts/bench/tail.py on the tiny preset: stage times come from the same replays as the totals.

Every row's stages add up to at most its total (tail, whole layer and routed input alike), the
total is the median of the replays, the routed-input modes carry their deployment names, and the
targets' verdicts follow from the numbers. No wall-clock threshold: only relations between numbers
of one replay.
"""

from __future__ import annotations

import statistics

import pytest

from moe_runtime.tp.local_group import run_local_group  # noqa: E402
from scripts.bench import tail as bench_tail

EPS = 1e-9  # float addition of the stage milliseconds


def _parts_within_whole(total: float, stages: dict[str, float], other: float) -> None:
    assert stages, "no stage was timed"
    assert all(v >= 0 for v in stages.values())
    assert sum(stages.values()) <= total + EPS, (stages, total)
    assert other == pytest.approx(total - sum(stages.values()), abs=EPS) and other >= -EPS


@pytest.mark.parametrize("P", [1, 2])
def test_stages_come_from_the_replays_of_their_totals(tiny_ckpt, P: int) -> None:
    res = run_local_group(P, bench_tail._rank_bench, str(tiny_ckpt), [1, 16], "float32", 3, timeout_s=600)
    rows, routed = res[0]["rows"], res[0]["routed_input"]
    assert {r["T"] for r in rows} == {1, 16}
    for r in rows:
        _parts_within_whole(r["tail_ms"], r["tail_stages_ms"], r["tail_other_ms"])
        assert r["tail_ms"] in r["tail_all_ms"] and len(r["tail_all_ms"]) == 3
        assert r["tail_ms"] == statistics.median(r["tail_all_ms"])
        if r["layer_ms"] is not None:
            _parts_within_whole(r["layer_ms"], r["layer_stages_ms"], r["layer_other_ms"])
            assert {"down_proj", "experts", "up_proj"} <= set(r["layer_stages_ms"])
        if P > 1:
            assert "collectives" in r["tail_stages_ms"]
    if P == 1:
        assert routed == []
        return
    assert {x["routed_input"] for x in routed} == {"off", "none", "fp8-approx", "mxfp4-approx"}
    for x in routed:
        assert x["down_proj_ms"] + x["gather_ms"] <= x["total_ms"] + EPS
        assert x["other_ms"] >= -EPS


class _FakeTimer:
    """The runner's StageTimer as bench_tail drives it, with scripted stage times."""

    def __init__(self) -> None:
        self.enabled, self.totals = False, {}

    def sync(self) -> None:
        pass

    def start(self) -> None:
        pass


def test_timed_replays_reports_the_median_replay_and_its_own_stages(monkeypatch) -> None:
    """A scripted clock: each replay takes its scripted total, of which its "collectives" stage
    is part, so the verdict never depends on how fast this machine runs the fake replay."""
    class Runner:
        timer = _FakeTimer()

    now = [0.0]
    monkeypatch.setattr(bench_tail.time, "perf_counter", lambda: now[0])
    scripted = iter([(None, 0.0), (5.0, 9.0), (1.0, 4.0), (3.0, 6.0)])  # warm-up, three replays: stage, total (ms)

    def replay() -> None:
        stage_ms, total_ms = next(scripted)
        now[0] += total_ms / 1e3
        if Runner.timer.enabled and stage_ms is not None:
            Runner.timer.totals["collectives"] = stage_ms / 1e3

    t = bench_tail.timed_replays({"one": (Runner(), replay)}, 3)["one"]
    assert t["all_ms"] == pytest.approx([9.0, 4.0, 6.0])
    assert t["ms"] == pytest.approx(6.0)  # the median replay by total ...
    assert t["stages_ms"] == pytest.approx({"collectives": 3.0})  # ... with its own stages
    assert t["other_ms"] == pytest.approx(3.0)
    assert not Runner.timer.enabled and Runner.timer.totals == {}


def test_timed_replays_replay_the_calls_in_turns() -> None:
    """Every call once, then round by round: a load spike lands on one replay of each, not on one
    call's whole block."""
    class Runner:
        timer = _FakeTimer()

    calls = []
    t = bench_tail.timed_replays({name: (Runner(), lambda n=name: calls.append(n)) for name in "ab"}, 3)
    assert calls == ["a", "b"] * 4 and set(t) == {"a", "b"} and len(t["a"]["all_ms"]) == 3


def test_targets_are_the_median_of_the_rounds_with_the_bound_as_written() -> None:
    rounds = [{"r": bench_tail.verdict(v, "<", 1), "s": bench_tail.verdict(v, ">=", 1.6)} for v in (0.5, 1.7, 0.6)]
    assert bench_tail.median_targets(rounds) == {"r": {"value": 0.6, "target": "< 1", "met": True},
                                                 "s": {"value": 0.6, "target": ">= 1.6", "met": False}}


def test_targets_and_routed_input_names_in_the_section() -> None:
    def row(P, T, tail, ms):
        return {"P": P, "T": T, "tail": tail, "tail_ms": ms, "tail_stages_ms": {"collectives": ms / 2,
                "up_proj": ms / 4}, "tail_other_ms": ms / 4, "layer_ms": None, "layer_stages_ms": {},
                "layer_other_ms": None, "collective_bytes_per_token": 6144.0}

    rows = [row(2, 2048, "sharded", 7.0), row(2, 2048, "replicated", 10.0),
            row(2, 1, "single_allreduce", 3.0), row(2, 1, "replicated", 2.0)]
    routed = [{"P": 2, "T": 2048, "routed_input": q, "total_ms": 9.0, "down_proj_ms": d, "gather_ms": 1.0,
               "other_ms": 0.1} for q, d in (("off", 8.0), ("none", 4.0), ("fp8-approx", 4.0),
                                             ("mxfp4-approx", 4.0))]
    targets = bench_tail.compute_targets(rows, routed, [2], [1, 2048])
    assert targets["P2_T2048_sharded_over_replicated"] == {"value": 0.7, "target": "<= 0.75", "met": True}
    assert targets["P2_T1_single_allreduce_over_replicated"]["met"] is False
    assert targets["P2_T2048_down_proj_speedup"]["value"] == 2.0
    result = {"argv": ["--tp", "2"], "preset": "tiny", "tp": [2], "dtype": "float32", "rows": rows,
              "routed_input": routed, "crossovers": bench_tail._crossovers(rows), "targets": targets,
              "machine": {"date": "d", "cpus": 2, "torch": "t", "loadavg_before": [3.0, 2.0, 1.0],
                          "loadavg_after": [1.0, 1.0, 1.0]},
              "model": {"hidden_size": 128, "routed_expert_hidden_size": 64, "num_experts": 8,
                        "num_experts_per_token": 2, "moe_intermediate_size": 64, "num_shared_experts": 1}}
    md = bench_tail.markdown(result, "a.json", "a.png")
    assert "| 2 | 2048 | fp8-approx |" in md and "| 2 | 2048 | mxfp4-approx |" in md
    assert "| fp8 |" not in md and "| mxfp4 |" not in md
    assert "0.70** (target <= 0.75: met)" in md and "(target < 1: **missed**)" in md
    assert "**contended**" in md  # load 3.0 on 2 CPUs before the run
