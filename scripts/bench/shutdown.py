"""How long deleting an idle app takes: ours (ingress + one TP-2 group, tiny checkpoint) against Ray
Serve's own floor (``floor_default``, and ``floor_fast`` polling its drain as ours do), deployed,
called once and deleted in turns, ``--reps`` rounds. The page says more.

    python -m scripts.bench.shutdown        # ~1 minute on 2 cores
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from . import harness
from .docs import Target, rounds_table, section_start, target, target_lines, verdict

SECTION = "# Deleting an idle app: how fast replicas stop (`scripts/bench/shutdown.py`)"
APPS = ("ours", "floor_default", "floor_fast")


def floor_app(wait_loop_s: float | None) -> Any:
    """Two trivial deployments, the first calling the second (Serve's options, or the interval)."""
    from ray import serve

    options = {} if wait_loop_s is None else {"graceful_shutdown_wait_loop_s": wait_loop_s}

    @serve.deployment(name="backend", **options)
    class Backend:
        def __call__(self, x: int) -> int:
            return x

    @serve.deployment(name="front", **options)
    class Front:
        def __init__(self, backend: Any):
            self.backend = backend

        async def __call__(self, x: int) -> int:
            return await self.backend.remote(x)

    return Front.bind(Backend.bind())


def deploy_call_delete_s(name: str, app_args: dict[str, Any], x: Any) -> float:
    """Deploy the app ``name``, call it once, then delete it: the seconds ``serve.delete`` took."""
    from ray import serve

    from deployments.client import MoEClient
    from deployments.config.timeouts import DRAIN_POLL_S

    if name == "ours":
        harness.deploy(app_args, name)
        MoEClient(name, timeout_s=120).forward(x, 1)
    else:
        handle = serve.run(floor_app(None if name == "floor_default" else DRAIN_POLL_S), name=name,
                           route_prefix=f"/{name}")
        handle.remote(1).result(timeout_s=120)
    t0 = time.perf_counter()
    serve.delete(name)
    return time.perf_counter() - t0


def verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    med = {n: statistics.median(v) for n, v in results["delete_s"].items()}
    return {"over_floor": verdict(med["ours"] - med["floor_fast"], "<=", 0.5),
            "vs_default": verdict(med["ours"] / med["floor_default"], "<", 1.0)}


def index_rows(results: dict[str, Any]) -> list[Target]:
    v = results["verdicts"]
    return [target("serve.delete of ours - Serve's fast floor", v["over_floor"], ".2f", " s"),
            target("serve.delete of ours / Serve's default floor", v["vs_default"])]


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    what = {"ours": "the app: ingress + one TP-2 group (tiny, float32)",
            "floor_default": "Ray's floor: two trivial deployments, Serve's default options",
            "floor_fast": f"the same, graceful_shutdown_wait_loop_s = {results['drain_poll_s']:g} s"}
    rows = rounds_table("app", "serve.delete, s", results["delete_s"], what)
    how = f"each app deployed, called once, then deleted, in turns, {results['reps']} rounds"
    return "\n".join([section_start(SECTION, "shutdown", results["argv"], results["machine"], how, json_path),
                      "", *rows, "", *target_lines(index_rows(results))])


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "shutdown")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    from deployments.config.timeouts import DRAIN_POLL_S

    app_args, x = harness.tiny_app(tp_size=2, tail="sharded")
    measured, machine = harness.apps_in_turns(APPS, args.reps, 2,
                                              lambda app, _: deploy_call_delete_s(app, app_args, x))
    results = {"delete_s": measured, "reps": args.reps, "drain_poll_s": DRAIN_POLL_S}
    return harness.report(args, results, machine, markdown, index_rows, verdicts=verdicts)


if __name__ == "__main__":
    raise SystemExit(main())
