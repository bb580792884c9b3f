"""Sessions survive: 4 peers (2 Ray-less processes, 2 threads of this Ray process) step a strict
session on 2 replicas of TP 2, and a lane calls beside them, while faults come one after another:
a rank SIGKILLed, a rank SIGSTOPped, a `serve deploy` of a changed config (every replica
replaced), a scale-down from 2 replicas to 1. Every peer moves to a healthy group by itself and
keeps stepping: 0 errors, 0 wrong outputs. Outputs are compared with the Serve path's forward of
the same rows (tolerance ``scripts.session_peers.TOL``: a different batch composition moves fp32
results by a few ulps).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import ray
from conftest import TEST_APP
from ray import serve

from deployments.app import build_app
from deployments.client import MoEClient, SessionError
from deployments.common.workers import WORKER_NAMESPACE, worker_name
from scripts.session_peers import TOL, Stepping

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


def rank_pid(replica: str, rank: int) -> int:
    actor = ray.get_actor(worker_name("decode", replica, rank), namespace=WORKER_NAMESPACE)
    return ray.get(actor.info.remote(), timeout=30)["pid"]


class LaneLoop:
    """A lane calling every layer back to back on a thread until finished: errors, the worst
    difference from the Serve path's rows, its status at the end."""

    def __init__(self, app: MoEClient, x: np.ndarray, want: dict[int, np.ndarray]):
        self.lane = app.lane(max_tokens=4, name="moving-lane")
        self.errors: list[str] = []
        self.worst, self.calls = 0.0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(x, want), daemon=True)
        self.thread.start()

    def _run(self, x: np.ndarray, want: dict[int, np.ndarray]) -> None:
        while not self.stop.is_set():
            for layer, rows in want.items():
                try:
                    self.worst = max(self.worst, float(np.abs(self.lane.forward(x, layer) - rows).max()))
                    self.calls += 1
                except Exception as e:  # counted: the test asserts there are none
                    self.errors.append(f"{type(e).__name__}: {e}")

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join(timeout=RECOVERY_S)
        status = self.lane.status()
        self.lane.close()
        return status


def test_peers_move_through_rank_loss_redeploy_and_scale_down(app, tiny_ckpt, tmp_path):
    x = np.random.default_rng(3).standard_normal((2, 128), dtype=np.float32)
    session = app.session(peers=PEERS, max_tokens=4, name="moving")
    ticket = session.ticket
    assert ticket.url.endswith(PREFIX) and ticket.secret, ticket.url
    want = {layer: app.forward(x, layer) for layer in ticket.layers}
    peers = Stepping(ticket, RAYLESS, x, want, tmp_path)
    lane = LaneLoop(app, x, want)  # a lane (a session of one peer) calling through the same faults
    stopped: list[int] = []
    pauses = {}
    try:
        peers.steps_again(STEPS_AFTER, RECOVERY_S)
        first = session.groups()["decode"].replica
        os.kill(rank_pid(first, 1), signal.SIGKILL)
        pauses["sigkill"] = peers.steps_again(STEPS_AFTER, RECOVERY_S)
        second = session.groups()["decode"].replica
        assert second != first
        stopped.append(rank_pid(second, 1))
        os.kill(stopped[-1], signal.SIGSTOP)
        pauses["sigstop"] = peers.steps_again(STEPS_AFTER, RECOVERY_S)
        assert session.groups()["decode"].replica != second
        serve.run(build_app(app_args(tiny_ckpt, 2, batch_wait_timeout_s=0.02)), name=APP, route_prefix=PREFIX)
        pauses["redeploy"] = peers.steps_again(STEPS_AFTER, RECOVERY_S)
        serve.run(build_app(app_args(tiny_ckpt, 1, batch_wait_timeout_s=0.02)), name=APP, route_prefix=PREFIX)
        pauses["scale_down"] = peers.steps_again(STEPS_AFTER, RECOVERY_S)
    finally:
        reports = peers.finish(RECOVERY_S)
        lane_status = lane.finish()
        for pid in stopped:  # a stopped rank its replica did not end yet
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
    for r in reports:
        assert r["errors"] == [] and r["worst"] <= TOL, r
        assert len(r["moves"]) >= 2, r  # the SIGKILL's and the SIGSTOP's at least
    assert not any(r.get("ray_imported") for r in reports[:RAYLESS]), reports
    decode = lane_status["deployments"]["decode"]
    assert lane.errors == [] and lane.worst <= TOL and lane.calls > 0, (lane.errors[:3], lane.worst)
    assert decode["moves"] >= 1 and decode["serve_calls"] == 0 and decode["reruns"] == 0, decode
    print("pauses:", {k: round(v, 2) for k, v in pauses.items()}, "moves of peer 0:", reports[0]["moves"])
    session.close()
    with pytest.raises(SessionError):
        ticket.join(0).forward(x, ticket.layers[0])
