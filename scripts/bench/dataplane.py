"""The data plane against the transport's own floor (the page says how to read it): A workers step
--layers MoE layers of the tiny preset as one session's peers, each on a lane of its own, through
``MoEClient.forward`` and over raw TCP; and a lane's per-layer call at A = 1 against the in-process forward.

    python -m scripts.bench.dataplane            # A = 1 2 4 8, T = 1 4 32: ~12 min on 2 cores
    python -m scripts.bench.dataplane --quick    # A = 1 4, T = 4 (a smoke run)
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
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
from .docs import Target, section_start, table, target, target_lines, verdict, yes_no
from .floor import echo_floor
from .rss import Cores, Roles, serve_replica_pid

APP, NAME = "dataplanebench", "moe"
SECTION = "# Data plane vs the transport's floor (scripts/bench/dataplane.py)"
CALL_LAYER = 1  # the layer of the per-call measurement
HIDDEN = 128  # the tiny preset's hidden size
WARMUP = 2  # untimed steps a worker takes on its own before timing
TARGETS = {"call_over_inprocess_ms": 0.5, "m4_vs_own_sessions": 2.0}
MODES = ("session", "own_sessions", "serve", "floor")


def cli_forward_ms(checkpoint: str | Path, tp: int, T: int, repeat: int) -> dict[str, Any]:
    """The median forward of ``python -m moe_runtime forward`` (local gloo ranks, no Ray) of ``CALL_LAYER``
    at TP ``tp`` on ``T`` seeded float32 rows (seed ``T``, as ``harness.seeded_randn``), ``repeat`` times."""
    layer = CALL_LAYER
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "moe_runtime", "forward", "--checkpoint", str(checkpoint), "--layer",
               str(layer), "--tp", str(tp), "--dtype", "float32", "--random-input", str(T), "--seed", str(T),
               "--repeat", str(repeat), *(["--tail", "sharded"] if tp > 1 else []),
               "--output", f"{tmp}/out.safetensors"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    m = re.search(r"^forward ms: first [\d.]+, median ([\d.]+) over \d+$", out, re.M)
    if m is None:
        raise RuntimeError(f"no 'forward ms' line in the output of {' '.join(cmd)}:\n{out}")
    return {"tp": tp, "T": T, "layer": layer, "repeat": repeat, "median_ms": float(m.group(1)),
            "command": "python -m moe_runtime " + " ".join(cmd[3:-2])}


class SyntheticWorker(RowsWorker):
    """An attention worker whose attention is a lookup: ``T`` seeded rows per layer."""

    def __init__(self, tokens: int, hidden: int, seed: int, layers: list[int]):
        super().__init__({layer: harness.seeded_randn(tokens, hidden, 1000 * seed + layer)
                          for layer in layers})

    def finish(self) -> int:  # a step's answer: how many layers came back (the driver needs no rows)
        return len(self.out)

    def outputs(self) -> dict[int, torch.Tensor]:
        return self.out

    def pid(self) -> int:
        return os.getpid()

    def run_for(self, app: str, mode: str, tokens: int, seconds: float, warmup: int) -> dict[str, Any]:
        """Steps alone for ``seconds`` after ``warmup`` steps, a call per layer on a lane of its own
        (``own_sessions``) or the Serve path: each step's seconds, the timed window (``time.monotonic``,
        one clock for the machine's processes) and where a lane's calls went."""
        from deployments.client import MoEClient

        client = MoEClient(app, timeout_s=300)
        lane = client.lane(max_tokens=tokens, name=f"bench-{os.getpid()}") if mode == "own_sessions" else None
        call = lane.forward if lane is not None else client.forward
        steps: list[float] = []
        began, deadline = None, math.inf
        with lane or contextlib.nullcontext():
            for i in itertools.count():  # the first ``warmup`` steps untimed
                start, at = time.perf_counter(), time.monotonic()
                self.start(None)
                for layer in sorted(self.rows):
                    self.absorb(layer, call(self.attend(layer), layer))
                self.finish()
                if i == warmup:
                    began, deadline = at, start + seconds
                if i >= warmup:
                    steps.append(time.perf_counter() - start)
                if time.perf_counter() >= deadline:
                    break
            window = [began, time.monotonic()]
            counts = lane.status()["deployments"] if lane is not None else {}
        return {"steps": steps, "window": window,
                "lane_calls": sum(c["session_calls"] for c in counts.values()),
                "serve_calls": sum(c["serve_calls"] for c in counts.values())}


def counters(client: Any) -> dict[str, Any]:
    c = client.status()["counters"]
    return {"forwards": c["forwards"], "forward_tokens": c["forward_tokens"],
            "session_forwards": c["sessions"]["forwards"], "session_busy_s": c["sessions"]["busy_s"]}


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
        ran = after["session_forwards"] - before["session_forwards"]
        if ran:  # rank 0's time per session forward: the group's forward, its hand-off to the other ranks
            out["group_forward_ms"] = (after["session_busy_s"] - before["session_busy_s"]) * 1e3 / ran
    return out


def measure_session(client: Any, workers: list[Any], pids: Roles, tokens: int, layers: int,
                    seconds: float) -> dict[str, Any]:
    """The A workers as one session's peers (a cohort), stepping."""
    import ray

    M = len(workers)
    with client.cohort(workers, max_tokens=tokens, name=f"bench-{M}x{tokens}") as cohort:
        for _ in range(3):  # untimed, before the counters are read
            cohort.step([None] * M)
        before, cores = counters(client), Cores(pids)
        steps = harness.time_calls(lambda: cohort.step([None] * M), 3, warmup=0, min_time_s=seconds)
        stepping = cores.read()
        outs = ray.get([w.outputs.remote() for w in workers])  # the last step's rows
        status = cohort.status()
    after = counters(client)
    exact = True  # the last step's rows against the Serve path's forward of all of them
    for layer in range(1, layers + 1):
        xs = [harness.seeded_randn(tokens, HIDDEN, 1000 * i + layer) for i in range(M)]
        want = torch.split(client.forward(torch.cat(xs), layer), tokens)
        exact &= all(torch.equal(outs[i][layer], want[i]) for i in range(M))
    on_session = status["serve_steps"] == 0 and status["reruns"] == 0 and status["path"] == "session"
    return row("session", M, tokens, steps, M * len(steps), sum(steps), stepping, before, after,
               exact=exact, on_session=on_session, valid=exact and on_session,
               **{k: status[k] for k in ("session_steps", "serve_steps", "reruns", "sessions", "aborts")})


