"""What an HTTP ingress replica costs to start and to keep: ours against Ray Serve's floor, side by side.

Our ingress routes calls and reads and writes safetensors bodies with numpy: it never imports
torch, which costs a process ~1.5 CPU-s to import and holds its libraries' pages. Every app runs at
least one ingress replica (two by default), and every start, replacement and scale-up pays it
again. One private Ray, in turns (``--reps`` rounds; each app deployed, called once over HTTP with
a 3-token F32 body, measured, deleted):

* ``ours``: the app (ingress + one TP-1 group, tiny checkpoint, float32); its ingress replica;
* ``floor``: Ray's floor: a FastAPI ingress deployment passing the body to a trivial deployment
  and back (the same shape of app), Serve's defaults;
* ``floor_torch``: the same floor, its ingress importing torch as it starts: what an ingress
  that converts bodies with torch pays (ours did before it read bodies with numpy).

Measured on each app's ingress replica process after the call: the CPU time it has used since it
started (user + system) and its resident memory (anonymous + shared, RSS and PSS).

    python scripts/bench_ingress.py        # ~1 minute on 2 cores

Targets (medians): ours uses <= 0.5 CPU-s more than ``floor`` and holds <= 30 MB more PSS;
against ``floor_torch`` both ratios are < 1.
"""

import statistics
from pathlib import Path
from typing import Any

from bench import harness
from bench.docs import rounds_table, section_start, verdict, verdict_text, write_results
from bench.rss import cpu_seconds, process_memory, serve_replica_pid

SECTION = "## An ingress replica's start: CPU and memory (`scripts/bench_ingress.py`)"
APPS = ("ours", "floor", "floor_torch")
MB = 10**6


def floor_app(import_torch: bool) -> Any:
    """A FastAPI ingress that passes a forward's body to a trivial deployment and answers with it.
    (This module has no ``from __future__ import annotations``: the routes' annotations must be
    the classes themselves, which travel with the pickled class to the replica.)"""
    from fastapi import FastAPI, Request, Response
    from ray import serve

    api = FastAPI()

    @serve.deployment(name="backend")
    class Backend:
        def __call__(self, body: bytes) -> bytes:
            return body

    @serve.deployment(name="ingress")
    @serve.ingress(api)
    class Front:
        def __init__(self, backend: Any, import_torch: bool):
            if import_torch:
                import torch  # noqa: F401  (the cost being measured)
            self.backend = backend

        @api.post("/v1/layers/{layer}/forward")
        async def forward(self, layer: int, request: Request) -> Response:
            return Response(await self.backend.remote(await request.body()))

    return Front.bind(Backend.bind(), import_torch)


def deploy_call_measure(name: str, app_args: dict[str, Any], url: str, body: bytes) -> dict[str, float]:
    import httpx
    from ray import serve

    if name == "ours":
        harness.deploy(app_args, name)
    else:
        serve.run(floor_app(name == "floor_torch"), name=name, route_prefix="/")
    answer = httpx.post(f"{url}/v1/layers/1/forward", content=body, timeout=120)
    answer.raise_for_status()
    pid = serve_replica_pid(name, "ingress")
    cpu_s, memory = cpu_seconds([pid]), process_memory(pid)
    serve.delete(name)
    return {"cpu_s": cpu_s, "rss_mb": memory["rss"] / MB, "pss_mb": memory["pss"] / MB}


def medians(results: dict[str, Any], metric: str) -> dict[str, float]:
    return {n: statistics.median(r[metric] for r in rounds) for n, rounds in results["rounds"].items()}


def plot(results: dict[str, Any], path: Path) -> None:
    fig, axes = harness.pyplot().subplots(1, 2, figsize=(8, 3.2))
    labels = {"cpu_s": "CPU-s used (median)", "pss_mb": "PSS, MB (median)"}
    for ax, (metric, label) in zip(axes, labels.items(), strict=True):
        ax.bar(list(APPS), list(medians(results, metric).values()), color="tab:blue")
        ax.set_ylabel(label)
    fig.suptitle(f"an ingress replica after one call, {results['reps']} rounds", fontsize=10)
    harness.save_figure(fig, path, dpi=100)


def verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The targets of the module docstring, from the measured results."""
    cpu, pss = medians(results, "cpu_s"), medians(results, "pss_mb")
    return {"cpu_over_floor": verdict(cpu["ours"] - cpu["floor"], "<=", 0.5),
            "pss_over_floor": verdict(pss["ours"] - pss["floor"], "<=", 30.0),
            "cpu_vs_floor_torch": verdict(cpu["ours"] / cpu["floor_torch"], "<", 1.0),
            "pss_vs_floor_torch": verdict(pss["ours"] / pss["floor_torch"], "<", 1.0)}


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    what = {"ours": "the app's ingress (TP-1 group behind it, tiny, float32)",
            "floor": "Ray's floor: a FastAPI ingress passing the body to a trivial deployment",
            "floor_torch": "the same floor, importing torch as it starts"}
    per = {m: {n: [r[m] for r in rounds] for n, rounds in results["rounds"].items()}
           for m in ("cpu_s", "pss_mb")}
    v = results["verdicts"]
    return "\n".join([
        section_start(SECTION, "bench_ingress", results["argv"], results["machine"],
                      "each app deployed, called once over HTTP, its ingress replica measured, then "
                      f"deleted, in turns, {results['reps']} rounds", json_path, png_path), "",
        *rounds_table("app", "ingress replica CPU-s since it started", per["cpu_s"], what), "",
        *rounds_table("app", "ingress replica PSS, MB", per["pss_mb"], what), "",
        f"- Ours over the floor: {verdict_text(v['cpu_over_floor'])} CPU-s, "
        f"{verdict_text(v['pss_over_floor'], '.1f')} MB PSS.",
        f"- Ours as a share of the floor that imports torch: {verdict_text(v['cpu_vs_floor_torch'])} of its "
        f"CPU-s, {verdict_text(v['pss_vs_floor_torch'])} of its PSS.",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "bench_ingress")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    from deployments.client.http_client import encode_request

    app_args, x = harness.tiny_app(tp_size=1)
    body = encode_request(x)
    machine = harness.machine_record(with_ray=True)
    with harness.local_serve(num_cpus=8, num_gpus=1) as url:
        rounds = harness.in_turns(APPS, args.reps, lambda app: deploy_call_measure(app, app_args, url, body))
    results = {"rounds": rounds, "reps": args.reps, "argv": args.argv,
               "machine": dict(machine, loadavg_after=harness.loadavg())}
    results["verdicts"] = verdicts(results)
    write_results(results, args.out, "bench_ingress", plot, markdown, args.docs)
    return 0 if all(v["met"] for v in results["verdicts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
