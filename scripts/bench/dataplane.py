"""The data plane against the transport's own floor and the Compiled-Graph release before it, in one
run on one machine.

One local Ray instance (CPU, logical GPUs) serves --layers MoE layers of the tiny preset on one
TP --tp deployment (float32, sharded tail, one replica). A attention workers (Ray actors whose
attention is synthetic: T seeded rows per layer, so what is measured is the tier's fast path)
decode steps; per (A, T) the modes are

* session: ``MoEClient(app).cohort(workers)``: the A workers are the peers of one data-plane
  session, and per MoE layer the group's rank 0 gathers all A parts and runs one forward; a step
  is checked bit for bit against the Serve path's forward of the same concatenated rows;
* own_sessions: each worker on a lane of its own (``MoEClient(app).lane()``: a session of one
  peer), called once per layer; the only replica's lease passes from worker to worker;
* serve: each worker calls ``MoEClient.forward`` once per layer (the replica's token-budget
  batching merges whatever arrives together);
* floor: the transport's own floor (``bench.floor``): A peer processes -> one gathering rank
  process -> TP - 1 echo ranks -> back, over raw TCP with blocking reads, T x H float32 rows per
  peer and layer; no project code, no Ray;
* cgraph_before, cgraph_before_lanes: the release before the data plane (commit 575090b, Ray
  Compiled Graphs): its own ``scripts/bench_cohort.py``, run from a git worktree of that commit
  (removed afterwards) before this run starts its Ray, at --before-workers x --before-tokens;
  its ``cohort`` and ``lanes`` rows.

Per row: worker-steps/s, step p50/p90, group forwards per step of all A workers and tokens per
forward (the replica's own counters), and the cores busy while stepping: the whole machine's
(/proc/stat) and the taking-part processes' own (replica, ranks, workers, this driver).

Also: at A = 1, per T, the per-layer call p50 of a lane (``MoEClient.lane``, layer 1) against
the in-process forward of the same layer (``python -m moe_runtime forward``, same TP and tail,
``bench.harness.cli_forward_ms``), in --rounds rounds with the app up (the same load for both),
and the transport's floor for one call; and what the TP group
costs while idle, in rounds of --idle-s windows (the replica's and ranks' CPU plus this driver's,
which owns the session and its peers): the app alone (no lease), an open session of max(A) joined
peers with no calls, and Ray Serve's floor (an idle trivial deployment); and each cohort idle for
--cohort-idle-s right after it stepped (its session still open).

    python -m scripts.bench.dataplane            # TP 2, 3 layers, A = 1 2 4 8, T = 1 4 32: ~12 min, 2 cores
    python -m scripts.bench.dataplane --quick    # A = 1 4, T = 4 (a smoke run)

Targets (issue 37, item 9): A = 1, T = 1: lane call p50 - in-process forward <= 0.5 ms; A = 4,
T = 4: session worker-steps/s >= 2x own_sessions and >= 1.5x cgraph_before; group forwards per
session step = MoE layers; an open session with no calls costs <= 0.05 cores over the idle app
(measured in turns; a cohort's idle cores are reported beside it). Results: JSON under --out,
its page, docs/benchmarks/dataplane.md, and its rows of the index (--docs).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from examples.rows import RowsWorker

from . import ROOT, harness
from .docs import Target, rounds_table, section_start, target, verdict, verdict_word, write_results, yes_no
from .floor import echo_floor
from .rss import cpu_seconds, serve_replica_pid

APP, NAME, FLOOR_APP = "dataplanebench", "moe", "idlefloor"
SECTION = "# Data plane vs the transport's floor and the Compiled-Graph release (scripts/bench/dataplane.py)"
BEFORE = "575090b"  # the last release on Ray Compiled Graphs
BEFORE_MODES = {"cohort": "cgraph_before", "lanes": "cgraph_before_lanes"}
CALL_LAYER = 1  # the layer of the per-call measurement
HIDDEN = 128  # the tiny preset's hidden size
WARMUP = 2  # untimed steps a worker takes on its own before timing
TARGETS = {"call_over_inprocess_ms": 0.5, "m4_vs_own_sessions": 2.0, "m4_vs_cgraph": 1.5, "idle_cores": 0.05}
MODES = ("session", "own_sessions", "serve", "floor", "cgraph_before", "cgraph_before_lanes")


class SyntheticWorker(RowsWorker):
    """An attention worker whose attention is a lookup: ``T`` seeded rows per layer. A step's
    answer is how many layers came back (the driver needs no rows back)."""

    def __init__(self, tokens: int, hidden: int, seed: int, layers: list[int]):
        super().__init__({layer: harness.seeded_randn(tokens, hidden, 1000 * seed + layer)
                          for layer in layers})

    def finish(self) -> int:
        return len(self.out)

    def outputs(self) -> dict[int, torch.Tensor]:
        return self.out

    def pid(self) -> int:
        return os.getpid()

    def run_for(self, app: str, mode: str, tokens: int, seconds: float, warmup: int) -> dict[str, Any]:
        """Steps on its own for ``seconds`` (after ``warmup`` untimed ones): each MoE layer one
        call, through a lane of its own (``own_sessions``) or the Serve handles (``serve``); the
        duration of every timed step, when the timed steps began and ended (``time.monotonic``:
        one clock for every process of the machine) and where a lane's calls went."""
        from deployments.client import MoEClient

        client = MoEClient(app, timeout_s=300)
        lane = client.lane(max_tokens=tokens, name=f"bench-{os.getpid()}") if mode == "own_sessions" else None
        call = lane.forward if lane is not None else client.forward
        layers = sorted(self.rows)
        steps: list[float] = []
        deadline = began = None
        try:
            while deadline is None or time.perf_counter() < deadline:
                start, at = time.perf_counter(), time.monotonic()
                self.start(None)
                for layer in layers:
                    self.absorb(layer, call(self.attend(layer), layer))
                self.finish()
                if warmup:
                    warmup -= 1
                    deadline = None if warmup else time.perf_counter() + seconds
                    continue
                steps.append(time.perf_counter() - start)
                deadline, began = deadline or start + seconds, began or at
            window = [began, time.monotonic()]
            counts = lane.status()["deployments"] if lane is not None else {}
        finally:
            if lane is not None:
                lane.close()
        return {"steps": steps, "window": window, "lane_calls": sum(c["lane_calls"] for c in counts.values()),
                "serve_calls": sum(c["serve_calls"] for c in counts.values())}