def measure_independent(client: Any, workers: list[Any], pids: Roles, mode: str, tokens: int,
                        seconds: float) -> dict[str, Any]:
    import ray

    before, cores, start = counters(client), Cores(pids), time.perf_counter()
    runs = ray.get([w.run_for.remote(APP, mode, tokens, seconds, WARMUP) for w in workers])
    wall, stepping = time.perf_counter() - start, cores.read()
    after = counters(client)
    flat = [s for run in runs for s in run["steps"]]
    # Every timed step over the span from the first timed step's start to the last one's end: the
    # workers' windows overlap where they run side by side, and follow each other where they wait.
    span = max(run["window"][1] for run in runs) - min(run["window"][0] for run in runs)
    overlap = sum(run["window"][1] - run["window"][0] for run in runs) / span
    extra = {} if mode != "own_sessions" else {k: sum(run[k] for run in runs)
                                                for k in ("lane_calls", "serve_calls")}
    return row(mode, len(workers), tokens, flat, len(flat), span, stepping, before, after,
               untimed=WARMUP * len(workers), elapsed_s=wall, span_s=span, overlap=overlap, **extra)


def measure_floor(workers: int, tokens: int, layers: int, tp: int, seconds: float) -> dict[str, Any]:
    floor = echo_floor(workers, tokens, HIDDEN, layers, tp, min_time_s=seconds)
    flat = [s for steps in floor.steps for s in steps]
    return row("floor", workers, tokens, flat, len(flat), max(map(sum, floor.steps)),
               {"cores_busy": floor.cores_busy})


