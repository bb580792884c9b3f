"""Per-call overhead of the Serve paths next to Ray's own floors, in one run (the page says more): tiny
checkpoint, TP 1 and 2, T in {1, 16, 128}, one call in flight, in rounds.

    python -m scripts.bench.overhead        # ~3 minutes on 2 cores
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import torch

from moe_runtime.config import LatentMoEConfig
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group

from . import harness
from .docs import Target, section_start, table, target_lines, verdict

APP, FLOOR_APP = "overhead", "floors"
LAYER = 1
TPS = (1, 2)
SIZES = (1, 16, 128)  # within max_batch_tokens (2048) and max_tokens_per_request (8192)
TARGETS_MS = {"direct_over_floor": (1.5, "direct - in-process forward - floor"),
              "app_over_direct": (1.0, "app - direct"), "http_over_direct": (3.0, "HTTP - direct")}
TIMEOUT_S = 120  # per call: a busy shared machine can stall one for longer than Ray's defaults (10 s)
SECTION = "# Serve-path overhead (scripts/bench/overhead.py)"


def _inprocess_rank(comm: Collectives, checkpoint: str, calls: int) -> dict[int, list[float]]:
    runner = harness.rank_runner(comm, checkpoint, LAYER, "auto", torch.float32)
    inputs = {T: harness.seeded_randn(T, runner.cfg.hidden_size, seed=T) for T in SIZES}
    with torch.inference_mode():
        return {T: harness.time_calls(lambda x=x: runner.forward(x), calls, warmup=10)
                for T, x in inputs.items()}


def inprocess(checkpoint: str, calls: int) -> dict[str, list[float]]:
    """Per ``inprocess/tpP/TT``: the seconds of each forward (a TP forward ends with its slowest rank)."""
    out = {}
    for tp in TPS:
        per_rank = ([_inprocess_rank(Collectives(0, 1), checkpoint, calls)] if tp == 1 else
                    run_local_group(tp, _inprocess_rank, checkpoint, calls, timeout_s=600))
        for T in SIZES:
            out[f"inprocess/tp{tp}/T{T}"] = [max(ts) for ts in zip(*(r[T] for r in per_rank), strict=True)]
    return out


class EchoActor:
    def echo(self, x: Any) -> Any:
        return x


def serve_calls(ckpt: Path, H: int, url: str, app_overrides: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """Deploy the app and the floors; every timed call by name, and the HTTP client to close."""
    import ray
    from ray import serve

    from deployments.client import HTTPMoEClient, MoEClient
    from deployments.common.wire import WireTensor

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Echo:
        async def __call__(self, x: Any) -> Any:
            return x

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class ActorHop:
        def __init__(self, actors: int):
            self.actors = [ray.remote(EchoActor).options(num_cpus=0).remote() for _ in range(actors)]

        async def __call__(self, x: Any) -> Any:
            return (await asyncio.gather(*(a.echo.remote(x) for a in self.actors)))[0]

    harness.deploy({"checkpoint": str(ckpt), "layers": [LAYER], "auto_tune_tokens": [],
                    "deployments": [{"name": f"tp{tp}", "tp_size": tp} for tp in TPS], **app_overrides}, APP)
    echo = serve.run(Echo.bind(), name=f"{FLOOR_APP}_echo", route_prefix=None)
    hops = {n: serve.run(ActorHop.bind(n), name=f"{FLOOR_APP}_actor{n}", route_prefix=None) for n in TPS}
    actor = ray.remote(EchoActor).options(num_cpus=0).remote()
    http = HTTPMoEClient(url, timeout_s=TIMEOUT_S)
    direct = {tp: MoEClient.direct(f"tp{tp}", APP) for tp in TPS}
    app = {tp: MoEClient(APP, deployment=f"tp{tp}", via_ingress=True) for tp in TPS}
    calls: dict[str, Any] = {}
    for T in SIZES:
        x = harness.seeded_randn(T, H, seed=T)
        w = WireTensor.from_torch(x)
        calls[f"actor/T{T}"] = lambda w=w: ray.get(actor.echo.remote(w))
        calls[f"serve_echo/T{T}"] = lambda w=w: echo.remote(w).result()
        for n in TPS:
            calls[f"serve_actor{n}/T{T}"] = lambda w=w, n=n: hops[n].remote(w).result()
            calls[f"direct/tp{n}/T{T}"] = lambda x=x, n=n: direct[n].forward(x, LAYER)
            calls[f"app/tp{n}/T{T}"] = lambda x=x, n=n: app[n].forward(x, LAYER)
            calls[f"http/tp{n}/T{T}"] = lambda x=x, n=n: http.forward(x, LAYER, deployment=f"tp{n}")
    return calls, http


def overheads(paths: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Per (TP, T): p50 of each path, and the overheads the targets bound."""
    rows = []
    for tp in TPS:
        for T in SIZES:
            p = {k.split("/")[0]: v["p50_ms"] for k, v in paths.items() if k.endswith(f"/tp{tp}/T{T}")}
            floor = paths[f"serve_actor{tp}/T{T}"]["p50_ms"]
            rows.append({"tp": tp, "T": T, "inprocess_ms": p["inprocess"], "direct_ms": p["direct"],
                         "app_ms": p["app"], "http_ms": p["http"], "floor_ms": floor,
                         # The floor does no work; our path does the forward on top of it.
                         "direct_over_floor_ms": p["direct"] - p["inprocess"] - floor,
                         "app_over_direct_ms": p["app"] - p["direct"],
                         "http_over_direct_ms": p["http"] - p["direct"]})
    return rows


