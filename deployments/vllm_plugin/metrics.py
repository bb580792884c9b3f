"""Engine metrics: each engine's tier calls per layer, their rows and their latency.

The op runs in vLLM's worker process, a process apart from the one that answers (the OpenAI
server, or the process holding an ``LLM``) under vLLM's default multiprocessing. So:

* **recorded** where the op runs: each tier (``tiers.LocalTier``, ``tiers.SessionTier``) keeps a
  :class:`TierStats`; :func:`recorded` wraps its ``forward``: per tier layer the calls answered,
  their rows and the seconds each took (the host's wall time of the call: on a GPU a local tier's
  kernels may still run after it), cumulative histogram buckets (:data:`BUCKETS`) and the last
  :data:`RECENT` calls' seconds (exact p50/p99). vLLM's dummy passes never reach ``forward``;
* **published** per process: :func:`publish` (``tiers.add``) puts the tier in this process's JSON
  snapshot, ``<pid>.json`` in the folder :data:`ENV` names, rewritten atomically when it changed
  at most every :data:`PERIOD_S` seconds, its modification time (nanoseconds) the moment it was
  complete (touched each period when nothing changed);
* **read** in the front-end process: :func:`setup` (the plugin's ``register()``, which vLLM runs
  in every process before it starts the engine core) makes the folder in the first process, sets
  :data:`ENV` for the processes vLLM starts from it, removes the folder at exit and adds
  :class:`TierCollector` to prometheus_client's default registry, the one vLLM's ``/metrics``
  serves; :func:`tier_stats` answers for an ``LLM``.

docs/vllm.md ("Engine metrics") has the names. Needs neither vLLM nor torch; prometheus_client
only for the collector.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import functools
import json
import math
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ENV = "LMS_VLLM_METRICS_DIR"
# Upper bounds (seconds) of the call-latency histogram's buckets; +Inf follows.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RECENT = 512  # calls per layer kept for p50/p99
QUANTILES = (0.5, 0.99)
PERIOD_S = 0.5
NAMES = ("latent_moe_tier_calls_total", "latent_moe_tier_rows_total", "latent_moe_tier_call_seconds",
         "latent_moe_tier_call_recent_seconds")


@dataclass
class LayerStats:
    calls: int = 0
    rows: int = 0
    seconds: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))  # per bucket, not cumulative
    recent: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=RECENT))

    def snapshot(self) -> dict[str, Any]:
        return {"calls": self.calls, "rows": self.rows, "seconds": self.seconds,
                "buckets": list(self.buckets), "recent_us": [round(s * 1e6) for s in self.recent]}


class TierStats:
    """One tier's calls per tier layer, safe to record from any thread. ``layers``: those the tier
    serves (listed with zero calls until called)."""

    def __init__(self, layers: Iterable[int] = ()):
        self.lock = threading.Lock()
        self.layers = {int(x): LayerStats() for x in layers}
        self.dirty = True

    def record(self, layer: int, rows: int, seconds: float) -> None:
        with self.lock:
            s = self.layers.get(layer)
            if s is None:
                s = self.layers[layer] = LayerStats()
            s.calls += 1
            s.rows += rows
            s.seconds += seconds
            s.buckets[bisect.bisect_left(BUCKETS, seconds)] += 1  # le: the first bound >= seconds
            s.recent.append(seconds)
            self.dirty = True

    def snapshot(self, clear: bool = False) -> dict[str, dict[str, Any]]:
        """``{layer: {calls, rows, seconds, buckets, recent_us}}`` (JSON's string keys); ``clear``:
        mark it published."""
        with self.lock:
            if clear:
                self.dirty = False
            return {str(x): s.snapshot() for x, s in self.layers.items()}


F = TypeVar("F", bound=Callable[..., Any])


def recorded(forward: F) -> F:
    """A tier's ``forward(x_TH, layer)``, each answered call recorded in the tier's ``stats``."""

    @functools.wraps(forward)
    def timed(tier: Any, x_TH: Any, layer: int) -> Any:
        start = time.perf_counter()
        out = forward(tier, x_TH, layer)
        tier.stats.record(layer, int(x_TH.shape[0]), time.perf_counter() - start)
        return out

    return timed  # type: ignore[return-value]


# ---- one process's snapshot ---------------------------------------------------------------------

class Publisher:
    """This process's tiers, by engine (vLLM's ``instance_id``), written to ``folder/<pid>.json``."""

    def __init__(self, folder: Path | None):
        self.path = None if folder is None else folder / f"{os.getpid()}.json"
        self.tiers: list[tuple[str, TierStats]] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, engine: str, stats: TierStats) -> None:
        with self.lock:
            self.tiers.append((engine, stats))
        if self.path is None:
            return
        self.write(force=True)  # there from the engine's start: the readers find it at once
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="latent-moe-metrics", daemon=True)
            self.thread.start()

    def engines(self, clear: bool = False) -> dict[str, dict[str, dict[str, Any]]]:
        by_engine: dict[str, list[dict[str, dict[str, Any]]]] = {}
        for engine, stats in self.tiers:
            by_engine.setdefault(engine, []).append(stats.snapshot(clear))
        return {engine: merge(layers) for engine, layers in by_engine.items()}

    def write(self, force: bool = False) -> None:
        assert self.path is not None
        with self.lock:
            now = time.time_ns()  # everything recorded before it is in what is written (or was)
            changed = force or any(stats.dirty for _, stats in self.tiers)
            try:
                if changed:
                    tmp = self.path.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"pid": os.getpid(), "engines": self.engines(clear=True)}))
                    os.replace(tmp, self.path)
                os.utime(self.path, ns=(now, now))
            except OSError:  # the folder's owner has exited and removed it: nobody reads it any more
                pass

    def run(self) -> None:
        while True:
            time.sleep(PERIOD_S)
            self.write()


_publisher: Publisher | None = None
_owner: int | None = None  # the pid of the process that made ENV's folder, in that process


def _forget() -> None:  # in a forked child: the parent's tiers and folder are not this process's
    global _publisher, _owner
    _publisher, _owner = None, None


os.register_at_fork(after_in_child=_forget)


def publish(stats: TierStats) -> None:
    """Put a tier's stats in this process's snapshot, under the engine being built (vLLM's current
    config's ``instance_id``; "" outside vLLM)."""
    global _publisher
    if _publisher is None:
        folder = os.environ.get(ENV)
        _publisher = Publisher(Path(folder) if folder else None)
    _publisher.add(_engine_being_built(), stats)


def _engine_being_built() -> str:
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return ""
    config = get_current_vllm_config_or_none()
    return "" if config is None else str(config.instance_id)


# ---- reading ------------------------------------------------------------------------------------

def merge(layer_maps: Iterable[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Snapshots' layers summed (several workers or tiers of one engine, or several engines): the
    recent calls of each, together."""
    out: dict[str, dict[str, Any]] = {}
    for layers in layer_maps:
        for layer, s in layers.items():
            m = out.setdefault(layer, LayerStats().snapshot())
            m["calls"] += s["calls"]
            m["rows"] += s["rows"]
            m["seconds"] += s["seconds"]
            m["buckets"] = [a + b for a, b in zip(m["buckets"], s["buckets"], strict=True)]
            m["recent_us"] = m["recent_us"] + s["recent_us"]
    return out


def quantile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (a value observed); NaN without samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary(s: dict[str, Any]) -> dict[str, Any]:
    """One layer as :func:`tier_stats` gives it."""
    out = {"calls": s["calls"], "rows": s["rows"], "seconds": s["seconds"]}
    for q in QUANTILES:
        us = quantile(s["recent_us"], q)
        out[f"p{round(q * 100)}_ms"] = None if math.isnan(us) else us / 1e3
    return out


@dataclass(frozen=True)
class Snapshot:
    pid: int
    written_ns: int  # everything the process had recorded by then is in it
    engines: dict[str, dict[str, dict[str, Any]]]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_snapshots(folder: Path) -> Iterator[Snapshot]:
    """The snapshots of the folder's live processes."""
    for path in folder.glob("*.json"):
        try:
            pid = int(path.stem)
            if not alive(pid):
                continue
            written = path.stat().st_mtime_ns
            data = json.loads(path.read_text())
        except (ValueError, OSError):  # not a snapshot, or gone since listed
            continue
        yield Snapshot(pid, written, data.get("engines", {}))


def is_engine(engine: str, wanted: str) -> bool:
    """``engine`` is ``wanted``'s, or one of its data-parallel engines' (vLLM adds ``_dp<rank>``)."""
    return engine == wanted or engine.startswith(wanted + "_dp")


def tier_stats(llm: Any, timeout_s: float = 10.0) -> dict[int, dict[str, Any]]:
    """An engine's tier calls so far, per tier layer: ``{layer: {"calls", "rows", "seconds",
    "p50_ms", "p99_ms"}}`` (``seconds``: their total; p50/p99 of the last :data:`RECENT` calls, None
    before the first). ``llm``: a ``vllm.LLM`` (or anything with a ``vllm_config``) of this
    process. Summed over the engine's workers; everything recorded before the call is in it (it
    waits for each worker's next snapshot, at most :data:`PERIOD_S` s). ``{}`` for an engine whose
    model has no block on the tier."""
    config = getattr(getattr(llm, "llm_engine", llm), "vllm_config", None)
    if config is None:
        raise TypeError(f"tier_stats takes a vllm.LLM (or an engine with a vllm_config), "
                        f"got {type(llm).__name__}")
    wanted, start = str(config.instance_id), time.time_ns()
    here = {} if _publisher is None else _publisher.engines()  # an engine core in this process
    layers = [m for e, m in here.items() if is_engine(e, wanted)]
    folder = os.environ.get(ENV)
    if folder:
        deadline = time.monotonic() + timeout_s
        while True:
            mine = [s for s in read_snapshots(Path(folder)) if s.pid != os.getpid()
                    and any(is_engine(e, wanted) for e in s.engines)]
            behind = [s.pid for s in mine if s.written_ns < start]
            if not behind:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"latent-MoE tier stats: worker process(es) {behind} wrote no snapshot "
                                   f"within {timeout_s:.0f} s (folder {folder})")
            time.sleep(PERIOD_S / 10)
        layers += [m for s in mine for e, m in s.engines.items() if is_engine(e, wanted)]
    return {int(x): summary(s) for x, s in sorted(merge(layers).items(), key=lambda kv: int(kv[0]))}


class TierCollector:
    """prometheus_client collector of every live process's snapshot in ``folder``, summed per tier
    layer (the engines of one server: its workers, data-parallel engines too)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def describe(self) -> list[Any]:
        return self.families({})

    def collect(self) -> list[Any]:
        return self.families(merge(m for s in read_snapshots(self.folder) for m in s.engines.values()))

    @staticmethod
    def families(layers: dict[str, dict[str, Any]]) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        calls = CounterMetricFamily(NAMES[0], "latent-MoE tier: the op's calls answered, per tier layer "
                                    "(vLLM's dummy passes excluded)", labels=["layer"])
        rows = CounterMetricFamily(NAMES[1], "latent-MoE tier: rows (tokens) sent, per tier layer",
                                   labels=["layer"])
        seconds = HistogramMetricFamily(NAMES[2], "latent-MoE tier: seconds per call (the worker's wall "
                                        "time)", labels=["layer"])
        recent = GaugeMetricFamily(NAMES[3], f"latent-MoE tier: seconds per call, quantiles of the last "
                                   f"{RECENT} calls per engine worker", labels=["layer", "quantile"])
        for layer, s in sorted(layers.items(), key=lambda kv: int(kv[0])):
            calls.add_metric([layer], s["calls"])
            rows.add_metric([layer], s["rows"])
            cumulative = [sum(s["buckets"][: i + 1]) for i in range(len(BUCKETS) + 1)]
            bounds = [repr(float(b)) for b in BUCKETS] + ["+Inf"]
            seconds.add_metric([layer], list(zip(bounds, cumulative, strict=True)), s["seconds"])
            for q in QUANTILES:
                recent.add_metric([layer, repr(q)], quantile(s["recent_us"], q) / 1e6)
        return [calls, rows, seconds, recent]


PREFIX = "lms-vllm-metrics-"  # + the owner's pid + "-" + mkdtemp's letters


def sweep(tmp: Path) -> None:
    """Remove the folders under ``tmp`` whose front end has exited."""
    for folder in tmp.glob(f"{PREFIX}*-*"):
        owner = folder.name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not alive(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)


def setup() -> None:
    """The plugin's ``register()`` part (vLLM runs it in each of its processes, before it starts the
    engine core): in a process vLLM started (multiprocessing: engine core, workers, more API
    servers) under a folder already named, nothing; otherwise (the front end: the OpenAI server,
    the process of an ``LLM``) make the folder, name it in :data:`ENV` for the processes started
    from here, remove it at exit (and the folders of front ends that exited without: killed, or
    ``os._exit``) and add :class:`TierCollector` to prometheus_client's default registry (vLLM's
    ``/metrics`` serves it unless ``PROMETHEUS_MULTIPROC_DIR`` is set: several API servers).
    Idempotent."""
    global _owner
    if _owner == os.getpid():
        return
    if os.environ.get(ENV) and multiprocessing.parent_process() is not None:
        return
    sweep(Path(tempfile.gettempdir()))
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    os.environ[ENV], _owner = folder, os.getpid()
    atexit.register(shutil.rmtree, folder, True)
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # vLLM brings it; without it there is no /metrics to serve either
        return
    REGISTRY.register(TierCollector(Path(folder)))
