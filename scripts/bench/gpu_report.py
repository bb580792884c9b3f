"""scripts/gpu_check.sh's verdict and record of one run (OUT_DIR); no GPU or torch needed here.

    python -m scripts.bench.gpu_report OUT_DIR [--smoke] --summary NAME:RC:SECONDS:LIMIT ...
    python -m scripts.bench.gpu_report OUT_DIR [--docs docs/benchmarks] [--json PATH]

``--summary``: gpu_check.sh's last command, whose exit status is the script's (:func:`summarize`).
Without it: the combined JSON (``--json``), a plot of the experts timings beside it, and the
``gpu_check`` page and index rows in ``--docs`` ('' skips them), every number from the record.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

from . import ROOT, harness
from .docs import Target, load_label, publish, repo_relative, table, target, verdict, verdict_text, yes_no
from .rows import read_rows

HEADING = "# GPU check (scripts/gpu_check.sh)"
NAME = "gpu_check"  # its page: docs/benchmarks/gpu_check.md
COMMAND = "`scripts/gpu_check.sh OUT` then `python -m scripts.bench.gpu_report OUT`"
TIMING_STAGES = ("experts", "collectives", "tail")
RECORD_STAGES = ("vllm_kimi", "vllm_graphs")  # each writes NAME.json: status passed/failed/skipped, reason


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def junit_counts(path: Path) -> dict[str, Any] | None:
    """tests / failures / errors / skipped / passed of a pytest junit file and the skips' reasons."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts: dict[str, Any] = {k: sum(int(s.get(k, 0)) for s in suites)
                              for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["skip_reasons"] = dict(Counter(s.get("message", "") for s in root.iter("skipped")))
    return counts


def collect(out: Path) -> dict[str, Any]:
    """The JSON files of the run in ``out``, its GPU tests' junit counts and each timing stage's rows."""
    record: dict[str, Any] = {"source": repo_relative(out.resolve())}
    for name in ("environment", "summary", *RECORD_STAGES):
        record[name] = read_json(out / f"{name}.json")
    record["gpu_tests"] = junit_counts(out / "gpu_tests.xml")
    for name in TIMING_STAGES:
        path = out / f"{name}.jsonl"
        record[name] = None
        if path.exists():
            header, rows, done = read_rows(path)
            record[name] = {"header": header, "rows": rows, "done": done, "complete": done is not None,
                            "skipped": header.get("skipped")}
    return record


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
    """``summary.json`` from the stages' NAME:RC:SECONDS:LIMIT and what they wrote under ``out``: passed
    when every stage exited 0 and, unless ``smoke``, torch saw a GPU and a GPU-marked test ran;
    ``problems`` says why not. A vLLM stage whose own record says skipped is listed under ``skipped``;
    one that says failed, or wrote none, is a problem."""
    record = collect(out)
    summary: dict[str, Any] = {"cpu_smoke": smoke, "stages": {}, "skipped": []}
    for item in stages:
        name, rc, seconds, limit = item.split(":")
        summary["stages"][name] = {"exit": int(rc), "seconds": int(seconds), "limit_s": int(limit),
                                   "timed_out": int(rc) in (124, 137)}
    if record["gpu_tests"] is not None:
        summary["gpu_tests"] = record["gpu_tests"]
    for name in TIMING_STAGES:
        if stage := record[name]:
            summary["stages"].setdefault(name, {}).update(
                rows=len(stage["rows"]), complete=stage["complete"], skipped=stage["skipped"])
    problems = [f"stage {n} exited {s['exit']}" + (" (time limit)" if s["timed_out"] else "")
                for n, s in summary["stages"].items() if s.get("exit", 0) != 0]
    for name in RECORD_STAGES:
        if (stage := summary["stages"].get(name)) is None:
            continue
        if (result := record[name]) is None:
            problems.append(f"stage {name} wrote no {name}.json")
            continue
        stage.update(result=result["status"], reason=result["reason"])
        if result["status"] == "skipped":
            summary["skipped"].append(f"{name}: {result['reason']}")
        elif result["status"] != "passed":
            problems.append(f"stage {name} {result['status']}: {result['reason']}")
    if not smoke:
        problems += gpu_problems(record["environment"], record["gpu_tests"])
    summary.update(problems=problems, passed=not problems,
                   total_seconds=sum(s.get("seconds", 0) for s in summary["stages"].values()))
    return summary


def experts_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    return (record.get("experts") or {}).get("rows", [])


def plot(record: dict[str, Any], path: Path) -> None:
    rows = experts_rows(record)
    fig, ax = harness.pyplot().subplots(figsize=(6, 3.6))
    for fmt in dict.fromkeys(r["format"] for r in rows):
        sub = [r for r in rows if r["format"] == fmt]
        for backend, style in (("torch", "--"), ("grouped", "-")):
            ax.plot([r["T"] for r in sub], [r[backend]["median_ms"] for r in sub], style, marker="o",
                    markersize=3, label=f"{backend}, {fmt}")
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="tokens T", ylabel="median ms")
    ax.set_title(f"routed experts, {gpus_text(record)}", fontsize=10)
    if rows:
        ax.legend(fontsize=7)
    harness.save_figure(fig, path, dpi=80)