def targets(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per target: every (TP, T) row's verdict; met only when every row met, the worst row named."""
    out = {}
    for key, (limit, _) in TARGETS_MS.items():
        rows = [dict(verdict(r[f"{key}_ms"], "<=", limit), tp=r["tp"], T=r["T"])
                for r in results["overheads"]]
        out[key] = {"rows": rows, "met": all(v["met"] for v in rows), "target": f"<= {limit} ms",
                    "worst": max(rows, key=lambda v: v["value"])}
    return out


def index_rows(results: dict[str, Any]) -> list[Target]:
    return [Target(f"{TARGETS_MS[key][1]} {t['target']}, every (TP, T) row",
                   f"worst {t['worst']['value']:+.2f} ms (TP {t['worst']['tp']}, T = {t['worst']['T']})",
                   t["met"]) for key, t in targets(results).items()]


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    m, keys = results["machine"], ("inprocess", "direct", "app", "http", "floor")
    what = (f"`tiny` preset (H = {m['hidden_size']}), float32, layer {LAYER}; {m['calls_per_path']} calls "
            f"per path in {m['rounds']} interleaved rounds, one request in flight")
    return "\n".join([
        section_start(SECTION, "overhead", results["argv"], m, what, json_path), "", "Per call, ms:", "",
        *table("path | p50 ms | p90 ms | p99 ms",
               ([k, *(f"{v[q]:.2f}" for q in ("p50_ms", "p90_ms", "p99_ms"))]
                for k, v in results["paths"].items()), "lrrr"),
        "", "Overheads (p50, ms; fwd = in-process, floor = `serve_actorP`, P = TP size):", "",
        *table("TP | T | in-process | direct | app | HTTP | floor | direct - fwd - floor | app - direct "
               "| HTTP - direct",
               ([r["tp"], r["T"], *(f"{r[f'{k}_ms']:.2f}" for k in keys),
                 *(f"{r[f'{k}_ms']:+.2f}" for k in TARGETS_MS)] for r in results["overheads"]),
               "ll" + "r" * 8),
        "", *target_lines(index_rows(results))])


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "overhead")
    ap.add_argument("--checkpoint", type=Path, help="default: checkpoints/tiny (written once)")
    ap.add_argument("--calls", type=int, default=150, help="timed calls per path (all rounds)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--app-args", default="{}", help="JSON merged into the app's args (e.g. batching knobs)")
    args = ap.parse_args(argv)
    ckpt = args.checkpoint or harness.preset_checkpoint("tiny")
    H = LatentMoEConfig.from_pretrained(ckpt).hidden_size
    machine = harness.machine_record(with_ray=True, hidden_size=H, calls_per_path=args.calls,
                                     rounds=args.rounds)
    print(f"in-process runner ({args.calls} calls per T)", flush=True)
    samples = inprocess(str(ckpt), args.calls)
    with harness.local_serve(num_cpus=4, num_gpus=8, worker_niceness=0) as base_url:
        calls, http = serve_calls(ckpt, H, base_url, json.loads(args.app_args))
        for call in calls.values():  # warm-up: connections, handles, first batches
            for _ in range(5):
                call()
        per_round = max(1, args.calls // args.rounds)
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds} ({per_round} calls per path), load {harness.loadavg()[0]}",
                  flush=True)
            for name, call in calls.items():
                samples.setdefault(name, []).extend(harness.time_calls(call, per_round, warmup=0))
        http.close()
    paths = {k: {"n": len(v), **harness.latency_ms(v)} for k, v in samples.items()}
    results = {"paths": paths, "overheads": overheads(paths)}
    return harness.report(args, results, machine, markdown, index_rows)


if __name__ == "__main__":
    raise SystemExit(main())
