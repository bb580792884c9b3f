"""Cohorts against independent lanes, the Serve path and Ray's own floor, in one run on one machine.

One local Ray instance (CPU, logical GPUs) serves --layers MoE layers of the tiny preset on one
TP --tp deployment. M attention workers (Ray actors whose attention is synthetic: T seeded rows
per layer, so what is measured is the tier's fast path) decode steps four ways:

* cohort: ``MoEClient(app).cohort(workers)``: one compiled graph, one execution per step, one
  group forward per layer of all M workers' rows;
* lanes: each worker opens its own ``MoEClient(app).lane()`` and calls it once per layer (the
  only replica's lease passes from worker to worker);
* serve: each worker calls ``MoEClient.forward`` once per layer (the replica's token-budget
  batching merges whatever arrives together);
* floor: Ray's own compiled graph of the same shape over echo actors (M workers -> P ranks that
  gather all M -> back, per layer, one execution per step; no project code), and floor_per_layer:
  the same exchange as a one-layer graph executed once per layer (a driver round trip per layer).

Per (mode, M, T): worker-steps/s, step p50/p90, group forwards per step of all M workers and
tokens per forward (the replica's own counters), and the CPU cores the machine kept busy while
stepping (/proc/stat); for the cohort also while its graph idled. A cohort step is checked bit
for bit against the Serve path's forward of the same concatenated rows. The cohort's graph is
measured at every M (nodes, channels, shared memory, compile time) and, with --k3-shape, at
Kimi-K3's 92 MoE layers, M = 8 workers, TP 8 (tiny weights; shared memory also at K3's
message sizes, H = 7168 in bf16).

    python scripts/bench_cohort.py                # TP 2, 3 MoE layers, M = 1 2 4 8, T = 1 4 32
    python scripts/bench_cohort.py --k3-shape     # ... and the 92-layer / M = 8 / TP 8 graph
    python scripts/bench_cohort.py --quick        # M = 1 4, T = 4 (a smoke run)

Targets: group forwards per step = MoE layers; at M = 4, T = 4 the cohort's worker-steps/s
>= 2x the same workers on independent lanes, and its step time <= 2x its M = 1 step time; an
M = 1 cohort within 10 % of a lane's worker-steps/s; the K3-shaped graph's shared memory
<= 1 GB per node. Results: JSON + PNG under --out and the "## Cohorts (scripts/bench_cohort.py)"
section of docs/benchmarks.md (--docs).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench import harness
from bench.docs import section_start, verdict, verdict_text, write_results, yes_no

from deployments.client import AttentionWorker
from deployments.client.cohort import graph_size_formula, row_bytes

APP, NAME = "cohortbench", "moe"
SECTION = "## Cohorts (scripts/bench_cohort.py)"
READY_S = 120.0  # an actor's start or a first execution on a loaded 2-core machine
WARMUP = 2  # untimed steps a worker takes on its own before timing
K3 = {"layers": 92, "workers": 8, "tp": 8, "hidden": 7168, "bytes": 2, "tokens": 4}


class SyntheticWorker(AttentionWorker):
    """An attention worker whose attention is a lookup: ``T`` seeded rows per layer."""

    def __init__(self, tokens: int, hidden: int, seed: int, layers: list[int]):
        self.rows = {layer: harness.seeded_randn(tokens, hidden, 1000 * seed + layer) for layer in layers}
        self.out: dict[int, torch.Tensor] = {}

    def start(self, step_input: Any) -> None:
        self.out = {}

    def attend(self, layer: int) -> torch.Tensor:
        return self.rows[layer]

    def absorb(self, layer: int, moe_out_TH: torch.Tensor) -> None:
        self.out[layer] = moe_out_TH

    def finish(self) -> int:
        return len(self.out)

    def abort(self) -> None:
        self.out = {}

    def outputs(self) -> dict[int, torch.Tensor]:
        return self.out

    def run_for(self, app: str, mode: str, tokens: int, seconds: float, warmup: int) -> list[float]:
        """Steps on its own for ``seconds`` (after ``warmup`` untimed ones): each MoE layer one
        call, through a lane of its own (``lanes``) or the Serve handles (``serve``); the
        duration of every timed step."""
        from deployments.client import MoEClient

        client = MoEClient(app, timeout_s=300)
        lane = client.lane(max_tokens=tokens, name=f"bench-{os.getpid()}") if mode == "lanes" else None
        call = lane.forward if lane is not None else client.forward
        layers = sorted(self.rows)
        steps: list[float] = []
        deadline = None
        try:
            while deadline is None or time.perf_counter() < deadline:
                start = time.perf_counter()
                self.start(None)
                for layer in layers:
                    self.absorb(layer, call(self.attend(layer), layer))
                self.finish()
                if warmup:
                    warmup -= 1
                    deadline = None if warmup else time.perf_counter() + seconds
                    continue
                steps.append(time.perf_counter() - start)
                deadline = deadline or start + seconds
        finally:
            if lane is not None:
                lane.close()
        return steps


# -- Ray's own floor: echo actors in the cohort's shape --------------------------------------------


class EchoWorker:
    def __init__(self, tokens: int, hidden: int):
        import numpy as np

        self.rows = np.ones((tokens, hidden), np.float32)

    def begin(self, step: Any) -> Any:
        return self.rows

    def next(self, *outs: Any) -> Any:
        return self.rows

    def end(self, *outs: Any) -> int:
        return 1


class EchoRank:
    def __init__(self, rank: int):
        self.rank = rank

    def gather(self, after: Any, *parts: Any) -> Any:
        import numpy as np

        return np.concatenate(parts) if self.rank == 0 else None


def floor_graph(workers: list[Any], ranks: list[Any], layers: int) -> Any:
    """M workers -> P ranks gathering all M -> back, ``layers`` times, in one graph."""
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as step:
        xs = [w.begin.bind(step) for w in workers]
        after: list[Any] = [None] * len(ranks)
        for layer in range(layers):
            after = [r.gather.bind(prev, *xs) for r, prev in zip(ranks, after, strict=True)]
            last = layer + 1 == layers
            xs = [(w.end if last else w.next).bind(after[0]) for w in workers]
        return MultiOutputNode(xs + after[1:])


def measure_floor(workers: list[Any], ranks: list[Any], layers: int, seconds: float) -> dict[str, Any]:
    """Steps/s of the cohort-shaped echo graph, one execution per step and one per layer."""
    import ray

    ray.get([a.__ray_ready__.remote() for a in workers + ranks], timeout=READY_S)
    per_step = floor_graph(workers, ranks, layers).experimental_compile(_max_inflight_executions=1)
    try:
        steps = timed(lambda: ray.get(per_step.execute(0), timeout=READY_S), seconds)
    finally:
        per_step.teardown()
    one_layer = floor_graph(workers, ranks, 1).experimental_compile(_max_inflight_executions=1)
    try:
        per_layer = timed(lambda: [ray.get(one_layer.execute(0), timeout=READY_S) for _ in range(layers)],
                          seconds)
    finally:
        one_layer.teardown()
    return {"floor": steps, "floor_per_layer": per_layer}


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


def busy_mark() -> tuple[float, float]:
    """The machine's busy CPU-seconds so far, and when they were read."""
    return harness.busy_cpu_s(), time.monotonic()


