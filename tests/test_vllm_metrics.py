"""The vLLM plugin's engine metrics without vLLM (deployments.vllm_plugin.metrics): what a tier
records, the snapshot a worker process publishes, the Prometheus collector and the accessor that
read it in the front end, and which process makes the folder. tests/vllm_lane runs them in vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.vllm_plugin import metrics

ROOT = Path(__file__).resolve().parents[1]

# A worker process: its tier (layers 1, 2) answers 3 calls of 4 rows on layer 1 and 1 of 2 rows on
# layer 2, then it lives on until stdin closes.
WORKER = """
import sys, time
from types import SimpleNamespace
from deployments.vllm_plugin import metrics

class Tier:
    def __init__(self):
        self.stats = metrics.TierStats([1, 2])
    @metrics.recorded
    def forward(self, x, layer):
        time.sleep(0.002 * layer)
        return x

tier = Tier()
metrics.publish(tier.stats)
print("ready", flush=True)
for layer, rows in [(1, 4), (1, 4), (1, 4), (2, 2)]:
    tier.forward(SimpleNamespace(shape=(rows, 8)), layer)
print("done", flush=True)
sys.stdin.read()
"""


def llm(instance_id: str = "") -> SimpleNamespace:
    return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(instance_id=instance_id)))


def test_stats_buckets_and_quantiles():
    stats = metrics.TierStats([3])
    for s in [0.0004, 0.0005, 0.003, 0.2, 20.0]:
        stats.record(3, 2, s)
    (layer,) = stats.snapshot().values()
    assert layer["calls"] == 5 and layer["rows"] == 10 and layer["seconds"] == pytest.approx(20.2039)
    # le is inclusive: 0.0005 lands in the 0.0005 bucket; 20 s beyond the last bound (+Inf).
    assert layer["buckets"][0] == 2 and layer["buckets"][metrics.BUCKETS.index(0.005)] == 1
    assert layer["buckets"][metrics.BUCKETS.index(0.25)] == 1 and layer["buckets"][-1] == 1
    summary = metrics.summary(layer)
    assert summary["p50_ms"] == pytest.approx(3.0) and summary["p99_ms"] == pytest.approx(20000.0)
    assert metrics.summary(metrics.TierStats([1]).snapshot()["1"])["p50_ms"] is None
    for _ in range(metrics.RECENT + 10):
        stats.record(3, 1, 0.001)
    assert len(stats.snapshot()["3"]["recent_us"]) == metrics.RECENT


def test_a_worker_process_snapshot_reaches_the_accessor_and_the_collector(tmp_path, monkeypatch):
    from prometheus_client import CollectorRegistry, generate_latest

    monkeypatch.setenv(metrics.ENV, str(tmp_path))
    monkeypatch.setattr(metrics, "_publisher", None)  # this process holds no tier
    worker = subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline() == "ready\n"
        assert worker.stdout.readline() == "done\n"
        stats = metrics.tier_stats(llm(), timeout_s=20)  # waits for the snapshot written after the calls
        assert {x: (s["calls"], s["rows"]) for x, s in stats.items()} == {1: (3, 12), 2: (1, 2)}
        assert stats[1]["p50_ms"] >= 2 and stats[2]["p99_ms"] >= 4 and stats[1]["seconds"] >= 0.006
        assert metrics.tier_stats(llm("another-engine")) == {}

        registry = CollectorRegistry()
        registry.register(metrics.TierCollector(tmp_path))
        text = generate_latest(registry).decode()
        for line in ['latent_moe_tier_calls_total{layer="1"} 3.0', 'latent_moe_tier_calls_total{layer="2"} 1.0',
                     'latent_moe_tier_rows_total{layer="1"} 12.0', 'latent_moe_tier_call_seconds_count{layer="1"} 3.0',
                     'latent_moe_tier_call_seconds_bucket{layer="1",le="+Inf"} 3.0',
                     'latent_moe_tier_call_seconds_bucket{layer="1",le="0.0005"} 0.0']:
            assert line in text.splitlines(), text
        assert 'latent_moe_tier_call_recent_seconds{layer="2",quantile="0.99"}' in text
    finally:
        worker.stdin.close()
        worker.wait(timeout=30)
    # A process gone is no longer counted (its file stays until the folder's owner exits).
    assert list(tmp_path.glob("*.json")) and metrics.tier_stats(llm()) == {}
    registry = CollectorRegistry()
    registry.register(metrics.TierCollector(tmp_path))
    assert "latent_moe_tier_calls_total{" not in generate_latest(registry).decode()


SETUP = """
import json, multiprocessing, os, sys
from deployments.vllm_plugin import metrics

def child(queue):
    metrics.setup()  # a process started by the front end: its folder
    queue.put(os.environ[metrics.ENV])

if __name__ == "__main__":
    inherited = os.environ.get(metrics.ENV)
    metrics.setup()
    metrics.setup()
    from prometheus_client import REGISTRY
    queue = multiprocessing.get_context("spawn").Queue()
    p = multiprocessing.get_context("spawn").Process(target=child, args=(queue,))
    p.start()
    folder = os.environ[metrics.ENV]
    print(json.dumps({"folder": folder, "inherited": inherited, "child": queue.get(timeout=30),
                      "exists": os.path.isdir(folder),
                      "collectors": sum(isinstance(c, metrics.TierCollector) for c in REGISTRY._collector_to_names)}))
    p.join()
"""


def test_the_front_end_makes_the_folder_and_its_children_use_it(tmp_path):
    """setup(): a process not started by multiprocessing (the OpenAI server, an LLM's process) makes
    its own folder even when its environment names one (an unrelated launcher's), adds one
    collector, and removes the folder at exit; a process it starts keeps its folder."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), metrics.ENV: str(tmp_path / "launcher")}
    script = tmp_path / "front_end.py"  # a file: spawn's child imports its main module
    script.write_text(SETUP)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["folder"] != got["inherited"] and got["child"] == got["folder"]
    assert got["exists"] and got["collectors"] == 1
    assert not Path(got["folder"]).exists()


def test_setup_sweeps_the_folders_of_exited_front_ends(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, live = tmp_path / f"{metrics.PREFIX}{gone.stdout.strip()}-ab12", tmp_path / f"{metrics.PREFIX}{os.getpid()}-cd34"
    for folder in (dead, live, tmp_path / f"{metrics.PREFIX}old"):
        folder.mkdir()
        (folder / "1.json").write_text("{}")
    metrics.sweep(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, f"{metrics.PREFIX}old"])


def test_snapshots_are_written_when_changed_and_touched_otherwise(tmp_path):
    pub = metrics.Publisher(tmp_path)
    stats = metrics.TierStats([1])
    pub.tiers.append(("e", stats))
    pub.write(force=True)
    path = tmp_path / f"{os.getpid()}.json"
    first = path.stat().st_mtime_ns
    time.sleep(0.01)
    pub.write()  # nothing new: the same content, a later time
    assert path.stat().st_mtime_ns > first and not stats.dirty
    stats.record(1, 5, 0.01)
    pub.write()
    (snap,) = metrics.read_snapshots(tmp_path)
    assert snap.engines["e"]["1"]["rows"] == 5 and snap.pid == os.getpid()
