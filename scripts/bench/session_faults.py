"""Session faults: a strict session's peers (4, 2 of them processes without Ray) step on through four
faults in a row on 2 replicas of TP 2 -- rank 1 SIGKILLed, rank 1 of the next replica SIGSTOPped, a
redeploy, a scale-down -- each checking every answer. The page says more.

    python -m scripts.bench.session_faults     # tiny checkpoint, about 2 minutes on 2 cores
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from . import harness
from .docs import Target, section_start, table

APP, NAME, PEERS, RAYLESS = "sessionfaults", "decode", 4, 2
FAULTS = ("sigkill", "sigstop", "redeploy", "scale_down")
RECOVERY_S = 240.0
SECTION = "# Session faults (scripts/bench/session_faults.py)"
BOUNDS = {"collective_timeout_s": 4.0, "call_margin_s": 4.0}


def app_args(replicas: int, batch_wait_s: float = 0.01) -> dict[str, Any]:
    args, _ = harness.tiny_app(tp_size=2, health_check_period_s=1.0, graceful_shutdown_timeout_s=1.0,
                               **BOUNDS, deployments=[{"name": NAME, "num_replicas": replicas,
                                                       "batch_wait_timeout_s": batch_wait_s}])
    return args


def inject(fault: str, session: Any, client: Any, stopped: list[int]) -> tuple[float, float]:
    """Inject ``fault``: (its wall time, the replacement time it costs Serve: for a signalled rank, until
    2 healthy replicas answer, none of them the session's)."""
    import ray

    from deployments.common.workers import WORKER_NAMESPACE, worker_name

    replica, at, started = session.groups()[NAME].replica, time.time(), time.monotonic()
    if fault in ("sigkill", "sigstop"):
        actor = ray.get_actor(worker_name(NAME, replica, 1), namespace=WORKER_NAMESPACE)
        pid = ray.get(actor.info.remote(), timeout=60)["pid"]
        if fault == "sigstop":
            stopped.append(pid)
        os.kill(pid, signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
        while True:
            seen = {st["replica"] for st in (client.status() for _ in range(16)) if st["healthy"]}
            if len(seen) >= 2 and replica not in seen:
                break
            if time.monotonic() - started > RECOVERY_S:
                raise TimeoutError(f"replica {replica} not replaced within {RECOVERY_S:.0f} s")
            time.sleep(0.5)
    else:
        harness.deploy(app_args(2 if fault == "redeploy" else 1, 0.02), APP, "/")
    return at, time.monotonic() - started


def windows(reports: list[dict], faults: dict[str, dict]) -> dict[str, dict]:
    """Per fault, from every peer's step times: the worst step that ended in its window (until the
    next fault) and the seconds until every peer had finished a step begun after the fault."""
    ats = [f["at"] for f in faults.values()] + [float("inf")]
    out = {}
    for (name, fault), end in zip(faults.items(), ats[1:], strict=True):
        steps = [(s, e) for r in reports for s, e in r["times"] if fault["at"] <= e < end]
        back = [min((e for s, e in r["times"] if s > fault["at"]), default=float("inf")) for r in reports]
        out[name] = {**fault, "worst_step_s": max((e - s for s, e in steps), default=None),
                     "all_back_s": max(back) - fault["at"], "steps": len(steps)}
    return out


def measure(stepping: Any, session: Any, client: Any) -> tuple[dict[str, dict], list[dict]]:
    stopped, faults = [], {}  # the pids of SIGSTOPped ranks; per fault, when and its replacement time
    try:
        stepping.steps_again(3, RECOVERY_S)
        for fault in FAULTS:
            at, replace_s = inject(fault, session, client, stopped)
            stepping.steps_again(3, RECOVERY_S)
            faults[fault] = {"at": at, "replace_s": replace_s}
    finally:
        reports = stepping.finish(RECOVERY_S)
        for pid in stopped:  # a stopped rank whose replica has not ended it yet
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
    return windows(reports, faults), reports


def plot(results: dict[str, Any], path: Path) -> None:
    fig, ax = harness.pyplot().subplots(figsize=(8, 3.5))
    t0 = min(s for times in results["times"] for s, _ in times)
    for i, times in enumerate(results["times"]):
        ax.scatter([e - t0 for _, e in times], [e - s for s, e in times], s=3, label=f"peer {i}")
    for name, f in results["faults"].items():
        ax.axvline(f["at"] - t0, color="tab:red", lw=1)
        ax.annotate(name, (f["at"] - t0, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top",
                    fontsize=8)
    ax.set(yscale="log", xlabel="seconds", ylabel="step seconds", title="session steps through faults")
    ax.legend(fontsize=7)
    harness.save_figure(fig, path, dpi=120)


def index_rows(results: dict[str, Any]) -> list[Target]:
    f, call_s = results["faults"], results["call_s"]
    rows = [Target("session faults (SIGKILL, SIGSTOP, redeploy, scale-down): caller errors / steps lost / "
                   "wrong, all 0", f"{results['errors']} / {results['lost']} / {results['wrong']}",
                   results["errors"] == results["lost"] == results["wrong"] == 0)]
    for name in FAULTS:
        worst, bound = f[name]["worst_step_s"] or 0.0, call_s + f[name]["replace_s"]
        rows.append(Target(f"session {name}: worst step <= call bound + replacement",
                           f"{worst:.2f} s (bound {bound:.1f} s)", worst <= bound))
    return rows


def markdown(results: dict[str, Any], json_path: str, png_path: str | None) -> str:
    what = (f"tiny checkpoint, 2 replicas of TP 2, float32, {PEERS} peers ({RAYLESS} without Ray), "
            f"call bound {results['call_s']:.0f} s")
    rows = [[name, f"{f['worst_step_s'] or 0:.2f} s", f"{f['replace_s']:.1f} s", f"{f['all_back_s']:.2f} s",
             str(f["steps"])] for name, f in results["faults"].items()]
    moves = ", ".join(f"{m['why']} {m['seconds']:.2f} s" for m in results["moves_of_peer_0"])
    head = "fault | worst step | replacement | every peer stepped again after | steps in window"
    return "\n".join([
        section_start(SECTION, "session_faults", results["argv"], results["machine"], what, json_path,
                      png_path), "", *table(head, rows), "",
        f"Caller errors {results['errors']}, steps lost {results['lost']}, wrong outputs {results['wrong']} "
        f"over {results['steps']} steps. Peer 0's moves: {moves}."])


def main(argv: list[str] | None = None) -> int:
    args = harness.bench_parser(__doc__, "session_faults").parse_args(argv)
    import numpy as np

    from deployments.client import MoEClient
    from scripts.session_peers import TOL, Stepping

    machine = harness.machine_record(with_ray=True)
    with harness.serving(app_args(2), APP, num_cpus=8, num_gpus=8), tempfile.TemporaryDirectory() as folder:
        client = MoEClient.direct(NAME, APP, timeout_s=120)
        x = np.random.default_rng(0).standard_normal((2, 128), dtype=np.float32)
        with MoEClient(APP, timeout_s=120).session(peers=PEERS, max_tokens=4, name="bench") as session:
            want = {layer: client.forward(x, layer) for layer in session.ticket.layers}
            stepping = Stepping(session.ticket, RAYLESS, x, want, Path(folder))
            faults, reports = measure(stepping, session, client)
    results = {"faults": faults, "call_s": sum(BOUNDS.values()), "moves_of_peer_0": reports[0]["moves"],
               "errors": sum(len(r["errors"]) for r in reports),
               # a failed call is a step begun and never answered
               "lost": sum(bool(r["errors"]) for r in reports),
               "wrong": sum(r["worst"] is None or r["worst"] > TOL for r in reports),
               "steps": sum(r["steps"] for r in reports), "times": [r["times"] for r in reports]}
    ok = results["errors"] == results["lost"] == results["wrong"] == 0
    return harness.report(args, results, machine, markdown, index_rows, plot, ok=ok)


if __name__ == "__main__":
    raise SystemExit(main())