def cores_busy(before: tuple[float, float]) -> float:
    busy, when = busy_mark()
    return round((busy - before[0]) / (when - before[1]), 2)


def counters(client: Any) -> dict[str, int]:
    c = client.status()["counters"]
    return {"forwards": c["forwards"], "forward_tokens": c["forward_tokens"]}


def row(mode: str, workers: int, tokens: int, step_s: list[float], worker_steps: int, wall_s: float,
        busy: float, before: dict[str, int] | None = None, after: dict[str, int] | None = None,
        untimed: int = 0, **extra: Any) -> dict[str, Any]:
    """One measured configuration; ``untimed``: worker-steps the counters saw but ``step_s``
    does not hold (warm-up steps between ``before`` and ``after``)."""
    ms = harness.latency_ms(step_s)
    out = {"mode": mode, "workers": workers, "tokens": tokens, "worker_steps_per_s": worker_steps / wall_s,
           "step_p50_ms": ms["p50_ms"], "step_p90_ms": ms["p90_ms"], "cores_busy": busy, **extra}
    if before is not None:
        forwards = after["forwards"] - before["forwards"]
        out["forwards_per_step"] = forwards * workers / (worker_steps + untimed)
        out["tokens_per_forward"] = (after["forward_tokens"] - before["forward_tokens"]) / max(1, forwards)
    return out


