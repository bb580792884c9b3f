"""What every benchmark script does the same way: its options, the machine record and its report,
timing loops and percentiles, a private Ray + Serve, checkpoints written once, seeded inputs and plots.
Heavy modules (torch, Ray, matplotlib, the project's own) are imported where they are used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from . import ROOT
from .docs import PAGES, render_section

CHECKPOINTS = ROOT / "checkpoints"


class BenchParser(argparse.ArgumentParser):
    """Keeps the arguments it parsed as ``args.argv``: a run's results name the command that made them."""

    def parse_args(self, args: list[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        parsed = super().parse_args(args, namespace)
        parsed.argv = sys.argv[1:] if args is None else list(args)
        return parsed


def bench_parser(doc: str, name: str, *, quick: str | None = None, tp: int | None = None) -> BenchParser:
    """A benchmark's parser: ``--out``, ``--docs``, ``--quick`` (help: ``quick``) where it has a short
    mode, ``--tp`` (default ``tp``) where it serves one TP size."""
    ap = BenchParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.set_defaults(bench=name)
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / name, help="folder for the results")
    ap.add_argument("--docs", default=str(PAGES),
                    help="the benchmark pages' folder whose page and index this run rewrites ('' for none)")
    if quick:
        ap.add_argument("--quick", action="store_true", help=quick)
    if tp is not None:
        ap.add_argument("--tp", type=int, default=tp, help="the TP size served")
    return ap


def int_list(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def busy_cpu_s() -> float | None:
    """CPU-seconds the machine has been busy (/proc/stat: all but idle and iowait); None without it."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity: what a container or taskset grants)."""
    return len(os.sched_getaffinity(0))


def machine_record(with_ray: bool = False, **extra: Any) -> dict[str, Any]:
    """Date (UTC), CPUs, machine, platform, torch (and Ray) versions, the load before, and ``extra``."""
    import torch

    if with_ray:
        import ray

        extra = {"ray": ray.__version__, **extra}
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": cpu_count(),
            "machine": platform.machine(), "platform": platform.platform(), "torch": torch.__version__,
            "loadavg_before": loadavg(), **extra}


MODEL_FIELDS = ("hidden_size", "routed_expert_hidden_size", "num_experts", "num_experts_per_token",
                "moe_intermediate_size", "num_shared_experts")


def model_record(cfg: Any) -> dict[str, int]:
    return {k: getattr(cfg, k) for k in MODEL_FIELDS}


def report(args: argparse.Namespace, results: dict[str, Any], machine: dict[str, Any], markdown: Any,
           index_rows: Any, plot: Any = None, ok: bool = True, verdicts: Any = None) -> int:
    """Write ``results`` (with the command and ``machine``, the load after added) as NAME.json under
    ``--out`` (NAME.png: ``plot``), then its page and index rows: exit status 1 where not ``ok`` or,
    given ``verdicts`` (results -> verdicts, kept under ``verdicts``), where one is not met."""
    if verdicts is not None:
        results["verdicts"] = verdicts(results)
        ok = ok and all(v["met"] for v in results["verdicts"].values())
    results.update(argv=args.argv, machine=dict(machine, loadavg_after=loadavg()))
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{args.bench}.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    if plot is not None:
        plot(results, json_path.with_suffix(".png"))
    render_section(json_path, markdown, index_rows, args.docs, args.bench, results)
    return 0 if ok else 1


def rank_runner(comm: Any, checkpoint: str | Path, layer: int, tail: str, dtype: Any, **options: Any) -> Any:
    """This rank's runner of ``layer`` (``tp.runner.build_rank_runners``), ``tail`` resolved for its group."""
    from moe_runtime.config import LatentMoEConfig
    from moe_runtime.tp.plan import resolve_tail
    from moe_runtime.tp.runner import build_rank_runners

    cfg = LatentMoEConfig.from_pretrained(checkpoint)
    plan = resolve_tail(tail, cfg, comm.world)
    return build_rank_runners(checkpoint, cfg, [layer], comm, plan, dtype=dtype, **options)[layer]


def synchronizer(device: Any) -> Callable[[], None] | None:
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def time_calls(fn: Callable[[], Any], reps: int, *, warmup: int = 1, min_time_s: float = 0.0,
               budget_s: float = math.inf, sync: Callable[[], None] | None = None) -> list[float]:
    """Seconds of each call of ``fn`` after ``warmup`` untimed ones, until ``reps`` calls and
    ``min_time_s`` seconds, or ``budget_s`` runs out (two calls at least; no budget where every rank
    must make the same calls); ``sync`` closes the warm-up and every call."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    seconds: list[float] = []
    start = time.perf_counter()
    while ((len(seconds) < reps or sum(seconds) < min_time_s)
           and (len(seconds) < 2 or time.perf_counter() - start < budget_s)):
        seconds.append(_timed(fn, sync))
    return seconds


def _timed(fn: Callable[[], Any], sync: Callable[[], None] | None) -> float:
    t0 = time.perf_counter()
    fn()
    if sync:
        sync()
    return time.perf_counter() - t0


def time_interleaved(fns: dict[str, Callable[[], Any]], reps: int, *, min_time_s: float = 0.0,
                     sync: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """:func:`time_calls` of several functions in turn (a busy machine slows them alike)."""
    _timed(lambda: [fn() for fn in fns.values()], sync)  # the warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    while min(len(t) for t in times.values()) < reps or min(sum(t) for t in times.values()) < min_time_s:
        for name, fn in fns.items():
            times[name].append(_timed(fn, sync))
    return times


def in_turns(names: Iterable[str], reps: int, measure: Callable[[str], Any]) -> dict[str, list[Any]]:
    """``measure(name)`` for every name in turn, ``reps`` rounds: each name's results in round order."""
    results: dict[str, list[Any]] = {name: [] for name in names}
    for _ in range(reps):
        for name in results:
            results[name].append(measure(name))
    return results


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1): a value that was measured, never interpolated."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def latency_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {"p50_ms": statistics.median(ms), "p90_ms": percentile(ms, 0.9), "p99_ms": percentile(ms, 0.99)}


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def rel_diff(got: Any, want: Any) -> float:
    """max|got - want| / max|want| of two tensors."""
    return (got - want).abs().max().item() / (want.abs().max().item() or 1.0)


