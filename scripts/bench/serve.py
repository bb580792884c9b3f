"""Serving benchmark: closed-loop load on a local Serve app (TP-2 deployments ``batched`` and
``unbatched``; through a ``handle``, the ``app``'s ingress and ``http``) vs the in-process TP runner
at the same batch sizes, in the same run. The page says more.

    python -m scripts.bench.serve                    # small preset, a few minutes on 2 cores
    python -m scripts.bench.serve --quick            # shorter windows, fewer scenarios
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import torch

from moe_runtime.config import LatentMoEConfig
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group
from moe_runtime.units import torch_dtype

from . import harness
from .docs import Target, section_start, table, target, verdict, verdict_text

APP = "bench"
SECTION = "# Serving (scripts/bench/serve.py)"
LAYER = 1


def _inprocess_rank(comm: Collectives, checkpoint: str, tail: str, dtype: str, sizes: list[int],
                    min_time_s: float) -> dict[int, float]:
    """Seconds per forward at each T on this rank (identical iteration counts on every rank)."""
    runner, out = harness.rank_runner(comm, checkpoint, LAYER, tail, torch_dtype(dtype)), {}
    with torch.inference_mode():
        for T in sizes:
            x = harness.seeded_randn(T, runner.cfg.hidden_size, seed=T, dtype=torch_dtype(dtype))
            runner.forward(x)  # warm-up
            start = time.perf_counter()
            runner.forward(x)
            once = comm.all_reduce(torch.tensor([time.perf_counter() - start])).item() / comm.world
            iters = max(3, math.ceil(min_time_s / max(once, 1e-6)))
            start = time.perf_counter()
            for _ in range(iters):
                runner.forward(x)
            out[T] = (time.perf_counter() - start) / iters
    return out


async def closed_loop(call, inputs: list[torch.Tensor], duration_s: float) -> dict[str, Any]:
    """A task per input calling ``await call(x)`` back to back for ``duration_s``, after one warm-up call."""
    await call(inputs[0])
    latencies: list[float] = []
    deadline = time.perf_counter() + duration_s

    async def client(x):
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            await call(x)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client(x) for x in inputs))
    elapsed = time.perf_counter() - start
    n = len(latencies)
    return {"requests": n, "duration_s": round(elapsed, 3), "tokens_per_s": n * inputs[0].shape[0] / elapsed,
            "requests_per_s": n / elapsed, **harness.latency_ms(latencies)}


def run_scenario(name: str, path: str, deployment: str, clients: int, tokens: int, duration_s: float,
                 hidden: int, base_url: str) -> dict[str, Any]:
    from deployments.client import AsyncHTTPMoEClient, MoEClient

    inputs = [harness.seeded_randn(tokens, hidden, seed=i) for i in range(clients)]
    direct = MoEClient.direct(deployment, APP, timeout_s=600)
    before = direct.status()["counters"]

    async def go() -> dict[str, Any]:
        if path == "http":
            async with AsyncHTTPMoEClient(base_url, deployment=deployment, timeout_s=600,
                                          max_connections=clients) as http:
                return await closed_loop(lambda x: http.forward(x, LAYER), inputs, duration_s)
        client = direct if path == "handle" else MoEClient(APP, deployment=deployment, via_ingress=True,
                                                           timeout_s=600)
        return await closed_loop(lambda x: client.forward_async(x, LAYER), inputs, duration_s)

    r = asyncio.run(go())
    after = direct.status()["counters"]
    forwards, batched = (after[k] - before[k] for k in ("forwards", "forward_tokens"))
    r.update(scenario=name, path=path, deployment=deployment, clients=clients, tokens_per_request=tokens,
             forwards=forwards, mean_batch_tokens=batched / forwards if forwards else None)
    print(f"  {name} {path} {deployment} {clients} x {tokens} tokens: {r['tokens_per_s']:.0f} tokens/s, p50 "
          f"{r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, {forwards} forwards", flush=True)
    return r


def index_rows(results: dict[str, Any]) -> list[Target]:
    t = results["targets"]
    return [target(f"handle path / in-process tokens/s, {t['large_tokens']}-token requests",
                   t["handle_vs_inprocess"]),
            target("32 x 16-token clients, tokens/s batched / unbatched", t["batching_speedup"], ".1f")]


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    env, t, mbt = results["machine"], results["targets"], results["max_batch_tokens"]
    nice0 = t.get("batching_speedup_nice0")
    what = (f"`{env['preset']}` preset (H={env['hidden_size']}), {env['dtype']}, TP {env['tp_size']} on "
            f"logical GPUs (gloo), tail `{env['tail']}`, Ray worker niceness {env['worker_niceness']}, TP "
            f"ranks +{env['worker_nice_increment']}; closed loop, {env['duration_s']} s per row")
    return "\n".join([
        section_start(SECTION, "serve", results["argv"], env, what, json_path),
        "", "In-process runner (moe_runtime `local_group`, no Ray), same TP size and batch sizes:", "",
        *table("T (tokens/forward) | forward ms | tokens/s",
               ([T, f"{r['forward_ms']:.1f}", f"{r['tokens_per_s']:.0f}"]
                for T, r in results["inprocess"].items()), "rrr"),
        "", "Served (through Serve):", "",
        *table("scenario | path | deployment (max_batch_tokens) | clients x tokens | tokens/s | req/s "
               "| p50 ms | p99 ms | forwards | mean batch",
               ([r["scenario"], r["path"], f"{r['deployment']} ({mbt[r['deployment']]})",
                 f"{r['clients']} x {r['tokens_per_request']}", f"{r['tokens_per_s']:.0f}",
                 f"{r['requests_per_s']:.1f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", r["forwards"],
                 f"{r['mean_batch_tokens'] or 0:.0f}"] for r in results["scenarios"]), "llllrrrrrr"),
        "", "Targets (verdicts computed from the rows above):", "",
        f"- handle path at {t['large_tokens']}-token requests / in-process: "
        f"{verdict_text(t['handle_vs_inprocess'])}; app handle {t['app_vs_inprocess']:.2f}, HTTP "
        f"{t['http_vs_inprocess']:.2f}.",
        f"- 32 concurrent 16-token clients, batching / max_batch_tokens = 16: "
        f"{verdict_text(t['batching_speedup'], '.1f')} with the ranks at worker_nice_increment "
        f"{env['worker_nice_increment']}" + ("." if nice0 is None else f"; {nice0:.1f}x with the ranks "
                                            "at the replica's priority (rows `batching-nice0`)."),
        *computed_notes(results)])


def computed_notes(results: dict[str, Any]) -> list[str]:
    """The batched deployment's batches against the tokens in flight, and HTTP against the handle path."""
    rows = {(r["scenario"], r["path"], r["deployment"]): r for r in results["scenarios"]}
    notes = []
    if (r := rows.get(("batching", "handle", "batched"))) and r["mean_batch_tokens"]:
        offered = r["clients"] * r["tokens_per_request"]
        notes.append(f"- {r['clients']} clients of {r['tokens_per_request']} tokens, batched: "
                     f"{r['forwards']} forwards of {r['mean_batch_tokens']:.0f} tokens on average, "
                     f"{r['mean_batch_tokens'] / offered:.0%} of the {offered} tokens in flight.")
    if (h := rows.get(("large", "handle", "batched"))) and (w := rows.get(("large", "http", "batched"))):
        notes.append(f"- {h['tokens_per_request']}-token requests, HTTP / handle tokens/s: "
                     f"{w['tokens_per_s'] / h['tokens_per_s']:.2f} (p50 {w['p50_ms']:.0f} vs "
                     f"{h['p50_ms']:.0f} ms).")
    return notes