def settled_counters(client: Any) -> dict[str, int]:
    """The replica's counters once two readings agree: it reads a lease's counters from its
    ranks every LANE_POLL_S and at the lease's end, so they trail the steps by that much."""
    from deployments.config.timeouts import LANE_POLL_S

    last = counters(client)
    while True:
        time.sleep(2 * LANE_POLL_S)
        now = counters(client)
        if now == last:
            return now
        last = now


def measure_cohort(client: Any, workers: list[Any], tokens: int, layers: int, seconds: float
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    import ray

    M = len(workers)
    with client.cohort(workers, max_tokens=tokens, name=f"bench-{M}x{tokens}") as cohort:
        cohort.step([None] * M)  # compiles the graph (and checks it runs)
        graph = dict(cohort.status()["graph"])
        idle = busy_mark()
        time.sleep(1.0)  # the graph exists, nothing steps: what its polling loops cost
        idle_busy = cores_busy(idle)
        for _ in range(3):  # untimed, before the counters are read
            cohort.step([None] * M)
        before, started = settled_counters(client), busy_mark()
        steps = timed(lambda: cohort.step([None] * M), seconds, warmup=0)
        busy = cores_busy(started)
        status = cohort.status()
        # exactness: the last step's rows against the Serve path's forward of all of them
        outs = ray.get([w.outputs.remote() for w in workers])
    after = settled_counters(client)
    exact = True
    for layer in range(1, layers + 1):
        xs = [harness.seeded_randn(tokens, 128, 1000 * i + layer) for i in range(M)]
        want = torch.split(client.forward(torch.cat(xs), layer), tokens)
        exact &= all(torch.equal(outs[i][layer], want[i]) for i in range(M))
    result = row("cohort", M, tokens, steps, M * len(steps), sum(steps), busy, before, after,
                 idle_cores_busy=idle_busy, exact=exact, graph_steps=status["graph_steps"],
                 serve_steps=status["serve_steps"])
    return result, {"workers": M, "tokens": tokens, "layers": layers, **graph}


def measure_independent(client: Any, workers: list[Any], mode: str, tokens: int, seconds: float
                        ) -> dict[str, Any]:
    import ray

    before, started, start = counters(client), busy_mark(), time.perf_counter()
    steps = ray.get([w.run_for.remote(APP, mode, tokens, seconds, WARMUP) for w in workers])
    wall, busy = time.perf_counter() - start, cores_busy(started)
    after = settled_counters(client)
    flat = [s for per in steps for s in per]
    # the workers' timed windows overlap; the rate counts every timed step over the longest window
    window = max(sum(per) for per in steps)
    return row(mode, len(workers), tokens, flat, len(flat), window, busy, before, after,
               untimed=WARMUP * len(workers), elapsed_s=wall)


def k3_shape(layers: int, workers: int, tp: int) -> dict[str, Any]:
    """The cohort graph at K3's shape on tiny weights: its size, compile time and a step."""
    import ray

    from deployments.client import MoEClient

    ckpt = harness.preset_checkpoint("tiny", layers + 1)
    spec = {"name": NAME, "tp_size": tp, "tail": "sharded", "dtype": "float32", "auto_tune_tokens": "none",
            "max_tokens_per_request": 64, "max_batch_tokens": 64, "lane_lease_s": 600.0}
    with harness.local_serve(num_cpus=4, num_gpus=tp):
        harness.deploy({"checkpoint": str(ckpt), "ingress_replicas": 1, "deployments": [spec]}, APP)
        client = MoEClient(APP, timeout_s=600)
        routes = sorted(client.layer_routes().layers[NAME])
        actors = [ray.remote(SyntheticWorker).options(num_cpus=0).remote(1, 128, i, routes)
                  for i in range(workers)]
        started = time.perf_counter()
        with client.cohort(actors, max_tokens=1, name="k3-shape", step_timeout_s=1800) as cohort:
            built_s = time.perf_counter() - started
            graph = dict(cohort.status()["graph"])
            first = time.perf_counter()
            cohort.step([None] * workers)
            step_s = time.perf_counter() - first
            exact_path = cohort.status()["path"]
    return {"layers": len(routes), "workers": workers, "tp": tp, "graph": graph, "cohort_built_s": built_s,
            "first_step_s": step_s, "path": exact_path}


# -- the report ------------------------------------------------------------------------------------


def pick(rows: list[dict[str, Any]], mode: str, workers: int, tokens: int) -> dict[str, Any] | None:
    return next((r for r in rows if (r["mode"], r["workers"], r["tokens"]) == (mode, workers, tokens)), None)


def verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rows, L = results["rows"], results["layers"]
    cohort = [r for r in rows if r["mode"] == "cohort"]
    out = {"forwards_per_step": verdict(max(abs(r["forwards_per_step"] - L) for r in cohort), "<=", 0.0)}
    c4, l4, c1 = pick(rows, "cohort", 4, 4), pick(rows, "lanes", 4, 4), pick(rows, "cohort", 1, 4)
    if c4 and l4:
        out["m4_vs_lanes"] = verdict(c4["worker_steps_per_s"] / l4["worker_steps_per_s"], ">=", 2.0)
    if c4 and c1:
        out["m4_step_vs_m1"] = verdict(c4["step_p50_ms"] / c1["step_p50_ms"], "<=", 2.0)
    pairs = [(pick(rows, "cohort", 1, T), pick(rows, "lanes", 1, T)) for T in results["tokens"]]
    ratios = [c["worker_steps_per_s"] / lane["worker_steps_per_s"] for c, lane in pairs if c and lane]
    if ratios:
        out["m1_vs_lane"] = verdict(min(ratios), ">=", 0.9)
    out["exact"] = verdict(float(all(r["exact"] for r in cohort)), ">=", 1.0)
    if results.get("k3"):
        out["k3_shm_gb"] = verdict(results["k3"]["shm_gb_at_k3_sizes"], "<=", 1.0)
    return out


def table(rows: list[dict[str, Any]], T: int) -> list[str]:
    lines = [f"**T = {T} rows per worker and layer**", "",
             "| mode | M | worker-steps/s | step p50 ms | step p90 ms | forwards/step | tokens/forward "
             "| cores busy |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["tokens"] != T:
            continue
        fw = f"{r['forwards_per_step']:.2f}" if "forwards_per_step" in r else "-"
        tf = f"{r['tokens_per_forward']:.1f}" if "tokens_per_forward" in r else "-"
        lines.append(f"| {r['mode']} | {r['workers']} | {r['worker_steps_per_s']:.1f} "
                     f"| {r['step_p50_ms']:.2f} | {r['step_p90_ms']:.2f} | {fw} | {tf} "
                     f"| {r['cores_busy']:.2f} |")
    return lines + [""]


def findings(results: dict[str, Any]) -> list[str]:
    v, L, rows = results["verdicts"], results["layers"], results["rows"]
    lines = [f"- Group forwards per step = MoE layers ({L}) for the cohort at every M and T: largest "
             f"deviation {verdict_text(v['forwards_per_step'], '.2f')}."]
    if "m4_vs_lanes" in v:
        lines.append("- M = 4, T = 4: cohort worker-steps/s over the same workers on their own lanes "
                     f"{verdict_text(v['m4_vs_lanes'])}.")
    if "m4_step_vs_m1" in v:
        lines.append("- M = 4, T = 4: cohort step p50 over its M = 1 step p50 "
                     f"{verdict_text(v['m4_step_vs_m1'])}.")
    if "m1_vs_lane" in v:
        lines.append("- M = 1: cohort worker-steps/s over one lane's, lowest over T "
                     f"{verdict_text(v['m1_vs_lane'])}.")
    exact = yes_no(v["exact"]["met"])
    lines.append("- Every cohort step checked equals the Serve path's forward of the same concatenated rows "
                 f"bit for bit: {exact}.")
    floors = [(r, pick(rows, "floor_per_layer", r["workers"], r["tokens"]))
              for r in rows if r["mode"] == "floor"]
    if floors:
        ratio = statistics.median(b["step_p50_ms"] / a["step_p50_ms"] for a, b in floors if b)
        lines.append("- Why one execution per step: on Ray's own echo graph of the same shape, executing it "
                     f"once per layer (a driver round trip each) takes {ratio:.2f}x the step time of one "
                     "execution per step (median over M and T).")
    T = 4 if 4 in results["tokens"] else results["tokens"][0]
    scaling = {m: (pick(rows, m, 4, T), pick(rows, m, 1, T)) for m in ("floor", "cohort", "lanes")}
    if all(a and b for a, b in scaling.values()):
        per_mode = ", ".join(f"{mode} {a['worker_steps_per_s'] / b['worker_steps_per_s']:.2f}x"
                             for mode, (a, b) in scaling.items())
        lines.append(f"- Worker-steps/s at M = 4 over M = 1 (T = {T}): {per_mode}. Ray's own echo graph "
                     "(no project code) is the ceiling of what one graph gains from more workers on this "
                     f"machine: each of its {results['machine'].get('cpus', '?')} cores runs a polling loop.")
    idle = [r for r in rows if r["mode"] == "cohort" and r["tokens"] == results["tokens"][0]]
    if idle:
        per_m = ", ".join(f"M = {r['workers']}: {r['idle_cores_busy']:.2f}" for r in idle)
        lines.append("- Cores the machine kept busy while a compiled cohort graph sat idle (no step): "
                     f"{per_m} (an idle cohort drops its graph after half a lease term).")
    return lines


def graph_lines(results: dict[str, Any]) -> list[str]:
    lines = ["", "Graph size (one group; nodes, channels between processes, shared-memory bytes once each "
             "channel holds its largest message, compile time) against the formula in "
             "`deployments/client/cohort.py`:", "",
             "| L | M | T | TP | nodes (formula) | channels (formula) | shm bytes (formula) | compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for g in results["graphs"]:
        f = g["formula"]
        lines.append(f"| {g['layers']} | {g['workers']} | {g['tokens']} | {g['tp']} "
                     f"| {g['nodes']} ({f['nodes']}) | {g['channels']} ({f['channels']}) "
                     f"| {g['shm_bytes_in_use']:,} ({f['shm_bytes_in_use']:,}) | {g['compile_s']:.2f} |")
    k3 = results.get("k3")
    if k3:
        g, shm = k3["graph"], verdict_text(results["verdicts"]["k3_shm_gb"], ".3f")
        lines += ["", f"- Kimi-K3's shape ({k3['layers']} MoE layers, M = {k3['workers']}, TP {k3['tp']}, "
                  f"tiny weights): {g['nodes']} nodes, {g['channels']} channels, compiled in "
                  f"{g['compile_s']:.1f} s (cohort built in {k3['cohort_built_s']:.1f} s, first step "
                  f"{k3['first_step_s']:.1f} s on this machine, path {k3['path']}). At K3's message sizes "
                  f"(H = 7168, bf16, T = {K3['tokens']} rows per worker) its channels hold "
                  f"{shm} GB per node."]
    return lines


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    what = (f"tiny preset, TP {results['tp']}, {results['layers']} MoE layers, one replica, float32, "
            f"{results['seconds']:g} s per configuration")
    lines = [section_start(SECTION, "bench_cohort", results["argv"], results["machine"], what, json_path,
                           png_path), ""]
    lines += ["Worker-steps/s is decode steps finished per second summed over the M workers; forwards/step "
              "counts the group's forwards per decode step of all M workers (the replica's counters); "
              "cores busy is the whole machine's non-idle CPU while stepping (every graph loop polls its "
              "channels).", ""]
    for T in results["tokens"]:
        lines += table(results["rows"], T)
    return "\n".join(lines + findings(results) + graph_lines(results)) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    plt = harness.pyplot()
    tokens = results["tokens"]
    fig, axes = plt.subplots(1, len(tokens), figsize=(5 * len(tokens), 4), squeeze=False)
    for ax, T in zip(axes[0], tokens, strict=True):
        for mode in ("cohort", "lanes", "serve", "floor"):
            pts = sorted((r["workers"], r["worker_steps_per_s"]) for r in results["rows"]
                         if r["mode"] == mode and r["tokens"] == T)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
        ax.set(title=f"T = {T}", xlabel="workers M", ylabel="worker-steps/s", xscale="log", yscale="log")
        ax.legend()
    harness.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "bench_cohort", quick="M = 1 4, T = 4, 2 s per configuration")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=3, help="MoE layers served and stepped through")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--seconds", type=float, default=4.0, help="timed stepping per configuration")
    ap.add_argument("--k3-shape", action="store_true", help="also build the 92-layer / M = 8 / TP 8 graph")
    args = ap.parse_args(argv)
    if args.quick:
        args.workers, args.tokens, args.seconds = [1, 4], [4], 2.0
    import ray
    from ray import cloudpickle

    from deployments.client import MoEClient

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors' classes travel by value
    ckpt = harness.preset_checkpoint("tiny", args.layers + 1)
    spec = {"name": NAME, "tp_size": args.tp, "dtype": "float32", "auto_tune_tokens": "none",
            "max_tokens_per_request": max(args.workers) * max(args.tokens), "max_batch_tokens": 512,
            **({"tail": "sharded"} if args.tp > 1 else {})}
    machine = harness.machine_record(with_ray=True)
    rows, graphs = [], []
    with harness.local_serve(num_cpus=max(args.workers) + 4, num_gpus=args.tp):
        harness.deploy({"checkpoint": str(ckpt), "ingress_replicas": 1, "deployments": [spec]}, APP)
        client = MoEClient.direct(NAME, APP, timeout_s=300)
        layers = sorted(client.status()["layers"])
        for M in args.workers:
            for T in args.tokens:
                print(f"M = {M}, T = {T}", flush=True)
                workers = [ray.remote(SyntheticWorker).options(num_cpus=0).remote(T, 128, i, layers)
                           for i in range(M)]
                result, graph = measure_cohort(client, workers, T, len(layers), args.seconds)
                rows.append(result)
                size = graph_size_formula(len(layers), M, [(args.tp, len(layers))], row_bytes(T, 128, 4))
                graphs.append({**graph, "tp": args.tp, "formula": size})
                for mode in ("lanes", "serve"):
                    rows.append(measure_independent(client, workers, mode, T, args.seconds))
                echo_workers = [ray.remote(EchoWorker).options(num_cpus=0).remote(T, 128) for _ in range(M)]
                echo_ranks = [ray.remote(EchoRank).options(num_cpus=0).remote(r) for r in range(args.tp)]
                started = busy_mark()
                for mode, steps in measure_floor(echo_workers, echo_ranks, len(layers), args.seconds).items():
                    rows.append(row(mode, M, T, steps, M * len(steps), sum(steps), cores_busy(started)))
                for actor in workers + echo_workers + echo_ranks:
                    ray.kill(actor)
    results = {"tp": args.tp, "layers": len(layers), "tokens": args.tokens, "seconds": args.seconds,
               "rows": rows, "graphs": graphs, "argv": args.argv}
    if args.k3_shape:
        print("the K3-shaped graph", flush=True)
        k3 = k3_shape(K3["layers"], K3["workers"], K3["tp"])
        size = graph_size_formula(k3["layers"], k3["workers"], [(k3["tp"], k3["layers"])],
                                  row_bytes(K3["tokens"], K3["hidden"], K3["bytes"]))
        k3["formula"] = size
        k3["shm_gb_at_k3_sizes"] = size["shm_bytes_in_use"] / 1e9
        results["k3"] = k3
        graphs.append({**k3["graph"], "layers": k3["layers"], "workers": k3["workers"], "tp": k3["tp"],
                       "tokens": 1,
                       "formula": graph_size_formula(k3["layers"], k3["workers"], [(k3["tp"], k3["layers"])],
                                                     row_bytes(1, 128, 4))})
    results["machine"] = dict(machine, loadavg_after=harness.loadavg())
    results["verdicts"] = verdicts(results)
    write_results(results, args.out, "bench_cohort", plot, markdown, args.docs)
    return 0 if results["verdicts"]["exact"]["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
