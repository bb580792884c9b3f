"""scripts/bench/real.py end to end on the tiny MXFP4 preset: the fractions and verdicts in its JSON
and on its page follow from its own measurements; its part of docs/benchmarks/real.md is replaced,
the page's hand-written history kept, and its rows of the index follow. No wall-clock threshold."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moe_runtime.config import LatentMoEConfig
from scripts.bench import real as bench_real

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_real_measures_and_writes_its_section(make_ckpt, tmp_path: Path) -> None:
    ckpt = make_ckpt(mxfp4=True)
    docs = tmp_path / "pages"
    shutil.copytree(REPO / "docs/benchmarks", docs)
    original = (docs / "real.md").read_text()
    out = tmp_path / "out"
    assert bench_real.main(["--checkpoint", str(ckpt), "--tp", "1", "2", "--tokens", "1", "16", "512",
                            "--reps", "1", "--out", str(out), "--docs", str(docs)]) == 0
    res = json.loads((out / "real.json").read_text())
    assert (out / "real.png").is_file()
    assert [run["P"] for run in res["runs"]] == [1, 2] and len(res["runs"][1]["ranks"]) == 2
    for run in res["runs"]:
        seq = run["sequential_read"]
        # the same files, read whole, kept and into a reused buffer
        assert seq["bytes"] == run["sequential_read_reused"]["bytes"] == res["shard_bytes"]
        ranks = run["ranks"]
        group = sum(r["bytes_read"] for r in ranks) / max(r["load_s"] for r in ranks) / 1e9
        assert run["group_load_gbps"] == pytest.approx(group)
        assert run["load_verdict"] == {"value": pytest.approx(group / seq["gbps"]), "target": ">= 0.5",
                                       "met": group / seq["gbps"] >= 0.5}
        for r in ranks:
            assert r["load_vs_sequential"] == pytest.approx(r["load_gbps"] / seq["gbps"])
            rows = {f["T"]: f for f in r["forward"]}
            assert sorted(rows) == [1, 16, 512]
            for T in (1, 16):
                f = rows[T]
                assert f["memory_bound_fraction"] == pytest.approx(f["memory_bound_ms"] / f["ms"])
            f = rows[512]
            assert f["gemm_fraction"] == pytest.approx(f["gflops"] / f["dense_gemm_gflops"])
            if run["P"] == 1:  # the targets are set at TP 1
                assert rows[1]["verdict"]["met"] == (rows[1]["memory_bound_fraction"] >= 0.25)
                assert rows[16]["verdict"]["met"] == (rows[16]["memory_bound_fraction"] >= 0.25)
                assert f["verdict"]["met"] == (f["gemm_fraction"] >= 0.5)
            else:  # recorded per rank and for the group (ranks share the memory bus), not judged
                assert all("verdict" not in g for g in rows.values())
        if run["P"] > 1:
            for T_rows in zip(*(r["forward"] for r in ranks), strict=True):
                want = sum(f["memory_bound_ms"] for f in T_rows) / max(f["ms"] for f in T_rows)
                assert all(f["group_memory_bound_fraction"] == pytest.approx(want) for f in T_rows)
    assert [c["P"] for c in res["tp_vs_tp1"]] == [2] and res["tp_vs_tp1"][0]["ok"]
    text = (docs / "real.md").read_text()
    # the new run took the old one's place between its markers; the hand-written history after it stayed
    begin, end = "<!-- bench:real begin -->", "<!-- bench:real end -->"
    assert text.count(bench_real.SECTION) == 1 and text.count(begin) == text.count(end) == 1
    section = text[text.index(begin):text.index(end)]
    assert bench_real.SECTION in section and text.startswith(begin)
    assert text[text.index(end):] == original[original.index(end):]
    for run in res["runs"]:
        v = run["load_verdict"]
        assert (f"- load GB/s / kept sequential read, TP {run['P']} group >= 0.5: {v['value']:.2f} "
                f"({'met' if v['met'] else '**missed**'})") in section
    index = (docs / "README.md").read_text()
    ours = [line for line in index.splitlines() if line.startswith("| [real](real.md) |")]
    assert len(ours) == len(bench_real.index_rows(res)) == 2 + 3  # a load row per TP, three TP 1 forwards
    assert all(f"| {res['machine']['date'][:10]} |" in line for line in ours)
    assert "| [tail](tail.md) |" in index  # the other benchmarks' rows stay


def test_forward_gemms_count_the_layer_flops(make_ckpt) -> None:
    """The GEMM list's flops are the layer's: router, latent down, 6 D I_l per token-slot in the
    experts, the shared experts, and the up projection (H / P rows under the sharded tail)."""
    cfg = LatentMoEConfig.from_pretrained(make_ckpt())
    H, D, E, K, I, Is = 128, 64, 8, 2, 64, 64

    class Runner:  # what forward_gemms reads of a runner
        def __init__(self, world: int, tail: str):
            self.shard = type("Shard", (), {"world": world})()
            self.plan = type("Plan", (), {"tail_for": staticmethod(lambda T: tail)})()

    for world, tail in ((1, "replicated"), (2, "sharded"), (2, "single_allreduce")):
        T, active = 33, 5
        gemms = bench_real.forward_gemms(cfg, Runner(world, tail), T, active)
        up_rows = H // world if tail == "sharded" else H
        expected = 2 * T * (E * H + D * H + 3 * (Is // world) * H + up_rows * D) + 6 * D * (I // world) * T * K
        assert sum(g.flops for g in gemms) == expected
        experts = [g for g in gemms if g.name.startswith("experts")]
        assert {g.count for g in experts} == {active} and {g.m for g in experts} == {round(T * K / active)}
