"""Run a command and sample the resident memory of its whole process tree; print the peak.

    python scripts/measure_rss.py [--interval 0.2] [--json OUT] -- python -m moe_runtime forward ...

Every ``--interval`` seconds it lists the command's process and all its descendants (by parent pid,
from /proc/*/stat, so Ray's raylet, workers and TP ranks count too) and sums, over them,

* ``rss``: ``RssAnon + RssShmem`` from /proc/PID/status (anonymous memory plus shared memory the
  process touched: what the kernel cannot drop under pressure). Shared pages mapped by several
  processes (Ray's object store, torch's shared tensors) count once per process: an upper bound.
* ``pss``: ``Pss_Anon + Pss_Shmem`` from /proc/PID/smaps_rollup, which divides each shared page
  among the processes that map it: the tree's own share, never more than ``rss``.

The peak of each sum over the run, the sample count and the processes seen at the ``rss`` peak go to
stdout and, with ``--json``, to a file (with the load average before and after). The exit status is
the command's. Linux only (/proc). Page-cache (file) memory is not counted: a checkpoint read through
mmap is reclaimable and is not the process tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

KB = 1024


def children_map() -> dict[int, list[int]]:
    """parent pid -> child pids, for every process /proc shows now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone since listdir
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and parens
        children.setdefault(ppid, []).append(int(entry))
    return children


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants alive now."""
    children, out, todo = children_map(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _fields(path: str, names: tuple[str, ...]) -> int | None:
    """Sum of the ``name: N kB`` lines of a /proc file (None when the process is gone)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    total = 0
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in names:
            total += int(rest.split()[0]) * KB
    return total


def process_memory(pid: int) -> dict[str, int] | None:
    rss = _fields(f"/proc/{pid}/status", ("RssAnon", "RssShmem"))
    if rss is None:
        return None
    pss = _fields(f"/proc/{pid}/smaps_rollup", ("Pss_Anon", "Pss_Shmem"))
    return {"rss": rss, "pss": rss if pss is None else pss}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class TreeSampler:
    """Samples a process tree's memory; ``sample()`` once, or ``start()`` / ``stop()`` a thread."""

    def __init__(self, root: int, interval_s: float = 0.2) -> None:
        self.root, self.interval_s = root, interval_s
        self.samples = 0
        self.peak = {"rss": 0, "pss": 0}
        self.at_peak: list[dict[str, Any]] = []
        self.max_processes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, int]:
        per = {pid: m for pid in tree_pids(self.root) if (m := process_memory(pid)) is not None}
        total = {k: sum(m[k] for m in per.values()) for k in ("rss", "pss")}
        self.samples += 1
        self.max_processes = max(self.max_processes, len(per))
        if total["rss"] > self.peak["rss"]:
            self.at_peak = sorted(({"pid": pid, "rss": m["rss"], "pss": m["pss"], "cmd": cmdline(pid)[:160]}
                                   for pid, m in per.items()), key=lambda p: -p["rss"])
        self.peak = {k: max(self.peak[k], total[k]) for k in total}
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> TreeSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def to_dict(self) -> dict[str, Any]:
        return {"peak_rss_bytes": self.peak["rss"], "peak_pss_bytes": self.peak["pss"],
                "peak_rss_gb": round(self.peak["rss"] / 1e9, 3),
                "peak_pss_gb": round(self.peak["pss"] / 1e9, 3),
                "samples": self.samples, "interval_s": self.interval_s, "max_processes": self.max_processes,
                "processes_at_rss_peak": self.at_peak}


def measure(cmd: list[str], interval_s: float = 0.2, **popen) -> tuple[int, dict[str, Any]]:
    """Run ``cmd`` to its end while sampling its tree: (exit status, measurement)."""
    load_before = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, **popen)
    sampler = TreeSampler(proc.pid, interval_s).start()
    try:
        rc = proc.wait()
    finally:
        sampler.stop()
    return rc, {"command": cmd, "exit": rc, "seconds": round(time.perf_counter() - start, 2),
                "loadavg_before": [round(v, 2) for v in load_before],
                "loadavg_after": [round(v, 2) for v in os.getloadavg()], **sampler.to_dict()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("--json", type=Path, help="also write the measurement here")
    args = ap.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd:
        ap.error("no command after --")
    rc, result = measure(cmd, args.interval)
    print(f"peak anon+shmem RSS of the process tree: {result['peak_rss_gb']:.3f} GB "
          f"(PSS {result['peak_pss_gb']:.3f} GB; {result['samples']} samples every {args.interval} s, "
          f"up to {result['max_processes']} processes; command exit {rc})", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
