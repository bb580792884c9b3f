"""scripts/gpu_check.sh's verdict and its timings files, on the CPU.

* ``gpu_report.py --summary`` (what gpu_check.sh runs last, its exit status the script's): a run that
  saw no GPU, or whose GPU-marked tests all skipped, fails unless it is a ``--cpu-smoke`` run;
  checked on fake result folders through the same command line.
* ``gpu_timings.py`` writes each point as it is measured (JSON lines): a stage interrupted after
  some points keeps them, and the summary reports the file as partial.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench import gpu_timings
from scripts.bench.rows import RowWriter, read_rows

ROOT = Path(__file__).resolve().parents[1]

OK_STAGES = ["environment:0:3:30", "gpu_tests:0:5:110", "experts:0:9:180", "collectives:0:4:60",
             "tail:0:6:90"]


def fake_run(out: Path, gpu: bool, tests: int | None, skipped: int = 0) -> Path:
    """A gpu_check.sh result folder: environment.json, and the GPU tests' junit file unless None."""
    out.mkdir(parents=True, exist_ok=True)
    env = {"torch": "2.9.1", "cuda_available": gpu, "gpus": ["AMD Instinct MI300X"] * 8 if gpu else []}
    (out / "environment.json").write_text(json.dumps(env))
    if tests is not None:
        (out / "gpu_tests.xml").write_text(
            f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" '
            f'failures="0" skipped="{skipped}" tests="{tests}" time="1.0"/></testsuites>')
    return out


def verdict(out: Path, *stages: str, smoke: bool = False) -> tuple[int, dict]:
    smoke_flag = ["--smoke"] if smoke else []
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.gpu_report", str(out), *smoke_flag, "--summary", *stages],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize(
    "gpu, tests, skipped, smoke, passed, problem",
    [
        (True, 10, 3, False, True, None),
        (True, 10, 10, False, False, "every GPU test skipped (10 of 10)"),
        (True, 0, 0, False, False, "no GPU test was collected"),
        (True, None, 0, False, False, "no junit file"),
        (False, 10, 10, False, False, "torch sees no GPU"),
        (False, 10, 10, True, True, None),  # --cpu-smoke: skips are the point
    ],
    ids=["some-ran", "all-skipped", "none-collected", "no-junit", "no-gpu", "cpu-smoke"],
)
def test_summary_fails_a_run_that_checked_nothing_on_a_gpu(tmp_path, gpu, tests, skipped, smoke, passed,
                                                           problem) -> None:
    out = fake_run(tmp_path / "run", gpu, tests, skipped)
    rc, summary = verdict(out, *OK_STAGES, smoke=smoke)
    assert (rc == 0) == passed == summary["passed"]
    if problem:
        assert any(problem in p for p in summary["problems"]), summary["problems"]
    else:
        assert summary["problems"] == []


def test_summary_reports_failed_and_timed_out_stages(tmp_path) -> None:
    out = fake_run(tmp_path / "run", True, 10, 0)
    rc, summary = verdict(out, *OK_STAGES[:2], "experts:124:180:180", *OK_STAGES[3:])
    assert rc == 1 and summary["stages"]["experts"]["timed_out"]
    assert summary["problems"] == ["stage experts exited 124 (time limit)"]


def test_summary_counts_the_rows_of_a_cut_off_stage(tmp_path) -> None:
    out = fake_run(tmp_path / "run", True, 10, 0)
    writer = RowWriter(out / "experts.jsonl", what="experts")
    for T in (1, 2, 4):
        writer.row({"T": T})
    done = RowWriter(out / "tail.jsonl", what="tail", skipped="1 GPU(s): the TP-2 tail needs two")
    done.close()
    rc, summary = verdict(out, *OK_STAGES[:2], "experts:124:180:180", *OK_STAGES[3:])
    assert summary["stages"]["experts"] | {"rows": 3, "complete": False} == summary["stages"]["experts"]
    assert summary["stages"]["tail"]["complete"] and summary["stages"]["tail"]["skipped"]


def test_row_writer_keeps_every_row_on_disk_as_it_goes(tmp_path) -> None:
    path = tmp_path / "rows.jsonl"
    writer = RowWriter(path, what="x", shape={"D": 8})
    header, rows, done = read_rows(path)
    assert header["what"] == "x" and len(header["loadavg"]) == 3 and rows == [] and done is None
    writer.row({"T": 1, "ms": 0.5})
    assert read_rows(path)[1] == [{"T": 1, "ms": 0.5}]  # readable before the writer goes on
    writer.row({"T": 2, "ms": 0.7})
    with path.open("a") as f:
        f.write('{"record": "row", "T": 4, "ms"')  # killed halfway through a line
    header, rows, done = read_rows(path)
    assert [r["T"] for r in rows] == [1, 2] and done is None


def test_experts_stage_interrupted_keeps_the_points_it_measured(tmp_path, monkeypatch) -> None:
    """As when gpu_check.sh's `timeout` stops the stage: the interruption comes at the 5th timing,
    i.e. in the third point (two backends timed per point); the first two points are on disk."""
    real, calls = gpu_timings.median_ms, []

    def median_ms(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # what SIGTERM's default handling amounts to, mid-stage
        return real(*args, **kwargs)

    monkeypatch.setattr(gpu_timings, "median_ms", median_ms)
    out = tmp_path / "experts.jsonl"
    with pytest.raises(KeyboardInterrupt):
        gpu_timings.main(["experts", "--smoke", "--out", str(out), "--reps", "1"])
    header, rows, done = read_rows(out)
    assert header["what"] == "experts" and done is None
    assert [(r["format"], r["T"]) for r in rows] == [("dense", 1), ("dense", 8)]
    assert all(r["within_tolerance"] for r in rows)
    monkeypatch.setattr(gpu_timings, "median_ms", real)
    assert gpu_timings.main(["experts", "--smoke", "--out", str(out), "--reps", "1"]) == 0
    header, rows, done = read_rows(out)  # a complete run: every point and the closing record
    assert len(rows) == 2 * len(gpu_timings.SMOKE_TOKENS) and done is not None


@pytest.mark.parametrize(
    "record, exit_code, passed, problem, skip",
    [
        ({"status": "passed", "reason": None}, 0, True, None, None),
        ({"status": "skipped", "reason": "vLLM is not installed"}, 0, True, None, "vllm_kimi: vLLM is not installed"),
        ({"status": "failed", "reason": "tier engine: boom"}, 1, False, "stage vllm_kimi failed: tier engine: boom",
         None),
        (None, 0, False, "stage vllm_kimi wrote no vllm_kimi.json", None),
    ],
    ids=["passed", "skipped", "failed", "no-record"],
)
def test_summary_counts_a_skipped_kimi_stage_as_a_skip_not_a_pass(tmp_path, record, exit_code, passed, problem,
                                                                  skip) -> None:
    out = fake_run(tmp_path / "run", True, 10, 0)
    if record is not None:
        (out / "vllm_kimi.json").write_text(json.dumps({"stage": "vllm_kimi", **record}))
    rc, summary = verdict(out, *OK_STAGES, f"vllm_kimi:{exit_code}:50:160")
    assert (rc == 0) == passed == summary["passed"]
    assert summary["skipped"] == ([skip] if skip else [])
    assert summary["stages"]["vllm_kimi"].get("result") == (record or {}).get("status")
    if problem:
        assert problem in summary["problems"], summary["problems"]
    else:
        assert summary["problems"] == []
