"""The verdict of scripts/gpu_check.sh: ``summary.json`` from its stages, junit file and row files.

    python -m scripts.bench.gpu_check_summary OUT_DIR [--smoke] NAME:RC:SECONDS:LIMIT ...

Exit 0 only when the run checked something on a GPU: every stage exited 0 and, unless it was a
``--cpu-smoke`` dry run, torch saw a GPU and a GPU-marked test ran (a run whose GPU tests all
skipped fails however green its stages were); ``problems`` says why not. A timing stage's rows are
counted from its JSON-lines file, partial when it lacks its closing record. A stage that writes a
record of its own (``vllm_kimi.json``, ``vllm_graphs.json``) has its ``result`` and ``reason`` in
the summary: skipped (no vLLM, or a smoke run) fails nothing but is listed under ``skipped``;
failed, or no record, is a problem.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from .rows import read_rows

TIMING_STAGES = ("experts", "collectives", "tail")
# stage -> its record: status passed/failed/skipped, reason
RECORD_STAGES = {"vllm_kimi": "vllm_kimi.json", "vllm_graphs": "vllm_graphs.json"}


def junit_counts(path: Path) -> dict[str, int] | None:
    """tests / failures / errors / skipped of a pytest junit file (None when it is missing)."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def gpu_problems(environment: dict[str, Any] | None, tests: dict[str, int] | None) -> list[str]:
    """Why a (non-smoke) run did not check anything on a GPU; empty when it did."""
    problems = []
    if environment is None:
        problems.append("no environment.json: the environment stage did not finish")
    elif not environment.get("cuda_available") or not environment.get("gpus"):
        problems.append("torch sees no GPU (cuda_available "
                        f"{environment.get('cuda_available')}, gpus {environment.get('gpus')})")
    if tests is None:
        problems.append("no junit file from the GPU tests")
    elif tests["tests"] == 0:
        problems.append("no GPU test was collected")
    elif tests["skipped"] >= tests["tests"]:
        problems.append(f"every GPU test skipped ({tests['skipped']} of {tests['tests']}): "
                        "nothing was checked on a GPU")
    return problems


def summarize(out: Path, smoke: bool, stages: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {"cpu_smoke": smoke, "stages": {}, "skipped": []}
    for item in stages:
        name, rc, seconds, limit = item.split(":")
        summary["stages"][name] = {"exit": int(rc), "seconds": int(seconds), "limit_s": int(limit),
                                   "timed_out": int(rc) in (124, 137)}
    tests = junit_counts(out / "gpu_tests.xml")
    if tests is not None:
        summary["gpu_tests"] = tests
    for name in TIMING_STAGES:
        if (path := out / f"{name}.jsonl").exists():
            header, rows, done = read_rows(path)
            summary["stages"].setdefault(name, {}).update(
                rows=len(rows), complete=done is not None, skipped=header.get("skipped"))
    problems = [f"stage {n} exited {s['exit']}" + (" (time limit)" if s["timed_out"] else "")
                for n, s in summary["stages"].items() if s.get("exit", 0) != 0]
    for name, file in RECORD_STAGES.items():
        if (stage := summary["stages"].get(name)) is None:
            continue
        if not (out / file).exists():
            problems.append(f"stage {name} wrote no {file}")
            continue
        record = json.loads((out / file).read_text())
        stage.update(result=record.get("status"), reason=record.get("reason"))
        if record.get("status") == "skipped":
            summary["skipped"].append(f"{name}: {record.get('reason')}")
        elif record.get("status") != "passed":
            problems.append(f"stage {name} {record.get('status')}: {record.get('reason')}")
    if not smoke:
        env_path = out / "environment.json"
        problems += gpu_problems(json.loads(env_path.read_text()) if env_path.exists() else None, tests)
    summary.update(problems=problems, passed=not problems,
                   total_seconds=sum(s.get("seconds", 0) for s in summary["stages"].values()))
    return summary


def main(argv: list[str]) -> int:
    out, rest = Path(argv[0]), argv[1:]
    summary = summarize(out, "--smoke" in rest, [a for a in rest if a and a != "--smoke"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    for problem in summary["problems"]:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
