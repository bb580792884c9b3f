"""scripts/bench/dataplane.py's verdicts come from the data, and scripts/bench/floor.py's echo keeps
its peers in step."""

from __future__ import annotations


def results(session_rate: float = 200.0, valid: bool = True, own: bool = True) -> dict:
    def row(mode: str, workers: int, tokens: int, rate: float, **extra) -> dict:
        return {"mode": mode, "workers": workers, "tokens": tokens, "worker_steps_per_s": rate, **extra}

    session = {"forwards_per_step": 3.0, "exact": valid, "on_session": True, "valid": valid}
    rows = [row("session", 1, 1, 50.0, **session), row("session", 4, 4, session_rate, **session)]
    if own:
        rows.append(row("own_sessions", 4, 4, 80.0))
    return {"layers": 3, "tokens": [1, 4], "rows": rows,
            "calls": {str(T): {"lane": {"p50_ms": 2.0 + T, "p90_ms": 3.0 + T}, "inprocess_ms": 1.7 + T,
                               "paired_ms": [0.2, 0.3, 0.4], "over_inprocess_ms": 0.3, "exact": True,
                               "on_lane": True} for T in (1, 4)},
            "call_floor": {str(T): {"p50_ms": 0.1} for T in (1, 4)}}


def test_dataplane_verdicts_come_from_the_rows() -> None:
    from scripts.bench import dataplane as bench_dataplane

    v = bench_dataplane.verdicts(results())
    assert abs(v["call_over_inprocess"]["value"] - 0.3) < 1e-9 and v["call_over_inprocess"]["met"]
    assert v["m4_vs_own_sessions"]["value"] == 2.5 and v["m4_vs_own_sessions"]["met"]
    assert v["forwards_per_step"]["met"] and v["exact"]["met"]
    slow = bench_dataplane.verdicts(results(session_rate=100.0))
    assert not slow["m4_vs_own_sessions"]["met"]


def test_dataplane_verdicts_say_what_was_not_measured_or_not_valid() -> None:
    from scripts.bench import dataplane as bench_dataplane

    v = bench_dataplane.verdicts(results(own=False))
    assert v["m4_vs_own_sessions"]["value"] is None and v["m4_vs_own_sessions"]["met"] is None
    assert bench_dataplane.index_rows(results(own=False))[1].met is None  # the index says "not measured"
    bad = bench_dataplane.verdicts(results(valid=False))  # fast but wrong: no target met
    assert bad["m4_vs_own_sessions"]["value"] == 2.5 and bad["m4_vs_own_sessions"]["met"] is False
    assert bad["exact"]["met"] is False


def test_echo_floor_keeps_its_peers_in_step() -> None:
    from scripts.bench.floor import echo_floor

    floor = echo_floor(3, 2, hidden=8, layers=2, ranks=2, min_steps=4, warmup=1)
    assert [len(steps) for steps in floor.steps] == [4, 4, 4]
    assert all(s > 0 for steps in floor.steps for s in steps)
