"""scripts/bench/gpu_report.py on a fake gpu_check.sh folder: the combined JSON, the plot, and a docs section
whose numbers and verdicts follow from the rows (a row where grouped is slower than torch misses)."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.bench import gpu_report

MACHINE = {"date": "2026-01-02 03:04 UTC", "cpus": 16, "torch": "2.11.0", "loadavg_before": [0.5, 0.4, 0.3]}
SKIP = "aiter: aiter needs a ROCm GPU; this process has none"


def ms(median: float) -> dict:
    return {"median_ms": median, "min_ms": median, "reps": 10}


def expert_row(fmt: str, T: int, torch_ms: float, grouped_ms: float) -> dict:
    return {"record": "row", "format": fmt, "T": T, "active_experts": 16 * T, "torch": ms(torch_ms),
            "grouped": ms(grouped_ms),
            "grouped_vs_torch_rel_diff": 1e-3, "grouped_speedup": torch_ms / grouped_ms, "within_tolerance": True}


def write_jsonl(path: Path, header: dict, rows: list[dict]) -> None:
    records = [{"record": "header", **header, "loadavg": [0.5, 0.4, 0.3]}, *rows,
               {"record": "done", "loadavg": [0.6, 0.4, 0.3]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def fake_check(out: Path, dense_grouped_ms: float = 1.0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "environment.json").write_text(json.dumps(
        {"python": "3.12.3", "torch": "2.11.0", "cuda": "13.0", "hip": None, "cuda_available": True,
         "gpus": ["NVIDIA H200"]}))
    stages = {n: {"exit": 0, "seconds": 5, "limit_s": 60, "timed_out": False} for n in ("environment", "experts")}
    (out / "summary.json").write_text(json.dumps(
        {"cpu_smoke": False, "stages": stages, "problems": [], "passed": True, "total_seconds": 10}))
    (out / "gpu_tests.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0" '
        'skipped="1" tests="2" time="1.0"><testcase classname="t" name="a"/><testcase classname="t" name="b">'
        f'<skipped type="pytest.skip" message="{SKIP}">x</skipped></testcase></testsuite></testsuites>')
    shape = {"D": 64, "E": 8, "K": 2, "I": 64, "P": 1, "I_local": 64}
    write_jsonl(out / "experts.jsonl", {"what": "experts", "shape": shape, "dtype": "bfloat16", "machine": MACHINE},
                [expert_row("dense", 16, 4.0, dense_grouped_ms), expert_row("mxfp4", 16, 12.0, 3.0)])
    coll = {"dtype": "bfloat16", "T": 16, "bytes": 2048, "all_reduce": ms(0.25),
            "reduce_scatter": ms(0.5), "all_reduce_bus_GBps": 0.0}
    write_jsonl(out / "collectives.jsonl", {"what": "collectives", "world": 1, "backend": "nccl", "D": 64,
                                            "note": "a world of one: launch overhead only", "machine": MACHINE},
                [{"record": "row", **coll}])
    write_jsonl(out / "tail.jsonl", {"what": "tail", "skipped": "1 GPU(s): the TP-2 tail needs two"}, [])
    return out


def report(tmp_path: Path, out: Path) -> tuple[str, dict]:
    pages, record = tmp_path / "pages", tmp_path / "gpu_check.json"
    pages.mkdir()
    (pages / "gpu_check.md").write_text("<!-- bench:gpu_check begin -->\n<!-- bench:gpu_check end -->\n\n"
                                        "## An earlier run\n\nKept.\n")
    assert gpu_report.main([str(out), "--docs", str(pages), "--json", str(record)]) == 0
    assert record.with_suffix(".png").stat().st_size > 0
    return (pages / "gpu_check.md").read_text(), json.loads(record.read_text())


def test_section_and_record_follow_from_the_rows(tmp_path: Path) -> None:
    text, record = report(tmp_path, fake_check(tmp_path / "run"))
    assert record["gpu_tests"] == {"tests": 2, "failures": 0, "errors": 0, "skipped": 1, "passed": 1,
                                   "skip_reasons": {SKIP: 1}}
    assert [r["T"] for r in record["experts"]["rows"]] == [16, 16] and record["collectives"]["complete"]
    assert text.startswith("<!-- bench:gpu_check begin -->\n") and text.endswith("## An earlier run\n\nKept.\n")
    assert "# GPU check (scripts/gpu_check.sh)" in text and "1 x NVIDIA H200" in text and "CUDA 13.0" in text
    assert f"**1 passed**, 0 failed, 0 errors, 1 skipped (1 x {SKIP})" in text
    assert "| dense | 16 | 256 | 4.000 | 1.000 | 4.00x | 1.0e-03 | yes |" in text
    assert "lowest speedup **4.00** (target >= 1.0: met)" in text  # min(4 / 1, 12 / 3)
    index = (tmp_path / "pages" / "README.md").read_text()
    assert ("| [gpu_check](gpu_check.md) | grouped / torch experts speedup, slowest row >= 1.0 | 4.00 | met "
            "| 2026-01-02 | 1 x NVIDIA H200 |") in index
    assert "rows outside **0** (target <= 0: met)" in text
    assert "grouped mxfp4 / grouped dense ms: 3.0x (T = 16) to 3.0x (T = 16)" in text
    assert "| bfloat16 | 16 | 2.0 KiB | 0.2500 | 0.5000 |" in text and "launch overhead only" in text
    assert "**TP-2 tail**: skipped (1 GPU(s): the TP-2 tail needs two)" in text


def test_verdict_misses_when_grouped_is_slower_than_torch(tmp_path: Path) -> None:
    text, _ = report(tmp_path, fake_check(tmp_path / "run", dense_grouped_ms=5.0))
    assert "lowest speedup **0.80** (target >= 1.0: **missed**)" in text
    assert text.count("<!-- bench:gpu_check begin -->") == 1