# -- measuring -------------------------------------------------------------------------------------


def timed(step: Any, seconds: float, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        step()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


Roles = dict[str, list[int]]  # a part the processes play (replica, rank0, workers, driver) -> their pids


class Cores:
    """The cores busy from now on: the whole machine's (/proc/stat), and the processes of ``roles``
    together (``cores_used``) and by role (``by_role``)."""

    def __init__(self, roles: Roles):
        self.roles = roles
        self.machine, self.when = harness.busy_cpu_s(), time.monotonic()
        self.own = {role: cpu_seconds(pids) for role, pids in roles.items()}

    def read(self) -> dict[str, Any]:
        wall = time.monotonic() - self.when
        by_role = {role: round((cpu_seconds(pids) - self.own[role]) / wall, 4)
                   for role, pids in self.roles.items()}
        return {"cores_busy": round((harness.busy_cpu_s() - self.machine) / wall, 3),
                "cores_used": round(sum(by_role.values()), 4), "by_role": by_role}


def idle_cores(roles: Roles, seconds: float) -> dict[str, Any]:
    cores = Cores(roles)
    time.sleep(seconds)
    return cores.read()


def group_roles(client: Any) -> Roles:
    """The replica's and its ranks' processes, and this driver's."""
    ranks = {f"rank{w['rank']}": [w["pid"]] for w in client.status()["workers"]}
    return {"replica": [serve_replica_pid(APP, NAME)], **ranks, "driver": [os.getpid()]}


def counters(client: Any) -> dict[str, Any]:
    c = client.status()["counters"]
    return {"forwards": c["forwards"], "forward_tokens": c["forward_tokens"],
            "lane_forwards": c["sessions"]["forwards"], "lane_busy_s": c["sessions"]["busy_s"]}


def settled_counters(client: Any) -> dict[str, int]:
    """The replica's counters: exact at each read (status() reads rank 0's session counts live)."""
    return counters(client)


def row(mode: str, workers: int, tokens: int, step_s: list[float], worker_steps: int, wall_s: float,
        cores: dict[str, float], before: dict[str, int] | None = None, after: dict[str, int] | None = None,
        untimed: int = 0, **extra: Any) -> dict[str, Any]:
    """One measured configuration; ``untimed``: worker-steps the counters saw but ``step_s``
    does not hold (warm-up steps between ``before`` and ``after``)."""
    ms = harness.latency_ms(step_s)
    out = {"mode": mode, "workers": workers, "tokens": tokens, "worker_steps_per_s": worker_steps / wall_s,
           "step_p50_ms": ms["p50_ms"], "step_p90_ms": ms["p90_ms"], **cores, **extra}
    if before is not None:
        forwards = after["forwards"] - before["forwards"]
        out["forwards_per_step"] = forwards * workers / (worker_steps + untimed)
        out["tokens_per_forward"] = (after["forward_tokens"] - before["forward_tokens"]) / max(1, forwards)
        leased = after["lane_forwards"] - before["lane_forwards"]
        if leased:  # rank 0's time per leased forward: the group's forward, its hand-off to the other ranks
            out["group_forward_ms"] = (after["lane_busy_s"] - before["lane_busy_s"]) * 1e3 / leased
    return out


def measure_session(client: Any, workers: list[Any], pids: Roles, tokens: int, layers: int,
                    seconds: float, idle_s: float) -> dict[str, Any]:
    """The A workers as one session's peers (a cohort): stepping, then idle for ``idle_s``."""
    import ray

    M = len(workers)
    with client.cohort(workers, max_tokens=tokens, name=f"bench-{M}x{tokens}") as cohort:
        for _ in range(3):  # untimed, before the counters are read
            cohort.step([None] * M)
        before, cores = settled_counters(client), Cores(pids)
        steps = timed(lambda: cohort.step([None] * M), seconds, warmup=0)
        stepping = cores.read()
        outs = ray.get([w.outputs.remote() for w in workers])  # the last step's rows
        held = cohort.status()
        idle = idle_cores(pids, idle_s)  # open, nothing steps
        status = cohort.status()
    after = settled_counters(client)
    exact = True  # the last step's rows against the Serve path's forward of all of them
    for layer in range(1, layers + 1):
        xs = [harness.seeded_randn(tokens, HIDDEN, 1000 * i + layer) for i in range(M)]
        want = torch.split(client.forward(torch.cat(xs), layer), tokens)
        exact &= all(torch.equal(outs[i][layer], want[i]) for i in range(M))
    on_session = status["serve_steps"] == 0 and status["reruns"] == 0 and status["path"] == "session"
    idle_held = status["sessions"] == held["sessions"] and status["path"] == "session"
    return row("session", M, tokens, steps, M * len(steps), sum(steps), stepping, before, after,
               idle_cores_busy=idle["cores_busy"], idle_cores_used=idle["cores_used"],
               idle_by_role=idle["by_role"], idle_held=idle_held,
               exact=exact, on_session=on_session, valid=exact and on_session,
               **{k: status[k] for k in ("session_steps", "serve_steps", "reruns", "sessions", "aborts")})


def measure_independent(client: Any, workers: list[Any], pids: Roles, mode: str, tokens: int,
                        seconds: float) -> dict[str, Any]:
    import ray

    before, cores, start = counters(client), Cores(pids), time.perf_counter()
    runs = ray.get([w.run_for.remote(APP, mode, tokens, seconds, WARMUP) for w in workers])
    wall, stepping = time.perf_counter() - start, cores.read()
    after = settled_counters(client)
    flat = [s for run in runs for s in run["steps"]]
    # Every timed step over the span from the first timed step's start to the last one's end: the
    # workers' windows overlap where they run side by side, and follow each other where they wait
    # for the one replica's lease.
    span = max(run["window"][1] for run in runs) - min(run["window"][0] for run in runs)
    overlap = sum(run["window"][1] - run["window"][0] for run in runs) / span
    extra = {} if mode != "own_sessions" else {k: sum(run[k] for run in runs)
                                                for k in ("lane_calls", "serve_calls")}
    return row(mode, len(workers), tokens, flat, len(flat), span, stepping, before, after,
               untimed=WARMUP * len(workers), elapsed_s=wall, span_s=span, overlap=overlap, **extra)


def measure_floor(workers: int, tokens: int, layers: int, tp: int, seconds: float) -> dict[str, Any]:
    floor = echo_floor(workers, tokens, HIDDEN, layers, tp, min_time_s=seconds)
    flat = [s for steps in floor.steps for s in steps]
    window = max(sum(steps) for steps in floor.steps)
    return row("floor", workers, tokens, flat, len(flat), window, {"cores_busy": floor.cores_busy})


def measure_calls(client: Any, ckpt: Path, tp: int, tokens: list[int], calls: int, rounds: int
                  ) -> dict[int, dict[str, Any]]:
    """A lane's per-layer call against the in-process forward, in rounds under the same load: each
    round the CLI's forward at every T (``calls / rounds`` repeats; a subprocess of its own, no Ray),
    then a lane opened and called as often at every T (interleaved), then as often at the first T
    alone, and closed. Per T: the lane's latencies over all rounds, the CLI's medians, each round's
    lane p50 minus the CLI's median, and whether every answer came on the lane and equals the Serve
    path's bit for bit; for the first T also the served forward's own times (rank 0's, from the
    replica's ``forward_ms.recent``), which split the lane's call into forward and data plane."""
    xs = {T: harness.seeded_randn(T, HIDDEN, seed=T) for T in tokens}
    per_round = max(1, calls // rounds)
    tail = "sharded" if tp > 1 else None
    last: dict[int, Any] = {}
    out = {T: {"times": [], "cli": [], "paired_ms": [], "exact": True, "on_lane": True, "served_ms": []}
           for T in tokens}

    def call(lane: Any, T: int) -> None:
        last[T] = lane.forward(xs[T], CALL_LAYER)

    for _ in range(rounds):
        for T in tokens:
            out[T]["cli"].append(harness.cli_forward_ms(ckpt, CALL_LAYER, tp, T, per_round, tail))
        before = counters(client)
        with client.lane(max_tokens=max(tokens), name="bench-calls") as lane:
            times = harness.time_interleaved({T: lambda T=T: call(lane, T) for T in tokens}, per_round)
            for _ in range(per_round):
                call(lane, tokens[0])
            status = lane.status()["deployments"][NAME]
        lease_ended(client)
        settled = settled_counters(client)
        # The lane's last per_round forwards were the first T's calls alone.
        if settled["lane_forwards"] - before["lane_forwards"] >= per_round:
            out[tokens[0]]["served_ms"] += client.status()["counters"]["forward_ms"]["recent"][-per_round:]
        on_lane = status["path"] == "lane" and status["serve_calls"] == 0 and status["fallbacks"] == 0
        for T in tokens:
            got = out[T]
            got["times"] += times[T]
            got["paired_ms"].append(statistics.median(times[T]) * 1e3 - got["cli"][-1]["median_ms"])
            got["exact"] &= torch.equal(last[T], client.forward(xs[T], CALL_LAYER))
            got["on_lane"] &= on_lane
    for got in out.values():
        times = got.pop("times")
        got.update(lane=harness.latency_ms(times), calls=len(times),
                   inprocess_ms=statistics.median(c["median_ms"] for c in got["cli"]),
                   over_inprocess_ms=statistics.median(got["paired_ms"]))
    return out


def idle_floor_app() -> int:
    """Ray Serve's floor: a trivial deployment, idle; its replica's process."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Idle:
        def __call__(self) -> str:
            return "ok"

    handle = serve.run(Idle.bind(), name=FLOOR_APP, route_prefix=None)
    handle.remote().result()
    return serve_replica_pid(FLOOR_APP, "Idle")


def lease_ended(client: Any, timeout_s: float = 60.0) -> None:
    """Back once the replica has no open session (rank 0 pushes each end as it happens)."""
    deadline = time.monotonic() + timeout_s
    while client.status()["sessions"]["open"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replica still has an open session {timeout_s:g} s on")
        time.sleep(0.1)


def measure_idle(client: Any, session_client: Any, pids: Roles, floor_pid: int, peers: int, tokens: int,
                 seconds: float, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """The TP group's processes (and this driver) idle, in turns: no lease, an open session of
    ``peers`` joined peers with no calls; and Serve's floor (its trivial replica, this driver).
    Each window opens once the previous turn's session has left the replica (``client``: its
    direct handle)."""

    def measure(state: str) -> dict[str, Any]:
        lease_ended(client)
        if state == "serve_floor":
            return idle_cores({"replica": [floor_pid], "driver": [os.getpid()]}, seconds)
        if state == "app":
            return idle_cores(pids, seconds)
        with session_client.session(peers, max_tokens=tokens, name="bench-idle") as session:
            joined = [session.join(i) for i in range(peers)]
            try:
                return idle_cores(pids, seconds)
            finally:
                for peer in joined:
                    peer.close()

    return harness.in_turns(["app", "session", "serve_floor"], rounds, measure)


# -- the release before ----------------------------------------------------------------------------


def git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True)


def run_before(args: Any) -> dict[str, Any]:
    """The release before the data plane: its own bench_cohort.py in a worktree of ``BEFORE``, with
    this venv's Python (PYTHONPATH: the worktree, so its ``deployments`` is the one that runs) and
    this checkout's checkpoints; its cohort and lanes rows and where they came from."""
    cmd = ["scripts/bench_cohort.py", "--docs", "", "--tp", str(args.tp), "--layers", str(args.layers),
           "--workers", *map(str, args.before_workers), "--tokens", *map(str, args.before_tokens),
           "--seconds", f"{args.seconds:g}"]
    info: dict[str, Any] = {"commit": BEFORE, "command": "python " + shlex.join(cmd), "attempts": []}
    with tempfile.TemporaryDirectory(prefix="bench-before-") as tmp:
        tree, out = Path(tmp) / "tree", Path(tmp) / "out"
        git("worktree", "add", "--detach", str(tree), BEFORE)
        try:
            (tree / "checkpoints").symlink_to(harness.CHECKPOINTS)
            results_file = out / "bench_cohort.json"
            for _ in range(2):  # once more if it left no results (its Ray may not start on a busy machine)
                started = time.perf_counter()
                proc = subprocess.Popen([sys.executable, *cmd, "--out", str(out)], cwd=tree,
                                        env={**os.environ, "PYTHONPATH": str(tree)})
                try:
                    code = proc.wait(args.before_timeout_s)
                except subprocess.TimeoutExpired:  # its Ray stops on the way out of its KeyboardInterrupt
                    proc.send_signal(signal.SIGINT)
                    code = proc.wait(120)
                info["attempts"].append({"exit": code, "wall_s": round(time.perf_counter() - started, 1)})
                if results_file.is_file():
                    break
        finally:
            (tree / "checkpoints").unlink(missing_ok=True)
            git("worktree", "remove", "--force", str(tree))
        info.update(info["attempts"][-1])
        if not results_file.is_file():
            info["error"] = f"no results after {len(info['attempts'])} attempt(s) (exits {info['attempts']})"
            return info
        data = json.loads(results_file.read_text())
    info.update(machine=data["machine"], verdicts=data["verdicts"], seconds=data["seconds"],
                rows=[{**r, "mode": BEFORE_MODES[r["mode"]]} for r in data["rows"]
                      if r["mode"] in BEFORE_MODES])
    return info


# -- the report ------------------------------------------------------------------------------------


def pick(rows: list[dict[str, Any]], mode: str, workers: int, tokens: int) -> dict[str, Any] | None:
    return next((r for r in rows if (r["mode"], r["workers"], r["tokens"]) == (mode, workers, tokens)), None)


def ratio_verdict(a: dict[str, Any] | None, b: dict[str, Any] | None, target: float) -> dict[str, Any]:
    """``a``'s worker-steps/s over ``b``'s against ``target`` (not measured without both; missed when
    ``a`` is a session row whose steps left the session or were not exact)."""
    if a is None or b is None:
        return verdict(None, ">=", target)
    v = verdict(a["worker_steps_per_s"] / b["worker_steps_per_s"], ">=", target)
    if not a.get("valid", True):
        v["met"] = False
    return v


def call_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per T: the lane's per-layer call p50 at A = 1 against the in-process forward and the floor."""
    out = []
    for T in results["tokens"]:
        lane = results["calls"][str(T)]
        floor = results["call_floor"][str(T)]["p50_ms"]
        over = lane["over_inprocess_ms"]
        served = lane.get("served_ms") or []
        out.append({"T": T, "lane_p50_ms": lane["lane"]["p50_ms"], "lane_p90_ms": lane["lane"]["p90_ms"],
                    "inprocess_ms": lane["inprocess_ms"], "over_inprocess_ms": over, "floor_p50_ms": floor,
                    "over_floor_ms": over - floor, "rounds_ms": lane["paired_ms"],
                    "served_p50_ms": statistics.median(served) if served else None, "served_n": len(served),
                    "valid": lane["exact"] and lane["on_lane"]})
    return out


def verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rows, L = results["rows"], results["layers"]
    sessions = [r for r in rows if r["mode"] == "session"]
    out = {}
    one = next((c for c in call_rows(results) if c["T"] == 1), None)
    out["call_over_inprocess"] = verdict(None if one is None else one["over_inprocess_ms"], "<=",
                                         TARGETS["call_over_inprocess_ms"])
    if one and not one["valid"]:
        out["call_over_inprocess"]["met"] = False
    out["forwards_per_step"] = verdict(max(abs(r["forwards_per_step"] - L) for r in sessions), "<=", 0.0)
    s4 = pick(rows, "session", 4, 4)
    out["m4_vs_own_sessions"] = ratio_verdict(s4, pick(rows, "own_sessions", 4, 4),
                                              TARGETS["m4_vs_own_sessions"])
    out["m4_vs_cgraph"] = ratio_verdict(s4, pick(rows, "cgraph_before", 4, 4), TARGETS["m4_vs_cgraph"])
    # What an open, idle session costs: its processes' CPU over the app's alone, measured in turns.
    idle = {k: statistics.median(r["cores_used"] for r in vs) for k, vs in results["idle"].items()}
    out["idle_session"] = verdict(idle["session"] - idle["app"], "<=", TARGETS["idle_cores"])
    out["exact"] = verdict(float(all(r["exact"] for r in sessions)), ">=", 1.0)
    return out


def index_rows(results: dict[str, Any]) -> list[Target]:
    v = verdicts(results)
    return [target("lane - in-process per-layer call, A = 1, T = 1", v["call_over_inprocess"], "+.3f", " ms"),
            target("worker-steps/s, session / own sessions, A = 4, T = 4", v["m4_vs_own_sessions"]),
            target("worker-steps/s, session / Compiled-Graph cohort, A = 4, T = 4", v["m4_vs_cgraph"]),
            target("group forwards per session step - MoE layers, largest", v["forwards_per_step"]),
            target("cores of an idle open session over the app's", v["idle_session"], ".3f"),
            target("every session step bit-equal to the Serve path's", v["exact"]["met"])]


def value_text(v: dict[str, Any], fmt: str = ".2f", unit: str = "") -> str:
    if v["value"] is None:
        return f"not measured (target {v['target']}{unit})"
    return f"**{v['value']:{fmt}}{unit}** (target {v['target']}{unit}: {verdict_word(v['met'])})"


def cell(r: dict[str, Any], key: str, fmt: str) -> str:
    return "-" if r.get(key) is None else f"{r[key]:{fmt}}"


def table(rows: list[dict[str, Any]], T: int) -> list[str]:
    lines = [f"**T = {T} rows per worker and layer**", "",
             "| mode | A | worker-steps/s | step p50 ms | step p90 ms | forwards/step | tokens/forward "
             "| cores busy (machine) | cores used (its processes) | idle cores (machine / processes) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        ours = sorted((r for r in rows if r["mode"] == mode and r["tokens"] == T), key=lambda r: r["workers"])
        for r in ours:
            idle = "-"
            if "idle_cores_used" in r:
                idle = f"{r['idle_cores_busy']:.2f} / {r['idle_cores_used']:.3f}"
            elif "idle_cores_busy" in r:  # the release before: the machine only
                idle = f"{r['idle_cores_busy']:.2f} / -"
            flag = "" if r.get("valid", True) else " (**invalid**)"
            lines.append(f"| {mode}{flag} | {r['workers']} | {r['worker_steps_per_s']:.1f} "
                         f"| {r['step_p50_ms']:.2f} | {r['step_p90_ms']:.2f} "
                         f"| {cell(r, 'forwards_per_step', '.2f')} "
                         f"| {cell(r, 'tokens_per_forward', '.1f')} | {cell(r, 'cores_busy', '.2f')} "
                         f"| {cell(r, 'cores_used', '.2f')} | {idle} |")
    return lines + [""]


def call_table(results: dict[str, Any]) -> list[str]:
    lines = ["| T | lane p50 ms | lane p90 ms | in-process ms | lane - in-process (rounds) "
             "| transport floor p50 | lane - in-process - floor | bit-equal, on the lane |",
             "|---|---:|---:|---:|---|---:|---:|---|"]
    for c in call_rows(results):
        rounds = ", ".join(f"{v:+.2f}" for v in c["rounds_ms"])
        lines.append(f"| {c['T']} | {c['lane_p50_ms']:.3f} | {c['lane_p90_ms']:.3f} "
                     f"| {c['inprocess_ms']:.2f} | **{c['over_inprocess_ms']:+.3f}** ({rounds}) "
                     f"| {c['floor_p50_ms']:.3f} | {c['over_floor_ms']:+.3f} | {yes_no(c['valid'])} |")
    return lines


def before_lines(results: dict[str, Any]) -> list[str]:
    b = results["before"]
    if "machine" not in b:  # it left no results
        return [f"- The release before ({b['commit']}, `{b['command']}` in a worktree of it): **no rows** -- "
                f"{b.get('error', 'no results')}; its targets below are not measured."]
    m = b["machine"]
    load = f"1-minute load average {m['loadavg_before'][0]:.2f} before, {m['loadavg_after'][0]:.2f} after"
    return [f"- `cgraph_before` / `cgraph_before_lanes`: the release before the data plane "
            f"({b['commit']}, Ray Compiled Graphs), its own `{b['command']}` run from a worktree of that "
            f"commit at {m['date']} ({load}; exit {b['exit']}, {b['wall_s']:.0f} s, attempt "
            f"{len(b['attempts'])}) just before this run's "
            "own Ray: its `cohort` and `lanes` rows. Its idle cores are the machine's while its cohort's "
            "compiled graph idled 1 s.", *before_lanes_note(results)]


def before_lanes_note(results: dict[str, Any]) -> list[str]:
    """That script's lanes rate divides every timed step by one worker's window: an upper bound when
    the workers' leases followed each other (its rows keep the whole measurement's wall time)."""
    lanes = [r for r in results["rows"] if r["mode"] == "cgraph_before_lanes" and r["workers"] > 1]
    if not lanes:
        return []
    took = ", ".join(f"A = {r['workers']}, T = {r['tokens']}: {r['elapsed_s']:.1f} s" for r in lanes)
    return [f"- `cgraph_before_lanes` divides every worker's timed steps by one worker's "
            f"{results['before']['seconds']:g} s window (as that script counts; this run's own rows divide "
            f"by the span of all the windows), while its whole measurement took {took}: where the lease "
            "passed from worker to worker its rate is an upper bound."]


def call_findings(results: dict[str, Any]) -> list[str]:
    """The A = 1, T = 1 call against the in-process forward, and where its time goes."""
    v = results["verdicts"]
    one = next((c for c in call_rows(results) if c["T"] == 1), None)
    call = ("not measured" if one is None else
            f"lane p50 {one['lane_p50_ms']:.3f} ms, in-process {one['inprocess_ms']:.2f} ms (the CLI's "
            f"median); lane - in-process, the median over rounds of each round's lane p50 - its CLI "
            f"median: {value_text(v['call_over_inprocess'], '+.3f', ' ms')}; the transport's floor for "
            f"the same call: {one['floor_p50_ms']:.3f} ms")
    lines = [f"- A = 1, T = 1, per-layer call: {call}."]
    if one is not None and one.get("served_p50_ms") is not None:
        served, cli = one["served_p50_ms"], one["inprocess_ms"]
        lines.append(
            f"- Where the A = 1, T = 1 call's time goes: the served forward itself (rank 0's time for the "
            f"group's forward, its hand-off to rank 1 included; p50 of {one['served_n']} lane forwards) "
            f"takes {served:.3f} ms, {served - cli:+.3f} ms against the CLI's {cli:.2f} ms; the rest of the "
            f"call, lane p50 - served forward, is {one['lane_p50_ms'] - served:.3f} ms (the peer's frames, "
            f"rank 0's checks and answer, the replies' wake-ups) against the floor's "
            f"{one['floor_p50_ms']:.3f} ms for a whole round trip.")
    return lines


def step_findings(results: dict[str, Any]) -> list[str]:
    """The A = 4, T = 4 rates and where a session step goes."""
    v, L, rows = results["verdicts"], results["layers"], results["rows"]
    lines: list[str] = []
    s4, o4, c4 = (pick(rows, m, 4, 4) for m in ("session", "own_sessions", "cgraph_before"))
    rate = ", ".join(f"{name} {r['worker_steps_per_s']:.1f}" for name, r in
                     (("session", s4), ("own_sessions", o4), ("cgraph_before", c4)) if r)
    lines += [f"- A = 4, T = 4: worker-steps/s {rate or 'not measured'}; session over own_sessions "
              f"{value_text(v['m4_vs_own_sessions'])}; session over the Compiled-Graph cohort "
              f"{value_text(v['m4_vs_cgraph'])}."]
    if s4 and c4 and s4.get("group_forward_ms"):
        step_ms = 4e3 / s4["worker_steps_per_s"]  # one group step of the 4 workers
        need_ms = 4e3 / (TARGETS["m4_vs_cgraph"] * c4["worker_steps_per_s"])
        forwards_ms = L * s4["group_forward_ms"]
        lines.append(
            f"- Where an A = 4, T = 4 session step goes: {step_ms:.1f} ms per group step (from "
            f"worker-steps/s), "
            f"of which the group's {L} forwards take {forwards_ms:.1f} ms ({s4['group_forward_ms']:.2f} ms "
            f"each, rank 0's busy time per forward, mean) and the rest -- the workers' own step, the "
            f"peers' frames and wake-ups -- {step_ms - forwards_ms:.1f} ms, while the machine's cores were "
            f"{s4['cores_busy']:.2f} busy. {TARGETS['m4_vs_cgraph']:g}x the Compiled-Graph cohort needs "
            f"{need_ms:.1f} ms per group step: " + (
                "less than the forwards alone, so no transport reaches it on this machine."
                if forwards_ms >= need_ms else
                f"the rest may take up to {need_ms - forwards_ms:.1f} ms" + (
                    " (it does)." if step_ms <= need_ms else ".")))
    if o4 and "lane_calls" in o4:
        share = o4["lane_calls"] / max(1, o4["lane_calls"] + o4["serve_calls"])
        lines.append(f"- own_sessions at A = 4, T = 4: {o4['lane_calls']} calls on a worker's own session, "
                     f"{o4['serve_calls']} on the Serve path ({share:.0%} on sessions); the workers' "
                     f"{results['seconds']:g} s timed windows spanned {o4['span_s']:.1f} s together (they "
                     f"overlapped {o4['overlap']:.2f}-fold of 4): one replica serves one lease at a time, so "
                     "the others wait for it or take the Serve path behind it.")
    return lines


def findings(results: dict[str, Any]) -> list[str]:
    v, L, rows = results["verdicts"], results["layers"], results["rows"]
    lines = call_findings(results) + step_findings(results)
    lines.append(f"- Group forwards per session step = MoE layers ({L}) at every A and T: largest deviation "
                 f"{value_text(v['forwards_per_step'])}.")
    exact = yes_no(v["exact"]["met"])
    on = yes_no(all(r["on_session"] for r in rows if r["mode"] == "session"))
    lines.append(f"- Every session step checked equals the Serve path's forward of the same concatenated "
                 f"rows bit for bit: {exact}; every timed step ran on the session (no Serve-path step, no "
                 f"rerun): {on}.")
    idle = {k: statistics.median(r["cores_used"] for r in vs) for k, vs in results["idle"].items()}
    worst = max((r for r in rows if r["mode"] == "session"), key=lambda r: r["idle_cores_used"])
    held = yes_no(all(r["idle_held"] for r in rows if r["mode"] == "session"))
    lines.append(f"- Idle: an open session of {results['idle_peers']} joined peer(s) with no calls costs "
                 f"{value_text(v['idle_session'], '.3f')} cores over the app alone: "
                 f"{idle['session']:.3f} for the replica, ranks and this driver against {idle['app']:.3f} "
                 f"(medians of {len(results['idle']['session'])} rounds, in turns); Ray Serve's floor (an "
                 f"idle trivial replica and this driver) {idle['serve_floor']:.3f}. A cohort idle for "
                 f"{results['cohort_idle_s']:g} s right after stepping (replica, ranks, its idle worker "
                 f"actors and this driver), worst at A = {worst['workers']}, T = {worst['tokens']}: "
                 f"{worst['idle_cores_used']:.3f} cores; its session held throughout: {held}.")
    T = 4 if 4 in results["tokens"] else results["tokens"][0]
    scaling = {m: (pick(rows, m, 4, T), pick(rows, m, 1, T)) for m in ("floor", "session", "cgraph_before")}
    per_mode = ", ".join(f"{mode} {a['worker_steps_per_s'] / b['worker_steps_per_s']:.2f}x"
                         for mode, (a, b) in scaling.items() if a and b)
    if per_mode:
        lines.append(f"- Worker-steps/s at A = 4 over A = 1 (T = {T}): {per_mode}.")
    return lines + before_lines(results)


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    what = (f"tiny preset, TP {results['tp']}, {results['layers']} MoE layers, one replica, float32, sharded "
            f"tail, {results['seconds']:g} s per configuration")
    lines = [section_start(SECTION, "dataplane", results["argv"], results["machine"], what, json_path), ""]
    lines += ["Modes: `session` = the A workers as the peers of one data-plane session "
              "(`MoEClient.cohort`: one group forward per MoE layer of all A workers' rows); "
              "`own_sessions` = each worker on a lane of its own (a session of one peer); `serve` = each "
              "worker calling `MoEClient.forward` per layer; `floor` = the transport's own floor "
              "(`scripts/bench/floor.py`: A peer processes -> a gathering rank process -> "
              f"{results['tp'] - 1} echo rank(s) -> back over raw TCP, blocking reads, no project code); "
              "`cgraph_before` / `cgraph_before_lanes` = the Compiled-Graph cohort and lanes of the release "
              "before. Worker-steps/s is decode steps finished per second summed over the A workers; "
              "forwards/step counts the group's forwards per decode step of all A workers (the replica's "
              "counters); cores busy (machine) is the whole machine's non-idle CPU while stepping, cores "
              "used the replica's, ranks', workers' and this driver's own CPU.", "",
              "Findings (computed from the rows below):", ""]
    lines += findings(results)
    first = results["calls"][str(results["tokens"][0])]
    lines += ["", f"Per-layer call at A = 1 (`MoEClient.lane`, layer {CALL_LAYER}) against the in-process "
              f"forward (`{first['cli'][0]['command']}` and the same at each T), in {len(first['cli'])} "
              f"rounds under the same load (each: the CLI at every T, then {first['cli'][0]['repeat']} lane "
              "calls per T, interleaved); and the transport's floor for one call (one peer, same T), ms:",
              ""]
    lines += call_table(results) + [""]
    for T in results["tokens"]:
        lines += table(results["rows"], T)
    what = {"app": "the app with nothing leased: replica, ranks, this driver",
            "session": f"an open session of {results['idle_peers']} joined peers, no calls: the same "
                       "processes",
            "serve_floor": "Ray Serve's floor: an idle trivial deployment's replica, this driver"}
    lines += [f"Idle, {results['idle_s']:g} s windows in turns (cores the processes named used):", ""]
    used = {k: [r["cores_used"] for r in vs] for k, vs in results["idle"].items()}
    lines += rounds_table("state", "cores", used, what, ".3f")
    lines += ["", "By process (median of rounds, cores): " + "; ".join(
        f"{state}: " + ", ".join(f"{role} {statistics.median(r['by_role'][role] for r in vs):.3f}"
                                 for role in vs[0]["by_role"])
        for state, vs in results["idle"].items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "dataplane", quick="A = 1 4, T = 4, 2 s per configuration", tp=2)
    ap.add_argument("--layers", type=int, default=3, help="MoE layers served and stepped through")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8], help="A: workers (peers)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32], help="T: rows per worker and layer")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed stepping per configuration")
    ap.add_argument("--calls", type=int, default=300, help="per-layer calls per T at A = 1 (all rounds)")
    ap.add_argument("--idle-s", type=float, default=3.0, help="each idle window")
    ap.add_argument("--cohort-idle-s", type=float, default=2.0,
                    help="a cohort's idle window right after it stepped (its session still open)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the per-layer calls and idle windows")
    ap.add_argument("--before-workers", type=int, nargs="+", default=[1, 4], help="A of the release before")
    ap.add_argument("--before-tokens", type=int, nargs="+", default=[4], help="T of the release before")
    ap.add_argument("--before-timeout-s", type=float, default=900.0)
    ap.add_argument("--no-before", action="store_true", help="skip the release before")
    args = ap.parse_args(argv)
    if args.quick:
        args.workers, args.tokens, args.seconds, args.calls, args.rounds = [1, 4], [4], 2.0, 100, 2
        args.before_workers, args.before_tokens = [1, 4], [4]
    ckpt = harness.preset_checkpoint("tiny", args.layers + 1)
    machine = harness.machine_record(with_ray=True)
    before = {"commit": BEFORE, "command": "-", "error": "skipped (--no-before)"}
    if not args.no_before:  # one Ray at a time: the release before runs its own, then this run starts one
        print(f"the release before ({BEFORE}): its bench_cohort.py", flush=True)
        before = run_before(args)
    print("the transport's floor", flush=True)
    call_floor = {str(T): harness.latency_ms(echo_floor(1, T, HIDDEN, 1, args.tp, min_steps=args.calls,
                                                        warmup=10).steps[0]) for T in args.tokens}
    rows = [measure_floor(M, T, args.layers, args.tp, args.seconds)
            for M in args.workers for T in args.tokens]
    rows += before.pop("rows", [])
    results = run_served(args, ckpt, rows)
    results.update(tp=args.tp, layers=args.layers, tokens=args.tokens, seconds=args.seconds, rows=rows,
                   call_floor=call_floor, calls_per_t=args.calls, idle_s=args.idle_s,
                   cohort_idle_s=args.cohort_idle_s, before=before, argv=args.argv,
                   machine=dict(machine, loadavg_after=harness.loadavg()))
    results["verdicts"] = verdicts(results)
    write_results(results, args.out, "dataplane", None, markdown, index_rows, args.docs)
    return 0 if results["verdicts"]["exact"]["met"] else 1


def run_served(args: Any, ckpt: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """This run's own Ray: the session, own_sessions and serve rows (appended to ``rows``), the
    per-layer calls at A = 1 and the idle rounds."""
    import ray
    from ray import cloudpickle

    from deployments.client import MoEClient

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors' classes travel by value
    spec = {"name": NAME, "tp_size": args.tp, "dtype": "float32", "auto_tune_tokens": "none",
            "max_tokens_per_request": max(args.workers) * max(args.tokens), "max_batch_tokens": 512,
            **({"tail": "sharded"} if args.tp > 1 else {})}
    with harness.local_serve(num_cpus=max(args.workers) + 4, num_gpus=args.tp):
        harness.deploy({"checkpoint": str(ckpt), "ingress_replicas": 1, "deployments": [spec]}, APP)
        client = MoEClient.direct(NAME, APP, timeout_s=300)
        layers = sorted(client.status()["layers"])
        pids = group_roles(client)
        for M in args.workers:
            for T in args.tokens:
                print(f"A = {M}, T = {T}", flush=True)
                workers = [ray.remote(SyntheticWorker).options(num_cpus=0).remote(T, HIDDEN, i, layers)
                           for i in range(M)]
                taking_part = {**pids, "workers": ray.get([w.pid.remote() for w in workers])}
                rows.append(measure_session(client, workers, taking_part, T, len(layers), args.seconds,
                                            args.cohort_idle_s))
                for mode in ("own_sessions", "serve"):
                    rows.append(measure_independent(client, workers, taking_part, mode, T, args.seconds))
                for actor in workers:
                    ray.kill(actor)
        print("per-layer calls at A = 1, and the in-process forwards (the CLI)", flush=True)
        calls = measure_calls(client, ckpt, args.tp, args.tokens, args.calls, args.rounds)
        print("idle", flush=True)
        floor_pid = idle_floor_app()
        idle = measure_idle(client, MoEClient(APP, timeout_s=300), pids, floor_pid, max(args.workers),
                            max(args.tokens), args.idle_s, args.rounds)
    return {"calls": {str(T): c for T, c in calls.items()}, "idle": idle, "idle_peers": max(args.workers)}


if __name__ == "__main__":
    raise SystemExit(main())
