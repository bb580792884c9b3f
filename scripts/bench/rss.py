"""The resident memory of a process tree (the root and all its descendants), sampled from /proc (Linux):
``rss`` (RssAnon + RssShmem, what the kernel cannot drop; a page mapped by several processes counts in
each, an upper bound) and ``pss`` (Pss_Anon + Pss_Shmem, shared pages divided among their mappers).
Page cache (a checkpoint read through mmap) is not counted: it is reclaimable and not the tree's.
Run as a script, it runs a command, samples its tree and prints the peak (and writes it to ``--json``):

    python -m scripts.bench.rss [--interval 0.2] [--json OUT] -- python -m moe_runtime forward ...

The exit status is the command's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .harness import busy_cpu_s, loadavg

KB = 1024


def proc_bytes(path: str, *names: str) -> int | None:
    """Sum of the ``NAME: N kB`` lines of a /proc file; None when it cannot be read (the process is gone)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return sum(int(rest.split()[0]) * KB for key, _, rest in (line.partition(":") for line in lines)
               if key in names)


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: [1] the parent pid, [11]/[12] user/system CPU ticks."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pids: list[int]) -> float:
    return sum(int(f[11]) + int(f[12]) for f in map(stat_fields, pids)) / os.sysconf("SC_CLK_TCK")


Roles = dict[str, list[int]]  # a part the processes play (replica, rank0, workers, driver) -> their pids


class Cores:
    """The cores busy from now on: the machine's, and the processes of ``roles`` together and by role."""

    def __init__(self, roles: Roles):
        self.roles = roles
        self.machine, self.when = busy_cpu_s(), time.monotonic()
        self.own = {role: cpu_seconds(pids) for role, pids in roles.items()}

    def read(self) -> dict[str, Any]:
        wall = time.monotonic() - self.when
        by_role = {role: round((cpu_seconds(pids) - self.own[role]) / wall, 4)
                   for role, pids in self.roles.items()}
        return {"cores_busy": round((busy_cpu_s() - self.machine) / wall, 3),
                "cores_used": round(sum(by_role.values()), 4), "by_role": by_role}


def serve_replica_pid(app: str, deployment: str) -> int:
    """The newest process titled ``ServeReplica:APP:DEPLOYMENT`` (an earlier round's may still be exiting)."""
    title = re.compile(rf"ServeReplica:{re.escape(app)}:{re.escape(deployment)}(?![\w-])")
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and title.search(cmdline(int(p)))]
    if not pids:
        raise RuntimeError(f"no process titled ServeReplica:{app}:{deployment}")
    return max(pids, key=lambda pid: int(stat_fields(pid)[19]))  # field 22 of stat: its start time


def tree_pids(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in (int(e) for e in os.listdir("/proc") if e.isdigit()):
        with contextlib.suppress(OSError):  # gone since listdir
            children.setdefault(int(stat_fields(pid)[1]), []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def process_memory(pid: int, pss: bool = True) -> dict[str, int] | None:
    """``rss`` and ``pss`` bytes of ``pid`` (None when gone); without ``pss``, pss = rss (smaps_rollup is
    costly on a process holding many GB)."""
    rss = proc_bytes(f"/proc/{pid}/status", "RssAnon", "RssShmem")
    if rss is None:
        return None
    shared = proc_bytes(f"/proc/{pid}/smaps_rollup", "Pss_Anon", "Pss_Shmem") if pss else None
    return {"rss": rss, "pss": rss if shared is None else shared}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class TreeSampler:
    """Samples a tree's memory, once or on a thread (``start()`` / ``stop()`` or ``with``): the peak sums,
    and each process's own peak rss."""

    def __init__(self, root: int, interval_s: float = 0.2, pss: bool = True) -> None:
        self.root, self.interval_s, self.pss = root, interval_s, pss
        self.samples = self.max_processes = 0
        self.peak = {"rss": 0, "pss": 0}
        self.peak_by_pid: dict[int, int] = {}
        self.at_peak: list[dict[str, Any]] = []
        self._stop, self._thread = threading.Event(), threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict[str, int]:
        per = {pid: m for pid in tree_pids(self.root) if (m := process_memory(pid, self.pss)) is not None}
        total = {k: sum(m[k] for m in per.values()) for k in ("rss", "pss")}
        self.samples += 1
        self.max_processes = max(self.max_processes, len(per))
        for pid, m in per.items():
            self.peak_by_pid[pid] = max(self.peak_by_pid.get(pid, 0), m["rss"])
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
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> TreeSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def to_dict(self) -> dict[str, Any]:
        return {**{f"peak_{k}_bytes": v for k, v in self.peak.items()},
                **{f"peak_{k}_gb": round(v / 1e9, 3) for k, v in self.peak.items()},
                "samples": self.samples, "interval_s": self.interval_s, "max_processes": self.max_processes,
                "processes_at_rss_peak": self.at_peak}


def measure(cmd: list[str], interval_s: float = 0.2, **popen: Any) -> tuple[int, dict[str, Any]]:
    """Run ``cmd`` to its end while sampling its tree: (exit status, measurement)."""
    load_before = loadavg()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, **popen)
    with TreeSampler(proc.pid, interval_s) as sampler:
        rc = proc.wait()
    return rc, {"command": cmd, "exit": rc, "seconds": round(time.perf_counter() - start, 2),
                "loadavg_before": load_before, "loadavg_after": loadavg(), **sampler.to_dict()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv[-1] == "--":
        print(__doc__, file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("--json", type=Path, help="also write the measurement here")
    args = ap.parse_args(argv[:argv.index("--")])
    rc, result = measure(argv[argv.index("--") + 1:], args.interval)
    print(f"peak anon+shmem RSS of the process tree: {result['peak_rss_gb']:.3f} GB "
          f"(PSS {result['peak_pss_gb']:.3f} GB; {result['samples']} samples every {args.interval} s, "
          f"up to {result['max_processes']} processes; command exit {rc})", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
