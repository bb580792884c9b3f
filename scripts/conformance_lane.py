"""Run the vLLM conformance lane's pytest and record its result (``scripts/test.sh --vllm``).

    python scripts/conformance_lane.py [pytest args]      # inside the lane's venv (vllm_env.sh)

Runs ``pytest -q -ra tests/conformance tests/vllm_lane [args]``, streams its output, and for a full run (no
extra args) writes artifacts/conformance-lane.json: the counts of pytest's summary line (passed,
failed, skipped, errors, ...), the date, the exit status and the vLLM, torch and Python
versions. A partial run (``-k``, a file) is not recorded. Exits with pytest's status.

The summary parsing (:func:`parse_summary`) needs no vLLM: tests/test_conformance_tools.py
checks it on captured pytest output.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "artifacts" / "conformance-lane.json"
LANE = ["-q", "-ra", "tests/conformance", "tests/vllm_lane"]
# pytest's closing line, e.g. "==== 1 failed, 41 passed, 2 skipped in 20.01s ====" or, with -q,
# "42 passed in 18.20s"; "no tests ran in 0.01s" when nothing was collected.
SUMMARY = re.compile(
    r"^=*\s*(?P<body>(?:\d+ [a-z]+(?:, )?)+|no tests ran) in (?P<secs>[\d.]+)s(?: \([^)]*\))?\s*=*$"
)
COUNT = re.compile(r"(\d+) ([a-z]+)")
KINDS = ("passed", "failed", "skipped", "errors", "xfailed", "xpassed", "deselected", "warnings")


def parse_summary(output: str) -> dict[str, Any]:
    """The counts and seconds of the last pytest summary line in ``output``; ValueError when
    there is none (the run crashed before pytest summarised)."""
    for line in reversed(output.splitlines()):
        m = SUMMARY.match(line.strip())
        if not m:
            continue
        counts = dict.fromkeys(KINDS, 0)
        for n, kind in COUNT.findall(m.group("body")):
            kind = {"error": "errors", "warning": "warnings"}.get(kind, kind)
            if kind not in counts:
                raise ValueError(f"unknown pytest outcome {kind!r} in summary line {line.strip()!r}")
            counts[kind] = int(n)
        return {**counts, "seconds": float(m.group("secs"))}
    raise ValueError("no pytest summary line (e.g. '42 passed in 18.2s') in the output")


def versions() -> dict[str, str]:
    """vLLM, torch and Python versions of this interpreter (``not importable: ...`` when not)."""
    out = {"python": platform.python_version()}
    for name in ("vllm", "torch"):
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:  # the lane itself then fails; the record says why
            out[name] = f"not importable: {type(exc).__name__}: {exc}"
    return out


def record(summary: dict[str, Any], returncode: int, found: dict[str, str], path: Path = RECORD,
           now: _dt.datetime | None = None) -> dict[str, Any]:
    """Write the lane's record to ``path`` (JSON) and return it."""
    now = now or _dt.datetime.now(_dt.UTC)
    data = {
        "lane": "scripts/test.sh --vllm (pytest -q -ra tests/conformance tests/vllm_lane)",
        "written_by": "scripts/conformance_lane.py",
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "returncode": returncode,
        "result": "passed" if returncode == 0 and summary["failed"] == summary["errors"] == 0 else "failed",
        **{k: summary[k] for k in ("passed", "failed", "skipped", "errors", "xfailed", "xpassed")},
        "pytest_seconds": summary["seconds"],
        "versions": found,
        "machine": f"{platform.machine()}, {platform.system()}",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def main(argv: list[str]) -> int:
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *LANE, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    rc = proc.wait()
    if argv:
        print(f"conformance lane: partial run ({' '.join(argv)}): not recorded in {RECORD.relative_to(ROOT)}")
        return rc
    try:
        summary = parse_summary("".join(lines))
    except ValueError as exc:
        print(f"conformance lane: not recorded: {exc}", file=sys.stderr)
        return rc or 1
    data = record(summary, rc, versions())
    print(f"conformance lane: recorded in {RECORD.relative_to(ROOT)}: {data['passed']} passed, "
          f"{data['failed']} failed, {data['skipped']} skipped ({data['versions']})")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