def size(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    kib = nbytes / 1024
    return f"{kib:.1f} KiB" if kib < 1024 else f"{kib / 1024:.1f} MiB"


def extremes(rows: list[dict[str, Any]], key: str, fmt: str = ".2f") -> str:
    lo, hi = min(rows, key=lambda r: r[key]), max(rows, key=lambda r: r[key])
    return f"{lo[key]:{fmt}}x (T = {lo['T']}) to {hi[key]:{fmt}}x (T = {hi['T']})"


def machine_of(record: dict[str, Any]) -> dict[str, Any]:
    return (record.get("experts") or {}).get("header", {}).get("machine", {})


def gpus_text(record: dict[str, Any]) -> str:
    gpus = (record.get("environment") or {}).get("gpus") or []
    return f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU"


def experts_verdicts(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    return (verdict(min(r["grouped_speedup"] for r in rows), ">=", 1.0),
            verdict(sum(not r["within_tolerance"] for r in rows), "<=", 0))


def index_rows(record: dict[str, Any]) -> list[Target]:
    rows = [target("gpu_check.sh's verdict: passed", bool((record.get("summary") or {}).get("passed")))]
    if experts := experts_rows(record):
        slowest, outside = experts_verdicts(experts)
        rows += [target("grouped / torch experts speedup, slowest row", slowest),
                 target("experts rows outside the check tolerance", outside, "d")]
    return rows


def opening(record: dict[str, Any], json_path: str, png_path: str) -> str:
    env, summary, machine = record.get("environment") or {}, record.get("summary") or {}, machine_of(record)
    after = ((record.get("experts") or {}).get("done") or {}).get("loadavg")
    runtime = next((f"{k.upper()} {env[k]}" for k in ("cuda", "hip") if env.get(k)), "no CUDA/HIP build")
    load = load_label(machine["loadavg_before"], after, machine["cpus"]) if machine else "no machine record"
    smoke = " (**CPU smoke run**: no GPU timings)" if summary.get("cpu_smoke") else ""
    outcome = ("**passed**" if summary.get("passed")
               else f"**failed**: {'; '.join(summary.get('problems', ['no summary.json']))}")
    return (f"{HEADING}\n\nRun: {COMMAND} -- {machine.get('date', 'date not recorded')}, "
            f"{gpus_text(record)}, "
            f"torch {env.get('torch')}, {runtime}, Python {env.get('python')}{smoke}; {load}. gpu_check.sh's "
            f"verdict (`summary.json`): {outcome}. Raw data: `{json_path}`, plot: `{png_path}`.")


def stages_text(record: dict[str, Any]) -> list[str]:
    summary, tests = record.get("summary") or {}, record.get("gpu_tests")
    lines = table("stage | exit | seconds | limit s | rows | complete", (
        [name, f"{s.get('exit', '-')}{' (time limit)' if s.get('timed_out') else ''}", s.get("seconds", "-"),
         s.get("limit_s", "-"), s.get("rows", ""),
         "" if "complete" not in s else ("yes" if s["complete"] else "**no** (cut off)")]
        for name, s in summary.get("stages", {}).items()), "lrrrrl")
    lines += ["", f"Total {summary.get('total_seconds', '-')} s.", ""]
    if tests is None:
        return [*lines, "GPU tests (`tests/test_gpu.py`): no junit file."]
    skips = "; ".join(f"{n} x {reason}" for reason, n in tests["skip_reasons"].items())
    return [*lines, f"GPU tests (`tests/test_gpu.py`): {tests['tests']} collected, **{tests['passed']} "
            f"passed**, {tests['failures']} failed, {tests['errors']} errors, {tests['skipped']} skipped"
            + (f" ({skips})" if skips else "") + "."]


def experts_text(record: dict[str, Any]) -> list[str]:
    stage, rows = record.get("experts"), experts_rows(record)
    if not rows:
        return ["**Experts backends**: no rows measured."]
    s, dtype = stage["header"]["shape"], stage["header"].get("dtype")
    reps = sorted({r[b]["reps"] for r in rows for b in ("torch", "grouped")})
    slowest, outside = experts_verdicts(rows)
    lines = [
        f"**Experts backends `torch` vs `grouped`** ({dtype}, one rank's shapes at TP "
        f"{s['P']}: D = {s['D']}, E = {s['E']}, K = {s['K']}, I = {s['I']} / {s['P']} = {s['I_local']}; "
        f"synthetic random weights and top-K routing; medians of {reps[0]}-{reps[-1]} calls"
        f"{'' if stage['complete'] else '; **stage cut off**, rows measured so far'}).", "",
        *table("format | T | active experts | torch ms | grouped ms | speedup | rel diff | within tolerance",
               ([r["format"], r["T"], r["active_experts"], f"{r['torch']['median_ms']:.3f}",
                 f"{r['grouped']['median_ms']:.3f}", f"{r['grouped_speedup']:.2f}x",
                 f"{r['grouped_vs_torch_rel_diff']:.1e}", yes_no(r["within_tolerance"])] for r in rows),
               "lrrrrrrl"), "",
        f"- grouped is not slower than torch in every row: lowest speedup {verdict_text(slowest)}.",
        f"- every row within tolerance: rows outside {verdict_text(outside, 'd')}; "
        f"largest rel diff {max(r['grouped_vs_torch_rel_diff'] for r in rows):.1e}.",
        *(f"- {fmt}: speedup {extremes([r for r in rows if r['format'] == fmt], 'grouped_speedup')}."
          for fmt in dict.fromkeys(r["format"] for r in rows))]
    grouped = {(r["format"], r["T"]): r["grouped"]["median_ms"] for r in rows}
    if both := [{"T": T, "ratio": grouped["mxfp4", T] / grouped["dense", T]}
                for f, T in grouped if f == "dense" and ("mxfp4", T) in grouped]:
        hi = max(both, key=lambda r: r["ratio"])["T"]
        lines.append(f"- grouped mxfp4 / grouped dense ms: {extremes(both, 'ratio', '.1f')}; "
                     f"mxfp4 is slowest relative to dense at T = {hi}.")
    return lines


def collectives_text(record: dict[str, Any]) -> list[str]:
    stage = record.get("collectives")
    if not stage or not stage["rows"]:
        return ["**Latent collectives**: no rows measured."]
    h, rows = stage["header"], stage["rows"]
    note = f": {h['note']}" if h.get("note") else ""
    nbytes = [r["bytes"] for r in rows]
    return [f"**Latent collectives** ({h.get('backend')}, world {h.get('world')}, D = {h.get('D')}{note}).",
            "",
            *table("dtype | T | bytes | all_reduce ms | reduce_scatter ms",
                   ([r["dtype"], r["T"], size(r["bytes"]), f"{r['all_reduce']['median_ms']:.4f}",
                     f"{r['reduce_scatter']['median_ms']:.4f}"] for r in rows), "lrrrr"), "",
            *(f"- {op}: {min(ms):.4f} to {max(ms):.4f} ms over {size(min(nbytes))} to {size(max(nbytes))}."
              for op in ("all_reduce", "reduce_scatter") for ms in [[r[op]["median_ms"] for r in rows]])]


def tail_text(record: dict[str, Any]) -> list[str]:
    stage = record.get("tail")
    if not stage:
        return ["**TP-2 tail**: no tail.jsonl."]
    if stage["skipped"]:
        return [f"**TP-2 tail**: skipped ({stage['skipped']})."]
    return ["**TP-2 tail** against the single-GPU layer:", "",
            *table("tail | T | layer ms | rel diff | within tolerance",
                   ([r["tail"], r["T"], f"{r['layer']['median_ms']:.3f}",
                     f"{r['rel_diff_vs_single_gpu']:.1e}", yes_no(r["within_tolerance"])]
                    for r in stage["rows"]), "lrrrl")]


def markdown(record: dict[str, Any], json_path: str, png_path: str) -> str:
    parts = [[opening(record, json_path, png_path)], stages_text(record), experts_text(record),
             collectives_text(record), tail_text(record)]
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path, help="a scripts/gpu_check.sh output folder")
    ap.add_argument("--summary", nargs="*", metavar="NAME:RC:SECONDS:LIMIT",
                    help="write OUT_DIR/summary.json from these stages; exit 1 when the run failed")
    ap.add_argument("--smoke", action="store_true", help="with --summary: a --cpu-smoke run (no GPU wanted)")
    ap.add_argument("--docs", default=str(harness.PAGES),
                    help="the benchmark pages' folder whose page and index this run rewrites ('' for none)")
    ap.add_argument("--json", type=Path, default=ROOT / "artifacts" / NAME / f"{NAME}.json",
                    help="the combined record (a plot beside it)")
    args = ap.parse_args(argv)
    if args.summary is not None:
        summary = summarize(args.out_dir, args.smoke, args.summary)
        (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary, indent=2))
        for problem in summary["problems"]:
            print(f"FAILED: {problem}", file=sys.stderr)
        return 0 if summary["passed"] else 1
    record = collect(args.out_dir)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    png = args.json.with_suffix(".png")
    plot(record, png)
    section = markdown(record, repo_relative(args.json.resolve()), repo_relative(png.resolve()))
    print(section)
    when = {"date": machine_of(record).get("date", "not recorded")}
    publish(section, NAME, index_rows(record), when, args.docs, machine=gpus_text(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
