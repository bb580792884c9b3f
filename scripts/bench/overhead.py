"""Per-call overhead of the serving paths, next to Ray's own floors, in one run.

The MoE tier is called once per layer per decode step, so what a call costs on top of the
forward decides whether the tier is usable. One run (tiny checkpoint, float32, layer 1):

* ``inprocess``: the runner in this process (TP 1) or in ``local_group`` ranks (TP 2), no Ray;
  TP 2 also as ``python -m moe_runtime forward --tp 2 --repeat N`` times it at T = 1 (a
  subprocess on the same checkpoint, dtype and layer: the lane target's in-process number;
  ``bench.harness.cli_forward_ms``);
* the transport's own floor, ``tcp1`` / ``tcp2`` (``bench.floor``: one peer process -> a rank
  process -> 0 / 1 echo rank(s) -> back over raw TCP, blocking reads, ``[T, H]`` float32 rows;
  no project code, no Ray: the shape of a lane's call on the data plane);
* Ray's floors, the same payload (a ``WireTensor`` of ``[T, H]``) round-tripped:
  ``actor`` (a bare actor call), ``serve_echo`` (Serve handle -> a deployment that returns its
  input), ``serve_actor1`` / ``serve_actor2`` (Serve handle -> a deployment that awaits one call
  on each of 1 / 2 actors, the shape of our replica -> TP-group hop), ``cgraph1`` / ``cgraph2``
  (a Compiled Graph: driver -> 1 / 2 echo actors -> driver, the lanes' transport before the data
  plane; kept as a reference);
* ours: ``lane`` (``MoEClient.lane``: the one peer of a data-plane session on a leased TP group,
  ``deployments.dataplane``), ``direct`` (``MoEClient.direct``: handle -> TP-group deployment),
  ``app`` (the ingress handle: one more hop), ``http`` (HTTP through the proxy and the ingress).

Every path is called sequentially (one request in flight: the lone-decode-request case) for
TP 1 and 2 and T in {1, 16, 128}, in rounds so a noisy neighbour hits every path alike. Each
round times the Serve paths and their floors, the TCP floors, then the compiled graphs one at a
time, each built for its turn and torn down after it (an idle compiled graph's loops spin on
their CPUs and would slow everything else), then a lane per TP opened and closed (it leases the
group of the deployment the Serve paths use; nothing else calls it meanwhile). The lane's timed
answers are compared bit for bit with the direct handle's on the same input every round, and
its ``status()`` must show every call on the lane: a row failing either meets no target.

Prints p50/p90/p99 and the overhead over the in-process forward and over the matching floor,
and writes JSON + PNG under ``--out``, its page (docs/benchmarks/overhead.md) and its rows of the
index (``--docs``; '' to skip), with each target's verdict computed from the run's rows (and the
runs of ``--compare``, side by side).

    python -m scripts.bench.overhead --label before      # ~4 minutes on 2 cores
    python -m scripts.bench.overhead --label after --compare artifacts/bench_overhead/before.json

Targets: direct <= serve_actor floor + 1.5 ms (TP 1: one actor, TP 2: two actors); app <=
direct + 1 ms; HTTP <= direct + 3 ms (the Serve paths, every row); lane - in-process (the
CLI's) <= tcp2 floor + 0.5 ms at TP 2, T = 1; lane <= 0.25 x direct at T = 1 (each TP). The
projected hop cost of a 92-layer Kimi-K3 token, (path - in-process) x 92 at T = 1, is printed
for the lane and the direct handle.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from moe_runtime.config import LatentMoEConfig
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group

from . import harness
from .docs import Target, publish, repo_relative, section_start, target, verdict, verdict_word
from .floor import echo_floor

APP, FLOOR_APP = "overhead", "floors"
LAYER = 1
TPS = (1, 2)
SIZES = (1, 16, 128)  # within max_batch_tokens (2048) and max_tokens_per_request (8192)
TARGETS_MS = {"direct_over_floor": 1.5, "app_over_direct": 1.0, "http_over_direct": 3.0}
TARGET_TEXT = {"direct_over_floor": "direct - in-process forward - floor", "app_over_direct": "app - direct",
               "http_over_direct": "HTTP - direct"}
LANE_OVER_FLOOR_MS = 0.5  # lane - in-process <= the TCP floor + this, at TP 2, T = 1
LANE_OVER_DIRECT = 0.25  # lane <= this x direct, at T = 1
K3_MOE_LAYERS = 92  # one tier call per MoE layer per decode step
TIMEOUT_S = 120  # per call: a busy shared machine can stall one for longer than Ray's defaults (10 s)
SECTION = "# Data-plane overhead (scripts/bench/overhead.py)"


def make_input(T: int, H: int) -> torch.Tensor:
    return harness.seeded_randn(T, H, seed=T)


# -- in-process ---------------------------------------------------------------------------------


def _inprocess_rank(comm: Collectives, checkpoint: str, calls: int) -> dict[int, list[float]]:
    from moe_runtime.tp.plan import resolve_tail
    from moe_runtime.tp.runner import build_rank_runners

    cfg = LatentMoEConfig.from_pretrained(checkpoint)
    plan = resolve_tail("auto", cfg, comm.world)
    runner = build_rank_runners(checkpoint, cfg, [LAYER], comm, plan, dtype=torch.float32)[LAYER]
    out = {}
    with torch.inference_mode():
        for T in SIZES:
            x = make_input(T, cfg.hidden_size)
            out[T] = harness.time_calls(lambda x=x: runner.forward(x), calls, warmup=10).seconds
    return out


def inprocess(checkpoint: str, calls: int) -> dict[tuple[int, int], list[float]]:
    result = {}
    for tp in TPS:
        if tp == 1:
            per_rank = [_inprocess_rank(Collectives(0, 1), checkpoint, calls)]
        else:
            per_rank = run_local_group(tp, _inprocess_rank, checkpoint, calls, timeout_s=600)
        for T in SIZES:  # a TP forward ends when its slowest rank does
            result[(tp, T)] = [max(ts) for ts in zip(*(r[T] for r in per_rank), strict=True)]
    return result


# -- floors -------------------------------------------------------------------------------------


class EchoActor:
    def echo(self, x: Any) -> Any:
        return x


def floor_deployments():
    import ray
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Echo:
        async def __call__(self, x: Any) -> Any:
            return x

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class ActorHop:
        def __init__(self, actors: int):
            self.actors = [ray.remote(EchoActor).options(num_cpus=0).remote() for _ in range(actors)]

        async def __call__(self, x: Any) -> Any:
            out = await asyncio.gather(*(a.echo.remote(x) for a in self.actors))
            return out[0]

    return Echo, ActorHop


def compiled_floor(actors: list[Any]) -> Any:
    """A lane's shape with no work: driver -> every actor's echo -> driver, one compiled graph."""
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as inp:
        dag = MultiOutputNode([a.echo.bind(inp) for a in actors])
    return dag.experimental_compile()


def floor_call(graph: Any, w: Any) -> None:
    """One execution of a floor graph. Its answers are dropped here: they may be zero-copy views
    of the graph's channel buffers, and one still held blocks a later execution (seen at T = 128)."""
    import ray

    ray.get(graph.execute(w), timeout=TIMEOUT_S)