def measure(args: Any, ckpt: Path, H: int, mbt: dict[str, int]) -> tuple[dict[str, Any], list[dict]]:
    """The in-process baseline by T, and every closed-loop row (the batching pair again at nice 0)."""
    sizes = sorted({16, 512, args.large_tokens})
    plan = [("large", p, "batched", args.large_clients, args.large_tokens) for p in ("handle", "app", "http")]
    plan += [("batching", "handle", d, 32, 16) for d in ("batched", "unbatched")]
    if not args.quick:
        plan += [("batching", "http", "batched", 32, 16), ("mid", "handle", "batched", 8, 512),
                 ("latency", "handle", "batched", 1, 16), ("latency", "http", "batched", 1, 16)]
    app_args = {"checkpoint": str(ckpt), "tp_size": args.tp, "tail": args.tail, "dtype": args.dtype,
                "layers": [LAYER], "max_tokens_per_request": max(args.large_tokens, 4096),
                "max_ongoing_requests": 128, "worker_nice_increment": args.worker_nice_increment,
                "deployments": [
                    {"name": "batched", "max_batch_tokens": mbt["batched"], "batch_wait_timeout_s": 0.005},
                    {"name": "unbatched", "max_batch_tokens": mbt["unbatched"], "batch_wait_timeout_s": 0.0}]}
    nice = args.worker_niceness
    with harness.serving(app_args, APP, num_cpus=4, num_gpus=4 * args.tp, worker_niceness=nice) as url:
        print(f"app up; in-process baseline at T = {sizes}", flush=True)
        per_rank = run_local_group(args.tp, _inprocess_rank, str(ckpt), args.tail, args.dtype, sizes,
                                   min(args.duration, 5.0), timeout_s=1800)
        inprocess = {str(T): {"forward_ms": s * 1e3, "tokens_per_s": T / s}
                     for T in sizes for s in [max(r[T] for r in per_rank)]}
        rows = [run_scenario(*row, args.duration, H, url) for row in plan]
        if args.worker_nice_increment:
            print("redeploying with worker_nice_increment 0", flush=True)
            harness.deploy({**app_args, "worker_nice_increment": 0}, APP)
            rows += [run_scenario("batching-nice0", "handle", dep, 32, 16, args.duration, H, url)
                     for dep in ("batched", "unbatched")]
    return inprocess, rows


