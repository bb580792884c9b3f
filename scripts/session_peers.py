"""Session peers that step until told to stop, while faults are injected under them.

Run as a script it is one peer in a process without Ray (a meta-path blocker: Ray cannot even be
imported): it joins the ticket given on stdin as peer INDEX and steps over the ticket's layers
until it has taken the number of steps the file STOP names, once it exists, comparing each
answer with the expected rows. After each step it writes its count to PROGRESS; at the end it
prints one JSON line: steps, the worst difference, errors, its moves, whether Ray was imported.

    python scripts/session_peers.py INDEX STOP PROGRESS < {"ticket": ..., "want": {...}, "rows": [[...]]}

:class:`Stepping` runs a session's peers -- some such processes, the rest threads of the caller
-- and waits until each has stepped again after a fault (tests/test_session_moves.py,
tests/plain_driver.py, scripts/bench/session_faults.py). Every peer of a strict session stops at
the same step, so none leaves the others waiting on it.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Rank 0 may run a peer's rows in one forward with other sessions' rows: a different batch moves
# fp32 results by a few ulps (1.2e-6 measured on the tiny layer), so 1e-5 against the lone forward.
TOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]  # the repository


class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"{name}: a Ray-less peer must not import Ray")
        return None


def step_until(peer: Any, layers: tuple[int, ...], x: Any, want: dict, stop: Any, done: Any
               ) -> dict[str, Any]:
    """Step ``peer`` until ``stop()`` names a step count it has reached; ``done(steps)`` after
    each step. The first error ends it (reported, not raised)."""
    import numpy as np

    steps, worst, errors, times = 0, 0.0, [], []
    while (last := stop()) is None or steps < last:
        started = time.time()  # wall clock: comparable between the peers' processes
        try:
            for layer in layers:
                worst = max(worst, float(np.abs(peer.forward(x, layer) - want[layer]).max()))
        except Exception as e:  # counted, not hidden: the callers assert there are none
            errors.append(f"{type(e).__name__}: {e}")
            break
        times.append((round(started, 4), round(time.time(), 4)))
        steps += 1
        done(steps)
    return {"steps": steps, "worst": worst, "errors": errors, "moves": peer.moves, "times": times}


class ThreadPeer:
    """Peer ``index`` stepping on a thread of this process (see :func:`step_until`)."""

    def __init__(self, ticket: Any, index: int, x: Any, want: dict):
        self.peer = ticket.join(index)
        self.steps, self.last, self.report = 0, None, None
        self.thread = threading.Thread(target=self._run, args=(ticket.layers, x, want), daemon=True)
        self.thread.start()

    def _run(self, layers, x, want) -> None:
        self.report = step_until(self.peer, layers, x, want, lambda: self.last,
                                 lambda n: setattr(self, "steps", n))
        self.peer.close()


class Stepping:
    """A session's peers stepping: ``rayless`` processes (this file as a script), the rest threads."""

    def __init__(self, ticket: Any, rayless: int, x: Any, want: dict, folder: Path):
        given = json.dumps({"ticket": ticket.to_json(), "rows": x.tolist(),
                            "want": {str(k): v.tolist() for k, v in want.items()}})
        self.stop, self.folder = folder / "stop", folder
        self.progress = [folder / f"progress-{i}" for i in range(rayless)]
        self.procs = []
        for i in range(rayless):
            command = [sys.executable, str(Path(__file__)), str(i), str(self.stop), str(self.progress[i])]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            p = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
            p.stdin.write(given)
            p.stdin.close()
            p.stdin = None  # given whole: communicate() below only reads
            self.procs.append(p)
        self.threads = [ThreadPeer(ticket, i, x, want) for i in range(rayless, ticket.peers)]

    def counts(self) -> list[int]:
        done = [int(f.read_text() or 0) if f.exists() else 0 for f in self.progress]
        return done + [t.steps for t in self.threads]

    def failed(self) -> list[str]:
        """What went wrong so far: a thread's error, a process that ended early."""
        out = [e for t in self.threads if t.report for e in t.report["errors"]]
        return out + [f"peer process {p.pid} ended: {p.stderr.read()[-2000:]}" for p in self.procs
                      if p.poll() is not None]

    def steps_again(self, steps: int, timeout_s: float) -> float:
        """Wait until every peer has taken ``steps`` more steps (or something failed): seconds."""
        base, started = self.counts(), time.monotonic()
        deadline = started + timeout_s
        while time.monotonic() < deadline and not self.failed():
            if all(n >= b + steps for n, b in zip(self.counts(), base, strict=True)):
                return time.monotonic() - started
            time.sleep(0.05)
        raise AssertionError(f"not every peer stepped {steps} more within {timeout_s:.0f} s: "
                             f"{base} -> {self.counts()}; {self.failed()}")

    def finish(self, timeout_s: float) -> list[dict[str, Any]]:
        """Stop every peer at one step, two past the furthest; each peer's report."""
        last = max(self.counts()) + 2
        for t in self.threads:
            t.last = last
        part = self.folder / "stop.part"
        part.write_text(str(last))
        part.replace(self.stop)  # a peer reads the whole number or no file
        reports = []
        for p in self.procs:
            out, err = p.communicate(timeout=timeout_s)
            reports.append(json.loads(out.strip().splitlines()[-1]) if out.strip() else
                           {"errors": [f"no report: {err[-2000:]}"], "moves": [], "worst": None, "steps": 0})
        for t in self.threads:
            t.thread.join(timeout=timeout_s)
            reports.append(t.report or {"errors": ["still stepping"], "moves": [], "worst": None, "steps": 0})
        return reports


def main() -> None:
    import numpy as np

    from deployments.dataplane import SessionTicket

    index, stop, progress = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    given = json.loads(sys.stdin.read())
    ticket = SessionTicket.from_json(given["ticket"])
    x = np.asarray(given["rows"], np.float32)
    want = {int(layer): np.asarray(rows, np.float32) for layer, rows in given["want"].items()}
    with ticket.join(index) as peer:
        report = step_until(peer, ticket.layers, x, want,
                            lambda: int(stop.read_text()) if stop.exists() else None,
                            lambda n: progress.write_text(str(n)))
    print(json.dumps({**report, "ray_imported": "ray" in sys.modules}), flush=True)


if __name__ == "__main__":
    sys.meta_path.insert(0, NoRay())  # before anything of the project is imported
    main()
