"""Shared sessions on one replica (tiny checkpoint, TP 2, peers are threads of this driver): the cores
an open session costs when idle, the Serve path's p50 beside stepping sessions, and two 2-peer
sessions stepping at once against one after the other. The page says more.

    python -m scripts.bench.sessions            # ~4 minutes on 2 cores
    python -m scripts.bench.sessions --quick    # ~1.5 minutes: shorter windows, 1 round
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import harness
from .docs import Target, section_start, table, target, verdict, verdict_text, verdict_word
from .rss import cpu_seconds, serve_replica_pid

SECTION = "# Shared sessions on one replica (`scripts/bench/sessions.py`)"
APP, NAME = "bench_sessions", "moe"
T = 4  # rows per peer and layer, and of a Serve-path call
STEPPING = (0, 1, 4)  # sessions stepping while the Serve path is timed
IDLE_STATES = {"app": 0, "1 session": 1, "8 sessions": 8}
TARGETS = {"idle_cores": 0.01, "serve_p50_ratio": 2.0, "at_once_ratio": 1.0}


def rows(seed: int, hidden: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, hidden)).astype(np.float32)


def measure_idle(client: Any, seconds: float, rounds: int) -> dict[str, list[float]]:
    """Cores of the app's processes (its replica and ranks), the idle states in turns."""
    pids = [serve_replica_pid(APP, NAME), *(w["pid"] for w in client.status()["workers"])]

    def measure(state: str) -> float:
        sessions = [client.session(1, max_tokens=T, name=f"idle-{i}") for i in range(IDLE_STATES[state])]
        peers = [s.join(0) for s in sessions]
        try:
            start, t0 = cpu_seconds(pids), time.monotonic()
            time.sleep(seconds)
            return (cpu_seconds(pids) - start) / (time.monotonic() - t0)
        finally:
            for s, p in zip(sessions, peers, strict=True):
                s.close()
                p.close()

    return harness.in_turns(IDLE_STATES, rounds, measure)


class Stepper:
    """``peers`` peers of a session, each stepping every layer on a thread of its own from now until the
    session is closed (the layer it waits on then ends as ``session_ended``)."""

    def __init__(self, client: Any, name: str, peers: int, layers: list[int], hidden: int):
        self.session = client.session(peers, max_tokens=T, name=name)
        self.layers, self.steps = layers, [0] * peers
        self.x = [rows(i, hidden) for i in range(peers)]
        self.peers = [self.session.join(i) for i in range(peers)]
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(peers)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        from deployments.client import SessionError

        try:
            while True:
                for layer in self.layers:
                    self.peers[i].forward(self.x[i], layer)
                self.steps[i] += 1
        except SessionError as e:
            if e.failure.value != "session_ended":
                raise

    def close(self) -> int:
        """Close the session, then its peers: the steps they finished."""
        self.session.close()
        for t in self.threads:
            t.join()
        for p in self.peers:
            p.close()
        return sum(self.steps)


def measure_serve_path(client: Any, layers: list[int], hidden: int, calls: int) -> dict[str, dict]:
    """Handle-call latency with 0, 1 and 4 sessions stepping meanwhile."""
    x, out = rows(99, hidden), {}
    for n in STEPPING:
        steppers = [Stepper(client, f"stepping-{i}", 1, layers, hidden) for i in range(n)]
        try:
            times = harness.time_calls(lambda: client.forward(x, 1), calls)
        finally:
            steps = [s.close() for s in steppers]
        out[str(n)] = {**harness.latency_ms(times), "session_steps": steps}
    return out


def run_pair(client: Any, layers: list[int], hidden: int, seconds: float, mode: str) -> dict[str, Any]:
    """Two 2-peer sessions stepping ``at_once``, or each alone in turn (``one_after_the_other``)."""
    snap0, wall0 = client.status()["sessions"]["group"], time.monotonic()
    steps = 0
    for names in [["a", "b"]] if mode == "at_once" else [["a"], ["b"]]:
        steppers = [Stepper(client, f"pair-{n}", 2, layers, hidden) for n in names]
        time.sleep(seconds)
        steps += sum(s.close() for s in steppers)
    wall = time.monotonic() - wall0
    snap1 = client.status()["sessions"]["group"]
    forwards, busy = snap1["forwards"] - snap0["forwards"], snap1["busy_s"] - snap0["busy_s"]
    # a session step is one step of each of its 2 peers: forwards per step counts one per layer
    return {"worker_steps_per_s": steps / wall, "forwards_per_session_step": forwards / max(steps / 2, 1),
            "busy_fraction": busy / wall, "wall_s": wall, "worker_steps": steps}


def verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    idle = results["idle_cores"]
    over = {state: statistics.median(a - b for a, b in zip(idle[state], idle["app"], strict=True))
            for state in IDLE_STATES if state != "app"}
    serve, pair = results["serve_path"], results["pair"]
    ratios = [a["worker_steps_per_s"] / b["worker_steps_per_s"]
              for a, b in zip(pair["at_once"], pair["one_after_the_other"], strict=True)]
    p50 = {n: serve[str(n)]["p50_ms"] / serve["0"]["p50_ms"] for n in STEPPING if n}
    return {**{f"idle_{state}": verdict(over[state], "<=", TARGETS["idle_cores"]) for state in over},
            **{f"serve_{n}": verdict(ratio, "<=", TARGETS["serve_p50_ratio"]) for n, ratio in p50.items()},
            "at_once": verdict(statistics.median(ratios), ">=", TARGETS["at_once_ratio"])}


