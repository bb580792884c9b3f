"""What an idle TP group costs the machine, with and without tearing its compiled graph down.

Ray 2.60's compiled-graph loops poll their channels while they wait: an idle graph keeps about a
core per rank, and the replica's reader another, busy. A replica therefore tears its graph down
after ``graph_idle_s`` without a forward and compiles it again at the next one. One run, side by
side (tiny checkpoint, float32, TP 2, layer 1, one private Ray):

* ``keep``: a deployment whose graph is never dropped (``graph_idle_s`` 3600: the behaviour
  before the change);
* ``drop``: the same deployment with ``graph_idle_s`` of ``--idle-s``;
* ``actor_calls``: the same deployment without a compiled graph (``compiled_graph: false``);
* ``floor``: Ray's own: a bare compiled graph of the same shape (driver -> 2 echo actors ->
  driver, ``enable_asyncio``), idle, and after its teardown.

For each, the CPU its processes (the replica and its ranks; the floor's actors and this process)
use over ``--window-s`` seconds once every deployment has been idle for ``--idle-s`` + 1 s,
measured in turns so load from elsewhere hits them alike (``keep`` is an application of its own,
deleted before the floor is measured: two polling graphs would share the cores). And the price
of the drop: a forward after the graph was dropped (it compiles the graph again) against a
forward on a warm graph, ``--reps`` times each, with the answers compared bit for bit.

    python scripts/bench_idle.py            # ~2 minutes on 2 cores

Targets: the dropped group idles at <= 0.1 cores (the kept one: about P + 1); the forward that
compiles the graph again costs <= 1 s over a warm one (p50).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench import harness
from bench.docs import rounds_table, section_start, verdict, verdict_text, write_results, yes_no
from bench.rss import cpu_seconds, serve_replica_pid

APP, KEEP_APP, LAYER, TP = "idle", "idle_keep", 1, 2
SECTION = "## Idle TP groups: compiled graphs torn down when idle (`scripts/bench_idle.py`)"

def app_of(deployment: str) -> str:
    return KEEP_APP if deployment == "keep" else APP


def group_pids(client: Any, deployment: str) -> list[int]:
    """The replica's and its ranks' processes."""
    ranks = [w["pid"] for w in client.status()["workers"]]
    return [serve_replica_pid(app_of(deployment), deployment), *ranks]


def cores(pids: list[int], window_s: float) -> float:
    """The cores ``pids`` kept busy over the next ``window_s`` seconds."""
    before, t0 = cpu_seconds(pids), time.monotonic()
    time.sleep(window_s)
    return (cpu_seconds(pids) - before) / (time.monotonic() - t0)


class FloorGraph:
    """Ray's floor: driver -> 2 echo actors -> driver as an asyncio compiled graph, idle."""

    def __init__(self) -> None:
        import ray
        from ray.dag import InputNode, MultiOutputNode

        @ray.remote(num_cpus=0)
        class Echo:
            def pid(self) -> int:
                return os.getpid()

            def echo(self, x: Any) -> Any:
                return x

        self.actors = [Echo.remote() for _ in range(TP)]
        self.pids = [*ray.get([a.pid.remote() for a in self.actors]), os.getpid()]
        with InputNode() as inp:
            self.dag = MultiOutputNode([a.echo.bind(inp) for a in self.actors])
        self.loop = asyncio.new_event_loop()
        self.graph = self.loop.run_until_complete(self._compile_and_call())

    async def _compile_and_call(self) -> Any:
        graph = self.dag.experimental_compile(enable_asyncio=True)
        await asyncio.gather(*await graph.execute_async(1))
        return graph

    def teardown(self) -> None:
        self.graph.teardown()
        self.loop.run_until_complete(asyncio.sleep(0.1))  # the graph's reader and writer tasks end
        self.loop.close()


def idle_cores(groups: dict[str, list[int]], window_s: float, rounds: int) -> dict[str, list[float]]:
    """Each group's cores over ``window_s``, measured in turn, ``rounds`` times."""
    got: dict[str, list[float]] = {name: [] for name in groups}
    for _ in range(rounds):
        for name, pids in groups.items():
            got[name].append(cores(pids, window_s))
    return got


def drop_price(client: Any, x: Any, idle_s: float, reps: int) -> dict[str, Any]:
    """Forwards on ``drop`` after its graph was dropped vs on a warm graph, alternately; the
    drops seen in ``status()`` and whether every answer was bit-identical."""
    import numpy as np

    def drops() -> int:
        return client.status()["group_graph_drops"]

    want = client.forward(x, LAYER)
    cold, warm, same = [], [], True
    for _ in range(reps):
        before = drops()
        deadline = time.monotonic() + idle_s + 30
        while drops() == before:  # the replica's own idle check ends the graph
            if time.monotonic() > deadline:
                raise RuntimeError(f"'drop' kept its graph {idle_s + 30:.0f} s without a forward")
            time.sleep(0.2)
        for times in (cold, warm):
            t0 = time.perf_counter()
            got = client.forward(x, LAYER)
            times.append(time.perf_counter() - t0)
            same = same and np.array_equal(got, want)
    return {"cold": harness.latency_ms(cold), "warm": harness.latency_ms(warm), "bit_identical": same,
            "extra_ms": statistics.median(cold) * 1e3 - statistics.median(warm) * 1e3}