def memcpy_gbps(reps: int = 5, nbytes: int = 256 * 2**20) -> float:
    """Bytes copied per second between two ``nbytes`` buffers, best of ``reps`` (GB = 1e9 bytes)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return nbytes / min(time_calls(lambda: dst.copy_(src), reps)) / 1e9


def seeded_randn(rows: int, cols: int, seed: int, dtype: Any = None) -> Any:
    """A ``[rows, cols]`` standard-normal input from its own generator, cast to ``dtype`` when given."""
    import torch

    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    return x if dtype is None else x.to(dtype)


def ensure_checkpoint(path: Path, preset: str, layers: int | None = None, *, mxfp4: bool = False) -> Path:
    """The ``preset`` checkpoint (seed 0) at ``path``, written there when missing."""
    from moe_runtime.synthetic import preset_config, write_checkpoint

    if not (path / "config.json").is_file():
        print(f"writing the {preset} checkpoint to {path}", flush=True)
        overrides = {} if layers is None else {"num_hidden_layers": layers}
        write_checkpoint(path, preset_config(preset, **overrides), use_mxfp4=mxfp4, seed=0, progress=True)
    return path


def preset_checkpoint(preset: str, layers: int | None = None, *, mxfp4: bool = False) -> Path:
    """checkpoints/NAME, named for what it holds (``small``, ``small-mxfp4``, ``small-4layers``)."""
    name = "-".join([preset, *([f"{layers}layers"] if layers else []), *(["mxfp4"] if mxfp4 else [])])
    return ensure_checkpoint(CHECKPOINTS / name, preset, layers, mxfp4=mxfp4)


def tiny_app(**spec: Any) -> tuple[dict[str, Any], Any]:
    """App arguments serving the tiny checkpoint (one deployment ``spec``, one ingress replica, no
    tail measurement), and a seeded 3-token float32 input of its width."""
    from moe_runtime.config import LatentMoEConfig

    checkpoint = preset_checkpoint("tiny")
    args = {"checkpoint": str(checkpoint), "ingress_replicas": 1, "dtype": "float32",
            "auto_tune_tokens": "none", **spec}
    return args, seeded_randn(3, LatentMoEConfig.from_pretrained(checkpoint).hidden_size, seed=0)


@contextlib.contextmanager
def local_serve(num_cpus: int, num_gpus: int = 0, worker_niceness: int | None = None) -> Iterator[str]:
    """A private Ray + Serve (``deployments.cluster.local``), yielding the proxy's URL;
    ``worker_niceness`` overrides Ray's 15 for its workers."""
    from deployments.cluster.local import local_serve as private_serve

    system = {} if worker_niceness is None else {"_system_config": {"worker_niceness": worker_niceness}}
    with private_serve(num_cpus, num_gpus, **system) as port:
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def serving(app_args: dict[str, Any], app: str, num_cpus: int, num_gpus: int = 0,
            worker_niceness: int | None = None) -> Iterator[str]:
    """:func:`local_serve` with ``app_args`` deployed as the application ``app``."""
    with local_serve(num_cpus, num_gpus, worker_niceness) as url:
        deploy(app_args, app)
        yield url


def apps_in_turns(apps: Iterable[str], reps: int, num_gpus: int,
                  measure: Callable[[str, str], Any]) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """``measure(app, url)`` for every app in turn, ``reps`` rounds, on a private Ray + Serve of 8
    CPUs: the rounds, and the run's machine record with the load before and after."""
    machine = machine_record(with_ray=True)
    with local_serve(num_cpus=8, num_gpus=num_gpus) as url:
        rounds = in_turns(apps, reps, lambda app: measure(app, url))
    return rounds, dict(machine, loadavg_after=loadavg())


def deploy(app_args: dict[str, Any], name: str, route_prefix: str | None = "/") -> None:
    """``deployments.app:build_app(app_args)`` as the Serve application ``name``, back when ready."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(app_args), name=name, route_prefix=route_prefix)


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # benchmarks draw to files, with no display
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