def targets_of(results: dict[str, Any], large_tokens: int) -> dict[str, Any]:
    tokens_per_s = {(r["scenario"], r["path"], r["deployment"]): r["tokens_per_s"]
                    for r in results["scenarios"]}
    inproc = results["inprocess"][str(large_tokens)]["tokens_per_s"]
    t = {"large_tokens": large_tokens,
         **{f"{p}_vs_inprocess": tokens_per_s["large", p, "batched"] / inproc for p in ("app", "http")},
         "handle_vs_inprocess": verdict(tokens_per_s["large", "handle", "batched"] / inproc, ">=", 0.8),
         "batching_speedup": verdict(tokens_per_s["batching", "handle", "batched"]
                                     / tokens_per_s["batching", "handle", "unbatched"], ">=", 3)}
    if ("batching-nice0", "handle", "batched") in tokens_per_s:
        t["batching_speedup_nice0"] = (tokens_per_s["batching-nice0", "handle", "batched"]
                                       / tokens_per_s["batching-nice0", "handle", "unbatched"])
    return t


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "serve", quick="short windows; only the two target scenarios", tp=2)
    ap.add_argument("--preset", default="small", choices=["tiny", "small"])
    ap.add_argument("--checkpoint", type=Path, help="default: the --preset checkpoint under checkpoints/")
    ap.add_argument("--tail", default="sharded")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--large-tokens", type=int, default=2048)
    ap.add_argument("--large-clients", type=int, default=2)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per closed-loop row")
    ap.add_argument("--worker-niceness", type=int, default=0, help="every Ray worker's (Ray's default: 15)")
    ap.add_argument("--worker-nice-increment", type=int, default=10,
                    help="the TP ranks' worker_nice_increment; the batching pair is measured again at 0")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration = min(args.duration, 5.0)
    ckpt = args.checkpoint or harness.preset_checkpoint(args.preset)
    H = LatentMoEConfig.from_pretrained(ckpt).hidden_size
    mbt = {"batched": args.max_batch_tokens, "unbatched": 16}
    machine = harness.machine_record(
        with_ray=True, preset=args.preset, hidden_size=H, dtype=args.dtype, tp_size=args.tp, tail=args.tail,
        duration_s=args.duration, worker_niceness=args.worker_niceness,
        worker_nice_increment=args.worker_nice_increment)
    inprocess, rows = measure(args, ckpt, H, mbt)
    results = {"max_batch_tokens": mbt, "inprocess": inprocess, "scenarios": rows}
    results["targets"] = targets_of(results, args.large_tokens)
    return harness.report(args, results, machine, markdown, index_rows)


if __name__ == "__main__":
    raise SystemExit(main())