def measure_calls(client: Any, ckpt: Path, tp: int, tokens: list[int], calls: int, rounds: int
                  ) -> dict[int, dict[str, Any]]:
    """A lane's per-layer call against the in-process forward, in rounds: the CLI at every T, a lane's
    calls at every T (interleaved), then as many at the first T alone (rank 0's forward times)."""
    xs = {T: harness.seeded_randn(T, HIDDEN, seed=T) for T in tokens}
    per_round = max(1, calls // rounds)
    last: dict[int, Any] = {}
    out = {T: {"times": [], "cli": [], "paired_ms": [], "exact": True, "on_lane": True, "served_ms": []}
           for T in tokens}

    def call(lane: Any, T: int) -> None:
        last[T] = lane.forward(xs[T], CALL_LAYER)

    for _ in range(rounds):
        for T in tokens:
            out[T]["cli"].append(cli_forward_ms(ckpt, tp, T, per_round))
        before = counters(client)
        with client.lane(max_tokens=max(tokens), name="bench-calls") as lane:
            times = harness.time_interleaved({T: lambda T=T: call(lane, T) for T in tokens}, per_round)
            for _ in range(per_round):
                call(lane, tokens[0])
            status = lane.status()["deployments"][NAME]
        deadline = time.monotonic() + 60  # until the replica has no open session (rank 0 pushes each end)
        while client.status()["sessions"]["open"]:
            if time.monotonic() > deadline:
                raise TimeoutError("the replica still has an open session 60 s on")
            time.sleep(0.1)
        # The lane's last per_round forwards were the first T's calls alone.
        if counters(client)["session_forwards"] - before["session_forwards"] >= per_round:
            out[tokens[0]]["served_ms"] += client.status()["sessions"]["group"]["recent_ms"][-per_round:]
        on_lane = status["path"] == "session" and status["serve_calls"] == 0 and status["reruns"] == 0
        for T, got in out.items():
            got["times"] += times[T]
            got["paired_ms"].append(harness.median_ms(times[T]) - got["cli"][-1]["median_ms"])
            got["exact"] &= torch.equal(last[T], client.forward(xs[T], CALL_LAYER))
            got["on_lane"] &= on_lane
    for got in out.values():
        times = got.pop("times")
        got.update(lane=harness.latency_ms(times), calls=len(times), over_inprocess_ms=statistics.median(
            got["paired_ms"]), inprocess_ms=statistics.median(c["median_ms"] for c in got["cli"]))
    return out


def pick(rows: list[dict[str, Any]], mode: str, workers: int, tokens: int) -> dict[str, Any] | None:
    return next((r for r in rows if (r["mode"], r["workers"], r["tokens"]) == (mode, workers, tokens)), None)


def call_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per T: the lane's per-layer call p50 at A = 1 against the in-process forward and the floor."""
    out = []
    for T in results["tokens"]:
        lane, floor = results["calls"][str(T)], results["call_floor"][str(T)]["p50_ms"]
        served = lane.get("served_ms") or []
        out.append({"T": T, "lane_p50_ms": lane["lane"]["p50_ms"], "lane_p90_ms": lane["lane"]["p90_ms"],
                    "inprocess_ms": lane["inprocess_ms"], "over_inprocess_ms": lane["over_inprocess_ms"],
                    "floor_p50_ms": floor, "over_floor_ms": lane["over_inprocess_ms"] - floor,
                    "rounds_ms": lane["paired_ms"], "served_n": len(served),
                    "served_p50_ms": statistics.median(served) if served else None,
                    "valid": lane["exact"] and lane["on_lane"]})
    return out


def verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target's verdict; a fast but invalid measurement (steps off the session or not
    bit-equal) misses its target."""
    rows = results["rows"]
    sessions = [r for r in rows if r["mode"] == "session"]
    one = next((c for c in call_rows(results) if c["T"] == 1), None)
    call = verdict(one and one["over_inprocess_ms"], "<=", TARGETS["call_over_inprocess_ms"])
    s4, o4 = pick(rows, "session", 4, 4), pick(rows, "own_sessions", 4, 4)
    m4 = verdict(s4 and o4 and s4["worker_steps_per_s"] / o4["worker_steps_per_s"], ">=",
                 TARGETS["m4_vs_own_sessions"])
    for v, valid in ((call, one and one["valid"]), (m4, s4 and s4.get("valid", True))):
        v["met"] = v["met"] and bool(valid)
    return {"call_over_inprocess": call, "m4_vs_own_sessions": m4,
            "forwards_per_step": verdict(max(abs(r["forwards_per_step"] - results["layers"])
                                             for r in sessions), "<=", 0.0),
            "exact": verdict(float(all(r["exact"] for r in sessions)), ">=", 1.0)}


def index_rows(results: dict[str, Any]) -> list[Target]:
    v = verdicts(results)
    return [target("lane - in-process per-layer call, A = 1, T = 1", v["call_over_inprocess"], "+.3f", " ms"),
            target("worker-steps/s, session / own sessions, A = 4, T = 4", v["m4_vs_own_sessions"]),
            target("group forwards per session step - MoE layers, largest", v["forwards_per_step"]),
            target("every session step bit-equal to the Serve path's", v["exact"]["met"])]


def cell(r: dict[str, Any], key: str, fmt: str) -> str:
    return "-" if r.get(key) is None else f"{r[key]:{fmt}}"


def step_table(rows: list[dict[str, Any]], T: int) -> list[str]:
    head = ("mode | A | worker-steps/s | step p50 ms | step p90 ms | forwards/step | tokens/forward "
            "| cores busy (machine) | cores used (its processes)")
    ours = sorted((r for r in rows if r["tokens"] == T), key=lambda r: (MODES.index(r["mode"]), r["workers"]))
    cells = [[r["mode"] + ("" if r.get("valid", True) else " (**invalid**)"), r["workers"],
              f"{r['worker_steps_per_s']:.1f}", f"{r['step_p50_ms']:.2f}", f"{r['step_p90_ms']:.2f}",
              cell(r, "forwards_per_step", ".2f"), cell(r, "tokens_per_forward", ".1f"),
              cell(r, "cores_busy", ".2f"), cell(r, "cores_used", ".2f")] for r in ours]
    return [f"**T = {T} rows per worker and layer**", "", *table(head, cells, "ll" + "r" * 7), ""]


def call_table(results: dict[str, Any]) -> list[str]:
    return table("T | lane p50 ms | lane p90 ms | in-process ms | lane - in-process (rounds) "
                 "| transport floor p50 | lane - in-process - floor | bit-equal, on the lane",
                 ([c["T"], f"{c['lane_p50_ms']:.3f}", f"{c['lane_p90_ms']:.3f}", f"{c['inprocess_ms']:.2f}",
                   f"**{c['over_inprocess_ms']:+.3f}** ({', '.join(f'{v:+.2f}' for v in c['rounds_ms'])})",
                   f"{c['floor_p50_ms']:.3f}", f"{c['over_floor_ms']:+.3f}", yes_no(c["valid"])]
                  for c in call_rows(results)), "lrrrlrrl")


def findings(results: dict[str, Any]) -> list[str]:
    """Where the A = 1, T = 1 call's time and an A = 4, T = 4 session step go, and how A scales."""
    L, rows, T = results["layers"], results["rows"], 4 if 4 in results["tokens"] else results["tokens"][0]
    one = next((c for c in call_rows(results) if c["T"] == 1), None)
    s4, o4, cells = pick(rows, "session", 4, 4), pick(rows, "own_sessions", 4, 4), []
    if one and (served := one.get("served_p50_ms")) is not None:
        cells += [["A = 1, T = 1: the served forward (rank 0's, hand-off included; p50), against the CLI",
                   f"{served:.3f} ms ({served - one['inprocess_ms']:+.3f} ms; {one['served_n']} forwards)"],
                  ["A = 1, T = 1: lane p50 - served forward; the floor's whole round trip",
                   f"{one['lane_p50_ms'] - served:.3f} ms; {one['floor_p50_ms']:.3f} ms"]]
    if s4 and (each := s4.get("group_forward_ms")):
        step = 4e3 / s4["worker_steps_per_s"]
        cells.append([f"A = 4, T = 4 session step: group step; its {L} forwards (rank 0's busy time); the "
                      "rest; machine cores busy", f"{step:.1f} ms; {L * each:.1f} ms ({each:.2f} each); "
                      f"{step - L * each:.1f} ms; {s4['cores_busy']:.2f}"])
    if o4 and "lane_calls" in o4:
        cells.append(["own_sessions, A = 4, T = 4: calls on a worker's own session / on the Serve path; the "
                      "workers' timed windows overlapping (of 4), spanning", f"{o4['lane_calls']} / "
                      f"{o4['serve_calls']}; {o4['overlap']:.2f}-fold, {o4['span_s']:.1f} s"])
    cells.append(["every timed session step on the session (no Serve-path step, no rerun)",
                  yes_no(all(r["on_session"] for r in rows if r["mode"] == "session"))])
    pairs = {m: (pick(rows, m, 4, T), pick(rows, m, 1, T)) for m in ("floor", "session")}
    if scaling := [f"{m} {a['worker_steps_per_s'] / b['worker_steps_per_s']:.2f}x"
                   for m, (a, b) in pairs.items() if a and b]:
        cells.append([f"worker-steps/s at A = 4 over A = 1 (T = {T})", ", ".join(scaling)])
    return table("finding | measured", cells)


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    what = (f"tiny preset, TP {results['tp']}, {results['layers']} MoE layers, one replica, float32, sharded "
            f"tail, {results['seconds']:g} s per configuration")
    cli = results["calls"][str(results["tokens"][0])]["cli"]
    lines = [section_start(SECTION, "dataplane", results["argv"], results["machine"], what, json_path), "",
             *target_lines(index_rows(results)), "", *findings(results), "",
             f"Per-layer call at A = 1 (layer {CALL_LAYER}) against `{cli[0]['command']}` (the same at each "
             f"T), {len(cli)} rounds of {cli[0]['repeat']} lane calls per T; the floor: one peer, ms:", "",
             *call_table(results), ""]
    for T in results["tokens"]:
        lines += step_table(results["rows"], T)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "dataplane", quick="A = 1 4, T = 4, 2 s per configuration", tp=2)
    ap.add_argument("--layers", type=int, default=3, help="MoE layers served and stepped through")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8], help="A: workers (peers)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32], help="T: rows per worker and layer")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed stepping per configuration")
    ap.add_argument("--calls", type=int, default=300, help="per-layer calls per T at A = 1 (all rounds)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the per-layer calls")
    args = ap.parse_args(argv)
    if args.quick:
        args.workers, args.tokens, args.seconds, args.calls, args.rounds = [1, 4], [4], 2.0, 100, 2
    ckpt = harness.preset_checkpoint("tiny", args.layers + 1)
    machine = harness.machine_record(with_ray=True)
    print("the transport's floor", flush=True)
    call_floor = {str(T): harness.latency_ms(echo_floor(1, T, HIDDEN, 1, args.tp, min_steps=args.calls,
                                                        warmup=10).steps[0]) for T in args.tokens}
    rows = [measure_floor(M, T, args.layers, args.tp, args.seconds)
            for M in args.workers for T in args.tokens]
    results = run_served(args, ckpt, rows)
    results.update(tp=args.tp, layers=args.layers, tokens=args.tokens, seconds=args.seconds, rows=rows,
                   call_floor=call_floor, calls_per_t=args.calls)
    results["verdicts"] = v = verdicts(results)
    return harness.report(args, results, machine, markdown, index_rows, ok=v["exact"]["met"])