# -- main ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    ckpt = args.checkpoint or harness.preset_checkpoint("tiny")
    H = LatentMoEConfig.from_pretrained(ckpt).hidden_size
    results: dict[str, Any] = {
        "label": args.label,
        "env": harness.machine_record(hidden_size=H, calls_per_path=args.calls, rounds=args.rounds),
        "paths": {},
    }
    samples: dict[str, list[float]] = {}
    print(f"in-process runner ({args.calls} calls per T)", flush=True)
    for (tp, T), ts in inprocess(str(ckpt), args.calls).items():
        samples[f"inprocess/tp{tp}/T{T}"] = ts
    print(f"in process by the CLI (TP 2, T = 1, --repeat {args.calls})", flush=True)
    results["inprocess_cli"] = harness.cli_forward_ms(ckpt, LAYER, 2, 1, args.calls)

    import ray
    from ray import serve

    from deployments.client import HTTPMoEClient, MoEClient
    from deployments.common.wire import WireTensor

    with harness.local_serve(num_cpus=4, num_gpus=8, worker_niceness=0) as base_url:
        deployments = [{"name": f"tp{tp}", "tp_size": tp} for tp in TPS]
        harness.deploy({"checkpoint": str(ckpt), "layers": [LAYER], "auto_tune_tokens": [],
                        "deployments": deployments, **args.app_overrides}, APP)
        Echo, ActorHop = floor_deployments()
        echo = serve.run(Echo.bind(), name=f"{FLOOR_APP}_echo", route_prefix=None)
        hops = {n: serve.run(ActorHop.bind(n), name=f"{FLOOR_APP}_actor{n}", route_prefix=None) for n in TPS}
        actor = ray.remote(EchoActor).options(num_cpus=0).remote()
        echoes = {n: [ray.remote(EchoActor).options(num_cpus=0).remote() for _ in range(n)] for n in TPS}
        http = HTTPMoEClient(base_url, timeout_s=TIMEOUT_S)
        direct = {tp: MoEClient.direct(f"tp{tp}", APP) for tp in TPS}
        # The ingress path (older clients went through it by default; newer ones need asking).
        via = {"via_ingress": True} if "via_ingress" in inspect.signature(MoEClient).parameters else {}
        app = {tp: MoEClient(APP, deployment=f"tp{tp}", **via) for tp in TPS}

        inputs = {T: make_input(T, H) for T in SIZES}
        wires = {T: WireTensor.from_torch(x) for T, x in inputs.items()}
        calls: dict[str, Any] = {}  # the Serve paths and their floors
        for T in SIZES:
            x, w = inputs[T], wires[T]
            calls[f"actor/T{T}"] = lambda w=w: ray.get(actor.echo.remote(w))
            calls[f"serve_echo/T{T}"] = lambda w=w: echo.remote(w).result()
            for n in TPS:
                calls[f"serve_actor{n}/T{T}"] = lambda w=w, n=n: hops[n].remote(w).result()
            for tp in TPS:
                calls[f"direct/tp{tp}/T{T}"] = lambda x=x, tp=tp: direct[tp].forward(x, LAYER)
                calls[f"app/tp{tp}/T{T}"] = lambda x=x, tp=tp: app[tp].forward(x, LAYER)
                calls[f"http/tp{tp}/T{T}"] = lambda x=x, tp=tp: http.forward(x, LAYER, deployment=f"tp{tp}")
        for call in calls.values():  # warm-up: connections, handles, first batches
            for _ in range(5):
                call()
        per_round = max(1, args.calls // args.rounds)
        exact = dict.fromkeys(((tp, T) for tp in TPS for T in SIZES), True)
        lane_groups: dict[int, list[dict[str, Any]]] = {tp: [] for tp in TPS}
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds} ({per_round} calls per path), load {os.getloadavg()[0]:.2f}",
                  flush=True)
            last = timed(calls, samples, per_round)
            for n in TPS:  # the transport's floor: spawned processes, timed by its peer
                for T in SIZES:
                    samples.setdefault(f"tcp{n}/T{T}", []).extend(
                        echo_floor(1, T, H, ranks=n, min_steps=per_round, warmup=5).steps[0][:per_round])
            # Then the compiled graphs, one at a time, each built for its turn and torn down after
            # it: an idle graph's loops spin (about a core per actor, measured here), which would
            # slow every other path. Then the lane: it leases the group the Serve paths just used;
            # nothing else calls it meanwhile.
            for n in TPS:
                graph = compiled_floor(echoes[n])
                try:
                    timed({f"cgraph{n}/T{T}": lambda w=wires[T], g=graph: floor_call(g, w) for T in SIZES},
                          samples, per_round, warm=5)
                finally:
                    graph.teardown()
                with direct[n].lane(max_tokens=max(SIZES), name=f"bench-tp{n}") as lane:
                    last |= timed({f"lane/tp{n}/T{T}": lambda x=inputs[T], ln=lane: ln.forward(x, LAYER)
                                   for T in SIZES}, samples, per_round, warm=5)
                    lane_groups[n].append(lane.status()["deployments"][f"tp{n}"])
            for tp, T in exact:  # the timed answers themselves: a wrong lane gets no fast row
                exact[(tp, T)] &= torch.equal(last[f"lane/tp{tp}/T{T}"], last[f"direct/tp{tp}/T{T}"])
        results["lane"] = {f"tp{tp}": lane_check(lane_groups[tp], {T: exact[(tp, T)] for T in SIZES})
                           for tp in TPS}
        http.close()
    results["env"]["loadavg_after"] = harness.loadavg()
    results["paths"] = {k: {"n": len(v), **harness.latency_ms(v)} for k, v in samples.items()}
    results["overheads"] = overheads(results["paths"], results["lane"])
    return results


