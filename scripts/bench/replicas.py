"""What an app's replicas cost to start and to keep, CPU time and memory: ours (ingress + one TP-1 group,
tiny checkpoint) against Ray Serve's floor (``floor``, and ``floor_torch`` importing torch), deployed,
called and measured in turns, ``--reps`` rounds. The page says more.

    python -m scripts.bench.replicas        # ~1 minute on 2 cores
"""

import statistics
from typing import Any

from . import harness
from .docs import Target, rounds_table, section_start, target, target_lines, verdict
from .rss import cpu_seconds, process_memory, serve_replica_pid

SECTION = "# An app's replicas at start: CPU and memory (`scripts/bench/replicas.py`)"
APPS = ("ours", "floor", "floor_torch")
ROLES = {"ingress": "ingress replica", "backend": "group replica (ours) / backend replica (floors)"}
SHORT = {"ingress": "ingress replica", "backend": "group replica"}
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
        def __init__(self, import_torch: bool):
            if import_torch:
                import torch  # noqa: F401  (the cost being measured)

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

    return Front.bind(Backend.bind(import_torch), import_torch)


def deploy_call_measure(name: str, app_args: dict[str, Any], url: str, body: bytes
                        ) -> dict[str, dict[str, float]]:
    import httpx
    from ray import serve

    from deployments.config.spec import DEFAULT_DEPLOYMENT

    if name == "ours":
        harness.deploy(app_args, name)
    else:
        serve.run(floor_app(name == "floor_torch"), name=name, route_prefix="/")
    httpx.post(f"{url}/v1/layers/1/forward", content=body, timeout=120).raise_for_status()
    measured = {}
    backend = DEFAULT_DEPLOYMENT if name == "ours" else "backend"
    for role, deployment in (("ingress", "ingress"), ("backend", backend)):
        pid = serve_replica_pid(name, deployment)
        memory = process_memory(pid)
        measured[role] = {"cpu_s": cpu_seconds([pid]), "rss_mb": memory["rss"] / MB,
                          "pss_mb": memory["pss"] / MB}
    serve.delete(name)
    return measured


def per_round(results: dict[str, Any], role: str, metric: str) -> dict[str, list[float]]:
    return {n: [r[role][metric] for r in rounds] for n, rounds in results["rounds"].items()}


def verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Ours against each floor, role by role, from the medians of the measured rounds."""
    out = {}
    for role in ROLES:
        cpu, pss = ({n: statistics.median(v) for n, v in per_round(results, role, m).items()}
                    for m in ("cpu_s", "pss_mb"))
        out[f"{role}_cpu_over_floor"] = verdict(cpu["ours"] - cpu["floor"], "<=", 0.5)
        out[f"{role}_pss_over_floor"] = verdict(pss["ours"] - pss["floor"], "<=", 30.0)
        out[f"{role}_cpu_vs_floor_torch"] = verdict(cpu["ours"] / cpu["floor_torch"], "<", 1.0)
        out[f"{role}_pss_vs_floor_torch"] = verdict(pss["ours"] / pss["floor_torch"], "<", 1.0)
    return out


def index_rows(results: dict[str, Any]) -> list[Target]:
    v = results["verdicts"]
    return [row for role, replica in SHORT.items() for row in (
        target(f"{replica}'s CPU-s, ours - Ray's floor", v[f"{role}_cpu_over_floor"]),
        target(f"{replica}'s PSS, ours - Ray's floor", v[f"{role}_pss_over_floor"], ".1f", " MB"),
        target(f"{replica}'s CPU-s, ours / the floor with torch", v[f"{role}_cpu_vs_floor_torch"]),
        target(f"{replica}'s PSS, ours / the floor with torch", v[f"{role}_pss_vs_floor_torch"]))]


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    what = {"ours": "our app (ingress + TP-1 group, tiny, float32)",
            "floor": "Ray's floor: a FastAPI ingress passing the body to a trivial deployment",
            "floor_torch": "the same floor, both replicas importing torch as they start"}
    tables = []
    for role, label in ROLES.items():
        for metric, unit in (("cpu_s", "CPU-s since it started"), ("pss_mb", "PSS, MB")):
            tables += [*rounds_table("app", f"{label}: {unit}", per_round(results, role, metric), what), ""]
    return "\n".join([
        section_start(SECTION, "replicas", results["argv"], results["machine"],
                      "each app deployed, called once over HTTP, its two replicas measured, then "
                      f"deleted, in turns, {results['reps']} rounds", json_path), "", *tables,
        *target_lines(index_rows(results))])


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "replicas")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    from deployments.client.http_client import encode_request

    app_args, x = harness.tiny_app(tp_size=1)
    body = encode_request(x)
    rounds, machine = harness.apps_in_turns(
        APPS, args.reps, 1, lambda app, url: deploy_call_measure(app, app_args, url, body))
    return harness.report(args, {"rounds": rounds, "reps": args.reps}, machine, markdown, index_rows,
                          verdicts=verdicts)


if __name__ == "__main__":
    raise SystemExit(main())
