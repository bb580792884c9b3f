"""scripts/bench/rss.py (``python -m scripts.bench.rss``) counts the whole process tree, grandchildren
included.

The child starts a grandchild that touches 64 MiB of anonymous memory and says so on stdout, then
both wait for stdin to close: the test samples at that moment (no timing involved).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from scripts.bench.rss import TreeSampler, process_memory, tree_pids

ROOT = Path(__file__).resolve().parents[1]

MIB = 2**20
GRANDCHILD = "import sys; b = bytearray(64 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); sys.stdin.read()"
CHILD = f"""
import subprocess, sys
g = subprocess.Popen([sys.executable, "-c", {GRANDCHILD!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
print(g.pid, g.stdout.readline().strip(), flush=True)
sys.stdin.read()
g.stdin.close()
g.wait()
"""


def test_sampler_sums_the_tree_including_a_grandchild() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        grandchild, ready = child.stdout.readline().split()
        assert ready == "ready"
        pids = tree_pids(child.pid)
        assert {child.pid, int(grandchild)} <= set(pids)
        grand_mem = process_memory(int(grandchild))
        assert grand_mem["rss"] >= 64 * MIB and grand_mem["pss"] <= grand_mem["rss"]
        sampler = TreeSampler(child.pid)
        total = sampler.sample()
        assert total["rss"] >= grand_mem["rss"] and sampler.peak == total
        assert {p["pid"] for p in sampler.to_dict()["processes_at_rss_peak"]} >= {child.pid, int(grandchild)}
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert process_memory(int(grandchild)) is None  # gone: no longer counted


def test_cli_passes_the_exit_status_and_writes_the_measurement(tmp_path) -> None:
    out = tmp_path / "rss.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.rss", "--json", str(out), "--",
                           sys.executable, "-c", "import sys; sys.exit(3)"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3 and "peak anon+shmem RSS of the process tree" in proc.stderr
    result = json.loads(out.read_text())
    assert result["exit"] == 3 and result["samples"] >= 1 and len(result["loadavg_before"]) == 3