def timed(calls: dict[str, Any], samples: dict[str, list[float]], n: int, warm: int = 0) -> dict[str, Any]:
    """Each call ``warm`` times untimed then ``n`` times timed (into ``samples``); its last answers."""
    last = {}
    for name, call in calls.items():
        samples.setdefault(name, []).extend((t := harness.time_calls(call, n, warmup=warm)).seconds)
        last[name] = t.last
    return last


def lane_check(groups: list[dict[str, Any]], exact: dict[int, bool]) -> dict[str, Any]:
    """Whether the lane rows measure the lane: every call of every round's lane (``groups``: its
    ``status()`` for the deployment) went on the leased group's graph, none on the Serve path,
    and each T's timed answers equal the direct handle's bit for bit."""
    counts = {k: sum(g[k] for g in groups) for k in ("lane_calls", "serve_calls", "fallbacks", "leases")}
    on_lane = all(g["path"] == "lane" for g in groups) and counts["serve_calls"] == 0
    return {"exact": {str(T): ok for T, ok in exact.items()}, "on_lane": on_lane, **counts}


def overheads(paths: dict[str, dict[str, float]], lanes: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (path, TP, T): p50 over the in-process forward and over the matching floor/path."""
    rows = []
    for tp in TPS:
        for T in SIZES:
            p = {k.split("/")[0]: v["p50_ms"] for k, v in paths.items()
                 if k.endswith(f"/tp{tp}/T{T}")}
            floor = paths[f"serve_actor{tp}/T{T}"]["p50_ms"]
            floor1 = paths[f"serve_actor1/T{T}"]["p50_ms"]
            lane = lanes[f"tp{tp}"]
            rows.append({
                "tp": tp, "T": T, "inprocess_ms": p["inprocess"], "lane_ms": p["lane"],
                "direct_ms": p["direct"], "app_ms": p["app"], "http_ms": p["http"],
                "floor_ms": floor, "floor1_ms": floor1, "cgraph_ms": paths[f"cgraph{tp}/T{T}"]["p50_ms"],
                "tcp_ms": paths[f"tcp{tp}/T{T}"]["p50_ms"],
                "lane_valid": lane["on_lane"] and lane["exact"][str(T)],
                "lane_over_inprocess_ms": p["lane"] - p["inprocess"],
                "lane_over_direct": p["lane"] / p["direct"],
                "direct_over_inprocess_ms": p["direct"] - p["inprocess"],
                # The floor does no work; our path does the forward on top of it.
                "direct_over_floor_ms": p["direct"] - p["inprocess"] - floor,
                "app_over_direct_ms": p["app"] - p["direct"],
                "http_over_direct_ms": p["http"] - p["direct"],
            })
    return rows


def table(results: dict[str, Any]) -> str:
    lines = ["| TP | T | in-process | lane | TCP floor (peer->P ranks) | CG floor (driver->P actors) "
             "| lane - fwd | lane / direct | direct | app | HTTP | floor (Serve->P actors) "
             "| direct - fwd - floor | app - direct | HTTP - direct |",
             "|---|---|" + "---:|" * 13]
    for r in results["overheads"]:
        tcp = f"{r['tcp_ms']:.2f}" if "tcp_ms" in r else "-"
        cells = [r["tp"], r["T"], f"{r['inprocess_ms']:.2f}",
                 f"{r['lane_ms']:.2f}" + ("" if r["lane_valid"] else " (invalid)"), tcp,
                 f"{r['cgraph_ms']:.2f}",
                 f"{r['lane_over_inprocess_ms']:+.2f}", f"{r['lane_over_direct']:.2f}",
                 *(f"{r[f'{k}_ms']:.2f}" for k in ("direct", "app", "http", "floor")),
                 *(f"{r[f'{k}_over_{base}_ms']:+.2f}"
                   for k, base in (("direct", "floor"), ("app", "direct"), ("http", "direct")))]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def paths_table(results: dict[str, Any]) -> str:
    lines = ["| path | p50 ms | p90 ms | p99 ms |", "|---|---:|---:|---:|"]
    for name, v in results["paths"].items():
        lines.append(f"| {name} | {v['p50_ms']:.2f} | {v['p90_ms']:.2f} | {v['p99_ms']:.2f} |")
    return "\n".join(lines)


def row_of(run: dict[str, Any], tp: int, T: int) -> dict[str, Any]:
    """``run``'s overhead row for (TP, T); empty for runs that did not measure it (older runs)."""
    return next((r for r in run["overheads"] if (r["tp"], r["T"]) == (tp, T)), {})


def compare_table(runs: list[dict[str, Any]]) -> str:
    """p50 ms per (TP, T, path) side by side for several runs (before/after tables)."""
    labels = [r["label"] for r in runs]
    lines = ["| TP | T | path | " + " | ".join(labels) + " |", "|---|---|---|" + "---:|" * len(runs)]
    for tp in TPS:
        for T in SIZES:
            for path in ("inprocess", "lane", "tcp", "cgraph", "floor", "direct", "app", "http",
                         "lane_over_inprocess", "direct_over_floor", "app_over_direct", "http_over_direct"):
                vals = [row_of(run, tp, T).get(f"{path}_ms") for run in runs]
                lines.append(f"| {tp} | {T} | {path} | "
                             + " | ".join("" if v is None else f"{v:.2f}" for v in vals) + " |")
    return "\n".join(lines)


def targets(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per target: the verdict of every (TP, T) row, and the headline: met only when every row met,
    with the worst row's value (what would have to improve)."""
    out = {}
    for key, limit in TARGETS_MS.items():
        rows = [dict(verdict(r[f"{key}_ms"], "<=", limit), tp=r["tp"], T=r["T"])
                for r in results["overheads"]]
        worst = max(rows, key=lambda v: v["value"])
        out[key] = {"rows": rows, "met": all(v["met"] for v in rows), "rows_met": sum(v["met"] for v in rows),
                    "worst": worst, "best": min(rows, key=lambda v: v["value"]), "target": f"<= {limit} ms"}
    return out


def lane_verdict(row: dict[str, Any], value: float, limit: float) -> dict[str, Any]:
    v = verdict(value, "<=", limit)
    if not row["lane_valid"]:  # calls that left the lane, or wrong answers, measure no lane
        v["met"] = False
    return dict(v, tp=row["tp"], valid=row["lane_valid"])


def lane_targets(results: dict[str, Any]) -> dict[str, Any]:
    """The lane's targets at T = 1 and the projected hops of a Kimi-K3 token (92 MoE layers)."""
    rows = {r["tp"]: r for r in results["overheads"] if r["T"] == 1}
    two, cli = rows[2], results["inprocess_cli"]["median_ms"]
    over_floor = lane_verdict(two, two["lane_ms"] - cli - two["tcp_ms"], LANE_OVER_FLOOR_MS)
    return {
        "lane_over_floor": dict(over_floor, lane_ms=two["lane_ms"], cli_ms=cli, tcp_ms=two["tcp_ms"],
                                cgraph_ms=two["cgraph_ms"], inprocess_ms=two["inprocess_ms"]),
        "lane_over_direct": [lane_verdict(r, r["lane_over_direct"], LANE_OVER_DIRECT) for r in rows.values()],
        "k3_token_hops_ms": {f"tp{tp}": {"lane": r["lane_over_inprocess_ms"] * K3_MOE_LAYERS,
                                         "direct": r["direct_over_inprocess_ms"] * K3_MOE_LAYERS}
                             for tp, r in rows.items()},
    }


def lane_lines(results: dict[str, Any]) -> list[str]:
    """The lane's checks, targets and K3 projection in words (console and docs alike)."""
    t, cli = lane_targets(results), results["inprocess_cli"]
    f = t["lane_over_floor"]
    checks = "; ".join(
        f"TP {tp[2:]}: bit-equal at T = "
        + ", ".join(f"{T} {'yes' if ok else '**NO**'}" for T, ok in c["exact"].items())
        + f"; {c['lane_calls']} calls on the lane, {c['serve_calls']} on the Serve path, {c['fallbacks']} "
        f"fallbacks, {c['leases']} lease(s){'' if c['on_lane'] else ' -- **not all on the lane**'}"
        for tp, c in results["lane"].items())
    hops = "; ".join(f"TP {tp[2:]}: lane {h['lane']:.0f} ms, direct handle {h['direct']:.0f} ms"
                     for tp, h in t["k3_token_hops_ms"].items())
    return [
        f"- Lane answers vs the direct handle's on the same input (`torch.equal` on every round's timed "
        f"answers), and the lane's own `status()`: {checks}. A lane row that fails either meets no target.",
        f"- lane - in-process <= the transport's floor (`tcp2`) + {LANE_OVER_FLOOR_MS} ms at TP 2, T = 1: "
        f"lane {f['lane_ms']:.2f} - in-process {f['cli_ms']:.2f} (`{cli['command']}`, median, printed to "
        f"0.1 ms; this run's in-process path: {f['inprocess_ms']:.2f}) = "
        f"{f['lane_ms'] - f['cli_ms']:+.2f} ms against floor {f['tcp_ms']:.2f} + {LANE_OVER_FLOOR_MS} = "
        f"{f['tcp_ms'] + LANE_OVER_FLOOR_MS:.2f} ms: "
        f"{verdict_word(f['met'])} (Ray's Compiled Graph floor `cgraph2`, the lanes' transport before the "
        f"data plane: {f['cgraph_ms']:.2f} ms).",
        f"- lane <= {LANE_OVER_DIRECT} x direct handle at T = 1: "
        + ", ".join(f"TP {v['tp']}: {v['value']:.2f}x ({verdict_word(v['met'])})"
                    for v in t["lane_over_direct"]) + ".",
        f"- Projected hop cost of a {K3_MOE_LAYERS}-layer Kimi-K3 token at T = 1 ((path p50 - in-process "
        f"p50) x {K3_MOE_LAYERS}): {hops}.",
    ]


def index_rows(results: dict[str, Any]) -> list[Target]:
    """The index's rows: each Serve-path target by its worst row, the lane's at T = 1."""
    rows = [Target(f"{TARGET_TEXT[key]} {t['target']}, every (TP, T) row",
                   f"worst {t['worst']['value']:+.2f} ms (TP {t['worst']['tp']}, T = {t['worst']['T']})",
                   t["met"]) for key, t in targets(results).items()]
    lane = lane_targets(results)
    rows.append(target("lane - in-process - TCP floor, TP 2, T = 1", lane["lane_over_floor"], "+.2f", " ms"))
    rows += [target(f"lane / direct handle, TP {v['tp']}, T = 1", v) for v in lane["lane_over_direct"]]
    return rows


def verdicts(results: dict[str, Any]) -> list[str]:
    return [f"TP {v['tp']} T {v['T']}: {key} {v['value']:+.2f} ms (target {v['target']}: "
            f"{'met' if v['met'] else 'MISSED'})" for key, t in targets(results).items() for v in t["rows"]]


def markdown(runs: list[dict[str, Any]], json_path: str, png_path: str) -> str:
    """The section from this run (the last of ``runs``) and the ones it is compared with."""
    results, env = runs[-1], runs[-1]["env"]
    lines = [
        section_start(
            SECTION, "overhead", results.get("argv", []), env,
            f"label `{results['label']}`, `tiny` preset (H = {env['hidden_size']}), float32, layer 1; "
            f"{env['calls_per_path']} calls per path in {env['rounds']} interleaved rounds, one request "
            "in flight", json_path, png_path),
        "",
        "Paths: `inprocess` = the runner with no Ray (TP 2: `local_group` ranks); the transport's floor: "
        "`tcpP` (`scripts/bench/floor.py`: a peer process -> a rank process -> P - 1 echo ranks -> back over "
        "raw TCP with blocking reads, no project code: the shape of a lane's call on the data plane); Ray's "
        "floors on the same payload: `actor` (a bare actor call), `serve_echo` (Serve handle -> a deployment "
        "returning its input), `serve_actorP` (Serve handle -> a deployment awaiting one call on each of P "
        "actors: the shape of the replica -> TP group hop), `cgraphP` (a Compiled Graph, driver -> P echo "
        "actors -> driver: the lanes' transport before the data plane, a reference); ours: `lane` "
        "(`MoEClient.lane`: the one peer of a data-plane session on the leased TP group of the deployment "
        "`direct` calls), `direct` (`MoEClient.direct`), `app` (the ingress handle), `http` (proxy and "
        "ingress). Each round times the Serve paths and their floors, the TCP floors, each compiled graph "
        "in turn (built for its turn and torn down after it: an idle graph's loops spin on their CPUs), then "
        "a lane per TP, opened and closed. p50 / p90 / p99 per call, ms:",
        "",
        paths_table(results),
        "",
        "Overheads (p50, ms; fwd = in-process; TCP floor = `tcpP`, CG floor = `cgraphP`, floor = "
        "`serve_actorP`, P = TP size):",
        "",
        table(results),
    ]
    if len(runs) > 1:
        lines += ["", "Side by side with the compared runs (p50 ms; each run's own load in its JSON):", "",
                  compare_table(runs)]
    lines += ["", "Targets (verdicts computed from the rows above; a Serve-path target is met only when "
              "every (TP, T) row meets it):", ""]
    for key, t in targets(results).items():
        w, b = t["worst"], t["best"]
        lines.append(f"- {TARGET_TEXT[key]} {t['target']}: {verdict_word(t['met'])} -- {t['rows_met']} of "
                     f"{len(t['rows'])} rows; worst TP {w['tp']}, T = {w['T']}: {w['value']:+.2f} ms; best "
                     f"TP {b['tp']}, T = {b['T']}: {b['value']:+.2f} ms.")
    return "\n".join(lines + lane_lines(results))


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    fig, axes = harness.pyplot().subplots(1, len(SIZES), figsize=(18, 5), sharey=True)
    keys = ["inprocess", "tcp", "cgraph", "lane", "floor", "direct", "app", "http"]
    xs = [k + j * (len(keys) + 1) for j in range(len(TPS)) for k in range(len(keys))]
    width = 0.8 / len(runs)
    for ax, T in zip(axes, SIZES, strict=True):
        for i, run in enumerate(runs):  # NaN: a path or size that run did not measure
            ys = [row_of(run, tp, T).get(f"{k}_ms", math.nan) for tp in TPS for k in keys]
            ax.bar([x + i * width for x in xs], ys, width, label=run["label"])
        ax.set_xticks([x + 0.4 - width / 2 for x in xs], [f"TP{tp} {k}" for tp in TPS for k in keys],
                      fontsize=7, rotation=90)
        ax.set_yscale("log")  # the lane and its floor sit one to two decades below HTTP
        ax.set_title(f"T = {T}: p50 per call (ms)")
        ax.legend()
    fig.suptitle("latent-MoE serving: per-call latency vs Ray's floors (tiny, float32)")
    harness.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "overhead")
    ap.add_argument("--checkpoint", type=Path, help="default: checkpoints/tiny (written once)")
    ap.add_argument("--calls", type=int, default=150, help="timed calls per path (all rounds)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--label", default="run", help="names the results files (LABEL.json, LABEL.png)")
    ap.add_argument("--app-args", default="{}", help="JSON merged into the app's args (e.g. batching knobs)")
    ap.add_argument("--compare", type=Path, nargs="*", default=[],
                    help="earlier JSON results to plot alongside")
    args = ap.parse_args(argv)
    args.app_overrides = json.loads(args.app_args)
    results = run(args)
    results["argv"] = args.argv
    results["targets"] = targets(results)
    results["lane_targets"] = lane_targets(results)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / f"{args.label}.json", args.out / f"{args.label}.png"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    runs = [json.loads(p.read_text()) for p in args.compare] + [results]
    plot(runs, png_path)
    env = results["env"]
    print(f"\nload average before {env['loadavg_before']}, after {env['loadavg_after']}")
    print(paths_table(results) + "\n\n" + table(results) + "\n")
    print("\n".join(verdicts(results) + lane_lines(results)))
    if args.compare:
        print("\n" + compare_table(runs))
    print(f"\nwrote {json_path} and {png_path}")
    section = markdown(runs, repo_relative(json_path), repo_relative(png_path))
    publish(section, "overhead", index_rows(results), results["env"], args.docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
