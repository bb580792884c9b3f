"""End-to-end local run (``scripts/run.sh``): start a local Ray instance with logical GPUs, run
a Serve config, exercise it through every path a caller has (handle, HTTP, a lane, a cohort)
against the single-device reference, and shut down everything this process started.

    python scripts/demo.py [--config deployments/configs/local.yaml] [--serve]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

import examples.rows  # noqa: E402
from deployments.client import HTTPMoEClient, MoEClient  # noqa: E402
from deployments.config.timeouts import EVENTS_PUSH_S  # noqa: E402
from examples.rows import RowsWorker  # noqa: E402
from moe_runtime.checkpoint import load_layer_weights  # noqa: E402
from moe_runtime.config import LatentMoEConfig  # noqa: E402
from moe_runtime.layer import moe_forward  # noqa: E402
from moe_runtime.units import torch_dtype  # noqa: E402


def load_serve_config(path: Path, checkpoint: str | None, port: int | None) -> dict[str, Any]:
    """The Serve config file, with the checkpoint (made absolute) and port optionally replaced."""
    config = yaml.safe_load(path.read_text())
    if not isinstance(config, dict) or not config.get("applications"):
        raise ValueError(f"{path} is not a Serve config with applications")
    for app in config["applications"]:
        args = app.setdefault("args", {})
        if checkpoint is not None:
            args["checkpoint"] = checkpoint
        if "checkpoint" in args and not Path(args["checkpoint"]).is_absolute():
            args["checkpoint"] = str((ROOT / args["checkpoint"]).resolve())
    if port is not None:
        config.setdefault("http_options", {})["port"] = port
    return config


def gpus_needed(resolved: list) -> int:
    return sum(r.spec.tp_size * (r.spec.num_replicas or 1) for r in resolved)


def _ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:7.2f} ms"


def references(resolved: list) -> list[dict[str, Any]]:
    """Every deployment and layer at T = 1, 33, 300: its input, the single-device forward and the
    tolerance (fp32: only the TP reduction order differs from the reference; bf16: bf16 rounding)."""
    cases = []
    for r in resolved:
        cfg = LatentMoEConfig.from_pretrained(r.checkpoint)
        dtype = torch_dtype(r.spec.dtype)
        for layer in r.layers:
            weights = load_layer_weights(r.checkpoint, cfg, layer, dtype)
            for T in (1, 33, 300):
                if T <= r.spec.max_tokens_per_request:
                    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T)).to(dtype)
                    cases.append({"deployment": r.spec.name, "layer": layer, "T": T, "x": x,
                                  "ref": moe_forward(x, weights, cfg).float(),
                                  "tol": 1e-4 if dtype == torch.float32 else 5e-2})
    return cases


def timed(repeats: int, call: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[float]]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = call(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return out, times


def exercise(app_name: str, base_url: str, resolved: list, repeats: int) -> bool:
    """Every deployment and layer at T = 1, 33, 300 through each path a caller has (handle, HTTP,
    a lane, a cohort of two workers splitting the rows) against the single-device reference."""
    import ray

    status = MoEClient(app_name).status()
    for name, st in status["deployments"].items():
        print(f"[{name}] TP {st['tp_size']} on {st['device']}/{st['backend']}, layers {st['layers']}, "
              f"tail: {st['tail_plan']['describe']} -- {st['tail_reason']}")
    cases = references(resolved)
    max_T = max(c["T"] for c in cases)
    results: dict[tuple[int, str], tuple[torch.Tensor, list[float]]] = {}
    client = MoEClient(app_name)
    with HTTPMoEClient(base_url) as http:
        for i, c in enumerate(cases):
            handle = MoEClient(app_name, deployment=c["deployment"])
            results[i, "handle"] = timed(repeats, handle.forward, c["x"], c["layer"])
            results[i, "http"] = timed(repeats, http.forward, c["x"], c["layer"], deployment=c["deployment"])
    with client.lane(max_tokens=max_T, name="demo") as lane:  # closed before the cohort opens its session
        for i, c in enumerate(cases):
            results[i, "lane"] = timed(repeats, lane.forward, c["x"], c["layer"])
    # the cohort path's stand-in attention workers (a step's input is their rows for every layer),
    # sent by value: their processes need not find examples/ from wherever this script runs
    ray.cloudpickle.register_pickle_by_value(examples.rows)
    workers = [ray.remote(RowsWorker).options(num_cpus=0).remote() for _ in range(2)]
    with client.cohort(workers, max_tokens=(max_T + 1) // 2, name="demo") as cohort:
        for T in sorted({c["T"] for c in cases}):
            # one cohort step runs every layer: each worker brings half of the rows of each
            step = [c for c in cases if c["T"] == T]
            half = (T + 1) // 2
            halves = [{c["layer"]: c["x"][:half] for c in step}, {c["layer"]: c["x"][half:] for c in step}]
            outs, times = timed(repeats, cohort.step, halves)
            per_layer = [t / len(step) for t in times]
            for c in step:
                i = cases.index(c)
                results[i, "cohort"] = (torch.cat([o[c["layer"]] for o in outs]), per_layer)
        path = cohort.status()["path"]
    for w in workers:
        ray.kill(w)
    ok = True
    print(f"{'deployment':>12} {'layer':>5} {'T':>5} {'path':>6} {'max|diff|':>10} {'latency p50':>12}")
    for i, c in enumerate(cases):
        for p in ("handle", "http", "lane", "cohort"):
            out, times = results[i, p]
            diff = (out.float() - c["ref"]).abs().max().item()
            ok &= diff <= c["tol"]
            print(f"{c['deployment']:>12} {c['layer']:>5} {c['T']:>5} {p:>6} {diff:10.2e} {_ms(times):>12}")
    print(f"(cohort: two workers, one step over every layer on the {path} path; latency = step / layers)")
    return ok


async def settled_counters(client: MoEClient) -> dict[str, Any]:
    """The replica's counters once the lane and cohort forwards before (rank 0 pushes them every
    EVENTS_PUSH_S) have all arrived."""
    last = None
    while True:
        now = (await client.status_async())["counters"]
        if last is not None and now["forwards"] == last["forwards"]:
            return now
        last = now
        await asyncio.sleep(2 * EVENTS_PUSH_S)


async def concurrent_burst(app_name: str, deployment: str, layer: int, hidden: int, n: int = 32) -> None:
    """n concurrent 16-token requests: shows the token-budget batching in the counters."""
    client = MoEClient.direct(deployment, app_name)
    before = await settled_counters(client)
    xs = [torch.randn(16, hidden) for _ in range(n)]
    start = time.perf_counter()
    await asyncio.gather(*(client.forward_async(x, layer) for x in xs))
    elapsed = time.perf_counter() - start
    after = (await client.status_async())["counters"]
    forwards = after["forwards"] - before["forwards"]
    print(f"[{deployment}] {n} concurrent 16-token requests: {forwards} forward(s), "
          f"{n * 16 / elapsed:.0f} tokens/s, batch tokens {after['batch_tokens']['recent'][-forwards:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "deployments/configs/local.yaml")
    ap.add_argument("--checkpoint", help="override the config's checkpoint folder")
    ap.add_argument("--port", type=int, help="override the config's HTTP port")
    ap.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray instance")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per (layer, T, path)")
    ap.add_argument("--serve", action="store_true", help="keep serving after the checks until Ctrl-C")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("deployments.client").setLevel(logging.WARNING)  # each session opened and closed

    from ray import serve

    from deployments.app import app_options, build_app
    from deployments.cluster.local import local_serve

    config = load_serve_config(args.config, args.checkpoint, args.port)
    apps = config["applications"]
    resolved_by_app = {a["name"]: app_options(a["args"])[1] for a in apps}  # fail fast, before Ray
    gpus = sum(gpus_needed(r) for r in resolved_by_app.values())
    http_options = dict(config.get("http_options") or {})
    host, port = http_options.get("host", "127.0.0.1"), http_options.get("port", 8000)
    base_url = f"http://{host}:{port}"
    ok = False
    try:  # a private local instance: logical GPUs on a CPU machine; workers log to files
        with local_serve(args.num_cpus, gpus, host=host, port=port):
            for a in apps:
                start = time.perf_counter()
                serve.run(build_app(a["args"]), name=a["name"], route_prefix=a.get("route_prefix", "/"))
                print(f"application {a['name']!r} up in {time.perf_counter() - start:.1f} s at {base_url}")
            ok = True
            for a in apps:
                resolved = resolved_by_app[a["name"]]
                ok &= exercise(a["name"], base_url, resolved, args.repeats)
                first = resolved[0]
                asyncio.run(concurrent_burst(a["name"], first.spec.name, first.layers[0], first.hidden_size))
            if args.serve:
                print(f"serving at {base_url} (POST /v1/layers/{{layer}}/forward, GET /v1/status); "
                      "Ctrl-C stops")
                while True:
                    time.sleep(3600)
    except KeyboardInterrupt:
        print("interrupted")
    print("all outputs match the single-device reference" if ok else "MISMATCH against the reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
