"""Sessions survive: 4 peers (2 Ray-less processes, 2 threads of this Ray process) step a strict
session on 2 replicas of TP 2 while faults are injected one after another -- a rank SIGKILLed, a
rank SIGSTOPped, a `serve deploy` of a changed config (every replica replaced), a scale-down from
2 replicas to 1. Every peer moves to a healthy group by itself and keeps stepping: 0 errors, 0
wrong outputs. Outputs are compared with the Serve path's forward of the same rows (tolerance:
``moving_peer.TOL``, a different batch composition moves fp32 results by a few ulps).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import ray
from conftest import TEST_APP
from moving_peer import TOL
from ray import serve
from waiting import wait_until

from deployments.app import build_app
from deployments.client import MoEClient, SessionError
from deployments.common.workers import WORKER_NAMESPACE, worker_name

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
APP, PREFIX = "moves_test", "/moves"
PEERS, RAYLESS = 4, 2
# A fault's recovery: the group's bound, then Serve replacing a replica (its workers, shards and
# warm-up) on a 2-core machine with the peers stepping; the peers' own bound is SESSION_MOVE_S.
RECOVERY_S = 240.0
STEPS_AFTER = 3  # steps every peer takes after a fault before the next


def app_args(tiny_ckpt: Path, replicas: int, batch_wait_timeout_s: float = 0.01) -> dict:
    return {"checkpoint": str(tiny_ckpt), **TEST_APP, "tp_size": 2, "collective_timeout_s": 5.0,
            "call_margin_s": 5.0, "health_check_period_s": 1.0, "graceful_shutdown_timeout_s": 1.0,
            "deployments": [{"name": "decode", "dtype": "float32", "num_replicas": replicas,
                             "batch_wait_timeout_s": batch_wait_timeout_s}]}


@pytest.fixture(scope="module")
def app(tiny_ckpt, serve_ports):
    serve.run(build_app(app_args(tiny_ckpt, 2)), name=APP, route_prefix=PREFIX)
    yield MoEClient(APP, timeout_s=60.0)
    serve.delete(APP)


class ThreadPeer:
    """A peer stepping on a thread of this process until stopped; counts, errors, worst diff."""

    def __init__(self, ticket, index: int, x: np.ndarray, want: dict[int, np.ndarray]):
        self.peer = ticket.join(index)
        self.steps, self.worst, self.errors = 0, 0.0, []
        self.stop: int | None = None  # the step to stop after (every peer stops at the same one)
        self.thread = threading.Thread(target=self._run, args=(ticket.layers, x, want), daemon=True)
        self.thread.start()

    def _run(self, layers, x, want) -> None:
        while self.stop is None or self.steps < self.stop:
            try:
                for layer in layers:
                    self.worst = max(self.worst, float(np.abs(self.peer.forward(x, layer) - want[layer]).max()))
            except Exception as e:
                self.errors.append(f"{type(e).__name__}: {e}")
                return
            self.steps += 1


def rank_pid(replica: str, rank: int) -> int:
    actor = ray.get_actor(worker_name("decode", replica, rank), namespace=WORKER_NAMESPACE)
    return ray.get(actor.info.remote(), timeout=30)["pid"]


def test_peers_move_through_rank_loss_redeploy_and_scale_down(app, tiny_ckpt, tmp_path):
    x = np.random.default_rng(3).standard_normal((2, 128), dtype=np.float32)
    session = app.session(peers=PEERS, max_tokens=4, name="moving")
    ticket = session.ticket
    assert ticket.url.endswith(PREFIX) and ticket.secret, ticket.url
    want = {layer: app.forward(x, layer) for layer in ticket.layers}
    stop = tmp_path / "stop"
    given = json.dumps({"ticket": ticket.to_json(), "rows": x.tolist(),
                        "want": {str(k): v.tolist() for k, v in want.items()}})
    procs, progress = [], [tmp_path / f"progress-{i}" for i in range(RAYLESS)]
    for i in range(RAYLESS):
        p = subprocess.Popen([sys.executable, str(ROOT / "tests/moving_peer.py"), str(i), str(stop),
                              str(progress[i])], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        p.stdin.write(given)
        p.stdin.close()
        p.stdin = None  # given whole: communicate() below only reads
        procs.append(p)
    threads = [ThreadPeer(ticket, i, x, want) for i in range(RAYLESS, PEERS)]
    stopped: list[int] = []

    def counts() -> list[int]:
        done = [int(f.read_text() or 0) if f.exists() else 0 for f in progress]
        return done + [t.steps for t in threads]

    def steps_again(what: str) -> None:
        base = counts()
        wait_until(lambda: all(n >= b + STEPS_AFTER for n, b in zip(counts(), base, strict=True))
                   or any(t.errors for t in threads) or any(p.poll() is not None for p in procs),
                   RECOVERY_S, lambda: f"every peer stepping again after {what}: {base} -> {counts()}")
        assert not any(t.errors for t in threads), [t.errors for t in threads]
        assert all(p.poll() is None for p in procs), [p.stderr.read()[-2000:] for p in procs if p.poll()]

    try:
        steps_again("the start")
        first = session.groups()["decode"].replica
        os.kill(rank_pid(first, 1), signal.SIGKILL)
        steps_again("a rank's SIGKILL")
        second = session.groups()["decode"].replica
        assert second != first
        stopped.append(rank_pid(second, 1))
        os.kill(stopped[-1], signal.SIGSTOP)
        steps_again("a rank's SIGSTOP")
        assert session.groups()["decode"].replica != second
        serve.run(build_app(app_args(tiny_ckpt, 2, batch_wait_timeout_s=0.02)), name=APP, route_prefix=PREFIX)
        steps_again("a serve deploy of a changed config")
        serve.run(build_app(app_args(tiny_ckpt, 1, batch_wait_timeout_s=0.02)), name=APP, route_prefix=PREFIX)
        steps_again("a scale-down to 1 replica")
    finally:
        last = max(counts()) + 2  # a step every peer still takes: none leaves the others waiting
        for t in threads:
            t.stop = last
        (tmp_path / "stop.part").write_text(str(last))
        (tmp_path / "stop.part").replace(stop)  # a peer reads the whole number or no file
        for t in threads:
            t.thread.join(timeout=RECOVERY_S)
        reports = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
        for pid in stopped:  # a stopped rank its replica did not end yet
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
    for r in reports:
        assert r["errors"] == [] and r["worst"] <= TOL and not r["ray_imported"], r
        assert len(r["moves"]) >= 2, r  # the SIGKILL's and the SIGSTOP's at least
    for t in threads:
        assert t.errors == [] and t.worst <= TOL and len(t.peer.moves) >= 2, (t.errors, t.worst, t.peer.moves)
    print("moves of peer 0:", reports[0]["moves"])
    session.close()
    with pytest.raises(SessionError):
        threads[0].peer.forward(x, ticket.layers[0])