def run_served(args: Any, ckpt: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """This run's own Ray: the session, own_sessions and serve rows (appended to ``rows``) and the
    per-layer calls at A = 1."""
    import ray
    from ray import cloudpickle

    from deployments.client import MoEClient

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors' classes travel by value
    spec = {"name": NAME, "tp_size": args.tp, "dtype": "float32", "auto_tune_tokens": "none",
            "max_tokens_per_request": max(args.workers) * max(args.tokens), "max_batch_tokens": 512,
            **({"tail": "sharded"} if args.tp > 1 else {})}
    app_args = {"checkpoint": str(ckpt), "ingress_replicas": 1, "deployments": [spec]}
    with harness.serving(app_args, APP, num_cpus=max(args.workers) + 4, num_gpus=args.tp):
        client = MoEClient.direct(NAME, APP, timeout_s=300)
        layers = sorted(client.status()["layers"])
        pids = {"replica": [serve_replica_pid(APP, NAME)], "driver": [os.getpid()],
                **{f"rank{w['rank']}": [w["pid"]] for w in client.status()["workers"]}}
        for M in args.workers:
            for T in args.tokens:
                print(f"A = {M}, T = {T}", flush=True)
                workers = [ray.remote(SyntheticWorker).options(num_cpus=0).remote(T, HIDDEN, i, layers)
                           for i in range(M)]
                taking_part = {**pids, "workers": ray.get([w.pid.remote() for w in workers])}
                rows.append(measure_session(client, workers, taking_part, T, len(layers), args.seconds))
                for mode in ("own_sessions", "serve"):
                    rows.append(measure_independent(client, workers, taking_part, mode, T, args.seconds))
                for actor in workers:
                    ray.kill(actor)
        print("per-layer calls at A = 1, and the in-process forwards (the CLI)", flush=True)
        calls = measure_calls(client, ckpt, args.tp, args.tokens, args.calls, args.rounds)
    return {"calls": {str(T): c for T, c in calls.items()}}


if __name__ == "__main__":
    raise SystemExit(main())