def plot(results: dict[str, Any], path: Path) -> None:
    names = list(results["idle_cores"])
    fig, ax = harness.pyplot().subplots(figsize=(6, 3.2))
    ax.bar(names, [statistics.median(results["idle_cores"][n]) for n in names], color="tab:blue")
    ax.set_ylabel("cores busy while idle (median)")
    ax.set_title(f"idle TP-{TP} group, {results['window_s']:g} s windows", fontsize=10)
    harness.save_figure(fig, path, dpi=100)


def verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The targets of the module docstring, from the measured results."""
    return {"idle": verdict(statistics.median(results["idle_cores"]["drop"]), "<=", 0.1),
            "price": verdict(results["price"]["extra_ms"] / 1e3, "<=", 1.0)}


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    med = {n: statistics.median(v) for n, v in results["idle_cores"].items()}
    p = results["price"]
    idle_v, price_v = results["verdicts"]["idle"], results["verdicts"]["price"]
    what = {"keep": "compiled graph kept (graph_idle_s 3600, the earlier behaviour)",
            "drop": f"compiled graph dropped after {results['idle_s']:g} s idle",
            "actor_calls": "no compiled graph (compiled_graph: false)",
            "floor_graph": f"Ray's floor: a bare {TP}-actor asyncio compiled graph, idle",
            "floor_torn_down": "the same processes after the graph's teardown"}
    rows = rounds_table("group", "cores busy while idle", results["idle_cores"], what)
    return "\n".join([
        section_start(SECTION, "bench_idle", results["argv"], results["machine"],
                      f"tiny checkpoint, TP {TP}, float32, layer {LAYER}, T = {results['tokens']}",
                      json_path, png_path), "",
        *rows, "",
        f"- Idle group with the drop: {verdict_text(idle_v)} cores; kept: {med['keep']:.2f} cores "
        f"({med['keep'] / max(med['drop'], 1e-3):.0f}x), Ray's floor graph {med['floor_graph']:.2f}.",
        f"- The forward that compiles the graph again: p50 {p['cold']['p50_ms']:.0f} ms vs "
        f"{p['warm']['p50_ms']:.1f} ms warm ({results['reps']} of each, alternating), extra "
        f"{verdict_text(price_v)} s; answers bit-identical: {yes_no(p['bit_identical'])}.",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "bench_idle")
    ap.add_argument("--idle-s", type=float, default=2.0, help="graph_idle_s of the drop deployment")
    ap.add_argument("--window-s", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1)
    args = ap.parse_args(argv)
    from deployments.client import MoEClient

    base = {"tp_size": TP, "tail": "sharded", "dtype": "float32", "layers": [LAYER]}
    deployments = [{"name": "keep", "graph_idle_s": 3600, **base},
                   {"name": "drop", "graph_idle_s": args.idle_s, **base},
                   {"name": "actor_calls", "compiled_graph": False, **base}]
    app = {"checkpoint": str(harness.preset_checkpoint("tiny")), "ingress_replicas": 1,
           "auto_tune_tokens": "none"}
    x = harness.seeded_randn(args.tokens, 128, seed=0)
    machine = harness.machine_record(with_ray=True)
    with harness.local_serve(num_cpus=8, num_gpus=3 * TP):
        from ray import serve

        # keep in an application of its own: its graph never stops polling, so it is deleted
        # before the floor is measured (two polling graphs on 2 cores would share them)
        harness.deploy({**app, "deployments": deployments[:1]}, KEEP_APP, route_prefix=None)
        harness.deploy({**app, "deployments": deployments[1:]}, APP)
        clients = {d["name"]: MoEClient.direct(d["name"], app_of(d["name"]), timeout_s=120)
                   for d in deployments}
        groups = {name: group_pids(c, name) for name, c in clients.items()}
        for c in clients.values():
            c.forward(x, LAYER)
        time.sleep(args.idle_s + 1)
        measured = idle_cores(groups, args.window_s, args.rounds)
        serve.delete(KEEP_APP)
        floor = FloorGraph()
        measured["floor_graph"] = idle_cores({"f": floor.pids}, args.window_s, args.rounds)["f"]
        floor.teardown()
        measured["floor_torn_down"] = idle_cores({"f": floor.pids}, args.window_s, args.rounds)["f"]
        price = drop_price(clients["drop"], x, args.idle_s, args.reps)
    results = {"idle_cores": measured, "price": price, "idle_s": args.idle_s, "window_s": args.window_s,
               "reps": args.reps, "tokens": args.tokens, "argv": args.argv,
               "machine": dict(machine, loadavg_after=harness.loadavg())}
    results["verdicts"] = verdicts(results)
    write_results(results, args.out, "bench_idle", plot, markdown, args.docs)
    return 0 if results["verdicts"]["idle"]["met"] and price["bit_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
