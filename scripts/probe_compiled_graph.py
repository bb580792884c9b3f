"""The replica -> TP-group forward hop with ``compiled_graph`` forced on and off, side by side.

What ``compiled_graph: auto`` (on at TP > 1, off at TP 1; deployments/config/spec.py) rests on. One local
Ray instance (CPU, TP ranks on logical GPUs, gloo) serves one app with four deployments of the same
tiny checkpoint: TP 1 and TP 2, each with the graph on and off. Every variant is called the same
way, one request in flight (a lone decode call), in interleaved rounds so that a noisy neighbour
hits all four alike. Per variant it records

* ``group_forward_ms``: the replica's own timing of each TP-group forward (``status()``
  ``counters.forward_ms.recent``): the hop to the ranks and back, plus the forward itself;
* ``client_ms``: the whole call through ``MoEClient.direct`` (handle -> replica -> ranks);
* ``transport``: what ``status()`` says the replica used (a graph that could not be built falls
  back to actor calls, and says so: such a row compares nothing).

The verdict per TP size (graph p50 < actor-call p50?) and whether it agrees with ``auto``'s choice
are computed from the rows. Writes JSON under --out and its section of docs/benchmarks.md (--docs).

    python scripts/probe_compiled_graph.py                 # ~2 minutes on 2 cores
    python scripts/probe_compiled_graph.py --calls 60 --docs ''

Uses only ``deployments.app:build_app`` and ``deployments.client.MoEClient``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

from bench import harness
from bench.docs import section_start, write_results

from moe_runtime.config import LatentMoEConfig

APP = "cgprobe"
LAYER = 1
TPS = (1, 2)
SIZES = (1, 16)
SECTION = "## Compiled graph on vs off: the replica -> TP-group hop (scripts/probe_compiled_graph.py)"
AUTO = {1: False, 2: True}  # what compiled_graph: auto picks (deployments/config/spec.py)


def name(tp: int, graph: bool) -> str:
    return f"tp{tp}_{'graph' if graph else 'actor'}"


def summarize(samples: dict[str, dict[str, list[float]]], transports: dict[str, str]) -> list[dict[str, Any]]:
    """One row per (TP, T): graph and actor-call p50s side by side, and the computed verdict."""
    rows = []
    for tp in TPS:
        for T in SIZES:
            row: dict[str, Any] = {"tp": tp, "T": T}
            for graph in (True, False):
                key = f"{name(tp, graph)}/T{T}"
                fwd, client = samples[key]["group_forward_ms"], samples[key]["client_ms"]
                side = "graph" if graph else "actor"
                row[side] = {"transport": transports[name(tp, graph)], "calls": len(client),
                             "group_forward_p50_ms": statistics.median(fwd),
                             "group_forward_p90_ms": harness.percentile(fwd, 0.9),
                             "client_p50_ms": statistics.median(client),
                             "client_p90_ms": harness.percentile(client, 0.9)}
            valid = row["graph"]["transport"] == "compiled graph" and row["actor"]["transport"].startswith(
                "actor calls (compiled_graph is off)")
            g, a = row["graph"]["group_forward_p50_ms"], row["actor"]["group_forward_p50_ms"]
            row["valid"] = valid
            row["graph_over_actor"] = g / a if a else None
            row["graph_faster"] = (g < a) if valid else None
            row["agrees_with_auto"] = (row["graph_faster"] == AUTO[tp]) if valid else None
            rows.append(row)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    ckpt = args.checkpoint or harness.preset_checkpoint("tiny")
    H = LatentMoEConfig.from_pretrained(ckpt).hidden_size
    results: dict[str, Any] = {
        "argv": args.argv,
        "env": harness.machine_record(with_ray=True, hidden_size=H, checkpoint=str(ckpt),
                                      calls_per_variant=args.calls, rounds=args.rounds),
    }

    from deployments.client import MoEClient

    samples: dict[str, dict[str, list[float]]] = {}
    with harness.local_serve(num_cpus=4, num_gpus=8, worker_niceness=0):
        deployments = [{"name": name(tp, graph), "tp_size": tp, "compiled_graph": graph,
                        "batch_wait_timeout_s": 0.0, "replica_cpus": 0.5}
                       for tp in TPS for graph in (True, False)]
        harness.deploy({"checkpoint": str(ckpt), "layers": [LAYER], "auto_tune_tokens": [],
                        "dtype": "float32", "deployments": deployments}, APP, route_prefix=None)
        clients = {d["name"]: MoEClient.direct(d["name"], APP, timeout_s=120) for d in deployments}
        inputs = {T: harness.seeded_randn(T, H, seed=T) for T in SIZES}
        for c in clients.values():  # warm-up: handles, channels, first forwards
            for T in SIZES:
                for _ in range(5):
                    c.forward(inputs[T], LAYER)
        # Decided at the group's first forward: asked after the warm-up.
        transports = {n: c.status()["group_transport"] for n, c in clients.items()}
        print("transports:", transports, flush=True)
        per_round = max(1, args.calls // args.rounds)
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}: {per_round} calls per variant and T, load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
            for n, c in clients.items():
                for T in SIZES:
                    before = c.status()["counters"]["forwards"]
                    timed = harness.time_calls(lambda c=c, T=T: c.forward(inputs[T], LAYER), per_round,
                                               warmup=0)
                    st = c.status()["counters"]
                    done = st["forwards"] - before  # one lone request per forward
                    s = samples.setdefault(f"{n}/T{T}", {"group_forward_ms": [], "client_ms": []})
                    s["group_forward_ms"] += st["forward_ms"]["recent"][-done:] if done else []
                    s["client_ms"] += [t * 1e3 for t in timed.seconds]
    results["env"]["loadavg_after"] = harness.loadavg()
    results["transports"] = transports
    results["samples"] = samples
    results["rows"] = summarize(samples, transports)
    return results


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    env = results["env"]
    lines = [
        section_start(
            SECTION, "probe_compiled_graph", results["argv"], env,
            f"`tiny` checkpoint (H = {env['hidden_size']}), float32, layer 1, TP ranks on logical GPUs "
            f"(gloo); {env['calls_per_variant']} calls per variant and T in {env['rounds']} interleaved "
            "rounds, one request in flight", json_path),
        "",
        "One app, four deployments of the same checkpoint: TP 1 and TP 2 with `compiled_graph: true` "
        "and `false`. group forward = the replica's own timing of each TP-group forward "
        "(`status()` counters: the hop to the ranks and back plus the forward); client = the whole "
        "`MoEClient.direct` call. p50 (p90), ms:",
        "",
        "| TP | T | graph: group forward | actor calls: group forward | graph / actor | graph: client "
        "| actor calls: client | transports as reported |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results["rows"]:
        g, a = r["graph"], r["actor"]
        ratio = "" if r["graph_over_actor"] is None else f"{r['graph_over_actor']:.2f}"
        lines.append(
            f"| {r['tp']} | {r['T']} | {g['group_forward_p50_ms']:.2f} ({g['group_forward_p90_ms']:.2f}) | "
            f"{a['group_forward_p50_ms']:.2f} ({a['group_forward_p90_ms']:.2f}) | {ratio} | "
            f"{g['client_p50_ms']:.2f} ({g['client_p90_ms']:.2f}) | {a['client_p50_ms']:.2f} "
            f"({a['client_p90_ms']:.2f}) | {g['transport']}; {a['transport']} |")
    lines += ["", "Verdicts (computed from the group-forward p50s above):", ""]
    for tp in TPS:
        rows = [r for r in results["rows"] if r["tp"] == tp]
        if not all(r["valid"] for r in rows):
            lines.append(f"- TP {tp}: **not comparable** -- a variant did not run on the transport it "
                         "asked for (see the transports column).")
            continue
        faster = [r["T"] for r in rows if r["graph_faster"]]
        agree = all(r["agrees_with_auto"] for r in rows)
        lines.append(
            f"- TP {tp}: the compiled graph was faster at T = {faster or 'none'} of "
            f"{[r['T'] for r in rows]}; "
            f"`auto` turns it {'on' if AUTO[tp] else 'off'} at TP {tp}: "
            + ("**agrees** with this run." if agree else "**disagrees** with this run at some T."))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "probe_compiled_graph")
    ap.add_argument("--checkpoint", type=Path, help="default: checkpoints/tiny (written once)")
    ap.add_argument("--calls", type=int, default=90, help="timed calls per variant and T (all rounds)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    results = run(args)
    for r in results["rows"]:
        print(f"TP {r['tp']} T {r['T']}: graph {r['graph']['group_forward_p50_ms']:.2f} ms vs actor calls "
              f"{r['actor']['group_forward_p50_ms']:.2f} ms (p50 group forward); valid {r['valid']}")
    write_results(results, args.out, "probe_compiled_graph", None, markdown, args.docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