def index_rows(results: dict[str, Any]) -> list[Target]:
    v = results["verdicts"]
    return [target("cores of the app with 1 idle open session - the app alone", v["idle_1 session"], ".3f"),
            target("cores of the app with 8 idle open sessions - the app alone", v["idle_8 sessions"], ".3f"),
            target("Serve-path p50 with 1 stepping session / with none", v["serve_1"]),
            target("Serve-path p50 with 4 stepping sessions / with none", v["serve_4"]),
            target("two 2-peer sessions: worker-steps/s at once / one after the other", v["at_once"])]


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    v, idle, serve, pair = results["verdicts"], results["idle_cores"], results["serve_path"], results["pair"]
    what = (f"one replica of a TP-2 group, tiny checkpoint, {len(results['layers'])} MoE layers, float32, "
            f"T = {T}; {results['rounds']} round(s)")
    idle_cells = [[state, ", ".join(f"{c:.3f}" for c in cores), f"{statistics.median(cores):.3f}",
                   *((verdict_text(v[f"idle_{state}"], ".3f"), verdict_word(v[f"idle_{state}"]["met"]))
                     if state != "app" else ("", ""))] for state, cores in idle.items()]
    serve_cells = [[n, f"{serve[str(n)]['p50_ms']:.2f}", f"{serve[str(n)]['p90_ms']:.2f}",
                    verdict_text(v[f"serve_{n}"]) if n else "", serve[str(n)]["session_steps"]]
                   for n in STEPPING]
    pair_cells = [[i + 1, mode, f"{r['worker_steps_per_s']:.1f}", f"{r['forwards_per_session_step']:.2f}",
                   f"{r['busy_fraction']:.2f}"]
                  for i, rounds in enumerate(zip(pair["at_once"], pair["one_after_the_other"], strict=True))
                  for mode, r in zip(("at once", "one after the other"), rounds, strict=True)]
    return "\n".join([
        section_start(SECTION, "sessions", results["argv"], results["machine"], what, json_path, png_path),
        "", f"**Idle**: cores of the app's replica and ranks, {results['idle_s']:g} s windows in turns.", "",
        *table("state | cores, each round | median | over the app alone (median) | verdict", idle_cells),
        "", f"**The Serve path beside stepping sessions** of one peer: {results['calls']} handle calls of "
        f"{T} rows, layer 1.", "",
        *table("sessions stepping | p50 ms | p90 ms | / p50 with none | their steps meanwhile", serve_cells),
        "", f"**Two 2-peer sessions**, {results['seconds']:g} s of stepping each run:", "",
        *table("round | mode | worker-steps/s | group forwards per session step | busy fraction", pair_cells),
        "", f"- At once / one after the other (median): {verdict_text(v['at_once'])}."])


def plot(results: dict[str, Any], path: Path) -> None:
    fig, axes = harness.pyplot().subplots(1, 2, figsize=(9, 3.2))
    serve, pair = results["serve_path"], results["pair"]
    axes[0].bar([str(n) for n in STEPPING], [serve[str(n)]["p50_ms"] for n in STEPPING], color="tab:blue")
    axes[0].set(xlabel="sessions stepping", ylabel="Serve-path p50, ms")
    medians = [statistics.median(r["worker_steps_per_s"] for r in rounds) for rounds in pair.values()]
    axes[1].bar(["at once", "one after the other"], medians, color="tab:green")
    axes[1].set_ylabel("worker-steps/s (median)")
    harness.save_figure(fig, path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "sessions", quick="1 round, 2 s windows, 100 calls")
    ap.add_argument("--layers", type=int, default=2, help="MoE layers served and stepped through")
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=5.0, help="stepping per run of the pair")
    ap.add_argument("--calls", type=int, default=300, help="Serve-path calls per number of sessions")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.quick:
        args.idle_s, args.seconds, args.calls, args.rounds = 2.0, 2.0, 100, 1
    from deployments.client import MoEClient

    machine = harness.machine_record(with_ray=True)
    spec = {"name": NAME, "tp_size": 2, "dtype": "float32", "tail": "sharded", "auto_tune_tokens": "none",
            "batch_wait_timeout_s": 0.0}
    app_args = {"checkpoint": str(harness.preset_checkpoint("tiny", args.layers + 1)), "deployments": [spec]}
    with harness.serving(app_args, APP, num_cpus=8, num_gpus=2):
        client = MoEClient.direct(NAME, APP, timeout_s=120)
        status = client.status()
        layers, hidden = list(status["layers"]), status["workers"][0]["hidden_size"]
        print("idle windows", flush=True)
        idle = measure_idle(client, args.idle_s, args.rounds)
        print("the Serve path beside stepping sessions", flush=True)
        serve = measure_serve_path(client, layers, hidden, args.calls)
        print("two sessions at once and one after the other", flush=True)
        pair = harness.in_turns(("at_once", "one_after_the_other"), args.rounds,
                                lambda mode: run_pair(client, layers, hidden, args.seconds, mode))
    results = {"idle_cores": idle, "serve_path": serve, "pair": pair, "layers": layers, "idle_s": args.idle_s,
               "seconds": args.seconds, "calls": args.calls, "rounds": args.rounds, "pid": os.getpid()}
    results["verdicts"] = verdicts(results)
    return harness.report(args, results, machine, markdown, index_rows, plot)


if __name__ == "__main__":
    raise SystemExit(main())
