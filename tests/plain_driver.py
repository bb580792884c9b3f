"""A user's driver in its own Ray job, against an app that `serve run` serves in another process
(tests/test_plain_deployment.py runs it): cohorts of 1 and 4 AttentionWorker actors and sessions
of 1 and 4 peer tasks joined by ticket, each stepped ``steps`` times over every served layer,
every answer compared bit for bit with the Serve path's forward of the same concatenated rows;
then a session whose peers step on while a rank of the one replica is SIGKILLed (``survive``).
Prints one JSON line of counts; exits non-zero on the first mismatch or error.

    python tests/plain_driver.py STEPS
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import ray

from deployments.client import AttentionWorker, MoEClient, join

ROWS = 4  # per peer and layer, as in the report
SHARED_STEPS = 100
# Shared sessions: rank 0 may run one session's rows in one forward with another's and the Serve
# path's; a different batch moves fp32 results by a few ulps (1.2e-6 measured on the tiny layer).
TOL = 1e-5
RECOVERY_S = 240.0  # Serve replacing the one replica (health checks, then a new group) on 2 cores


def rows(seed: int, hidden: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS, hidden)).astype(np.float32)


class Fixed(AttentionWorker):
    """Sends the same rows every layer of every step and keeps what comes back."""

    def __init__(self, seed: int, hidden: int):
        self.x, self.got = rows(seed, hidden), {}

    def start(self, step_input):
        self.got = {}

    def attend(self, layer):
        return self.x

    def absorb(self, layer, moe_out_TH):
        self.got[layer] = moe_out_TH.copy()

    def finish(self):
        return self.got

    def abort(self):
        self.got = {}


@ray.remote(num_cpus=0)
def peer(ticket, index: int, steps: int, layers: list[int], hidden: int, want: dict, tol: float = 0.0) -> int:
    """Peer ``index`` of a session in a process of its own: ``steps`` steps, checked (``tol`` 0:
    bit for bit)."""
    x = rows(index, hidden)
    with join(ticket, index) as p:
        for step in range(steps):
            for layer in layers:
                got = p.forward(x, layer)
                if not np.allclose(got, want[layer][index], rtol=tol, atol=tol) or \
                        (tol == 0 and not np.array_equal(got, want[layer][index])):
                    raise AssertionError(f"peer {index}, step {step}, layer {layer}: not the Serve path's rows")
    return steps


def rayless_peer(ticket, index: int, hidden: int, want: dict) -> subprocess.Popen:
    """Peer ``index`` in a process that never imports Ray (tests/rayless_peer.py)."""
    here = Path(__file__).resolve()
    proc = subprocess.Popen([sys.executable, str(here.with_name("rayless_peer.py")), str(index), str(SHARED_STEPS)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=here.parents[1])
    given = {"ticket": ticket.to_json(), "rows": rows(index, hidden).tolist(),
             "want": {layer: w[index].tolist() for layer, w in want.items()}}
    proc.stdin.write(json.dumps(given))
    proc.stdin.close()
    return proc


def own_counts(client: MoEClient, name: str) -> tuple[dict, list[str]]:
    """The session ``name``'s counts as the replica reports them now, and every open session's name."""
    sessions = client.status()["deployments"]["moe"]["sessions"]["open"]
    (mine,) = [s for s in sessions if s["client"] == name]
    return {"forwards": mine["forwards"], "rows": mine["rows"]}, sorted(s["client"] for s in sessions)


def shared(client: MoEClient, layers: list[int], hidden: int) -> dict:
    """Two 2-peer sessions stepping at once on the one replica (one's peers Ray tasks, the other's
    processes without Ray), a third session stepped here whose status is read mid-session, and
    Serve-path requests back to back the whole time: every answer checked, none may fail."""
    batch = np.concatenate([rows(i, hidden) for i in range(2)])
    want = {layer: np.split(client.forward(batch, layer), 2) for layer in layers}
    serve = {"calls": 0, "errors": []}
    stop = threading.Event()

    def serve_loop() -> None:
        while not stop.is_set():
            try:
                got = client.forward(batch, layers[0])
                if not np.allclose(got, np.concatenate(want[layers[0]]), rtol=TOL, atol=TOL):
                    raise AssertionError("a Serve-path answer is not the Serve path's rows")
                serve["calls"] += 1
            except Exception as e:  # reported below: the run fails on any
                serve["errors"].append(repr(e))

    loop = threading.Thread(target=serve_loop)
    loop.start()
    try:
        with client.session(peers=2, max_tokens=ROWS, name="shared-a") as a, \
                client.session(peers=2, max_tokens=ROWS, name="shared-b") as b, \
                client.session(peers=1, max_tokens=ROWS, name="counted") as c:
            tasks = [peer.remote(a.ticket, i, SHARED_STEPS, layers, hidden, want, TOL) for i in range(2)]
            procs = [rayless_peer(b.ticket, i, hidden, want) for i in range(2)]
            mid, opened = [], []
            with join(c.ticket, 0) as counted:
                for n in (7, 5):  # status read between its steps equals what it sent
                    for _ in range(n):
                        for layer in layers:
                            counted.forward(rows(0, hidden), layer)
                    counts, names = own_counts(client, "counted")
                    mid.append(counts)
                    opened = opened or names
            done_a = ray.get(tasks, timeout=600)
            printed = [p.stdout.read() for p in procs]  # each prints one line as it ends
            if any(p.wait(timeout=600) for p in procs):
                raise AssertionError(f"a Ray-less peer failed: {[p.returncode for p in procs]}")
            outs = [json.loads(text.strip().splitlines()[-1]) for text in printed]
    finally:
        stop.set()
        loop.join()
    expect = [{"forwards": k * len(layers), "rows": k * len(layers) * ROWS} for k in (7, 12)]
    if mid != expect:
        raise AssertionError(f"status mid-session {mid}, the session's own counts {expect}")
    return {"steps_a": done_a, "steps_b": [o["steps"] for o in outs],
            "rayless": not any(o["ray_imported"] for o in outs), "open_at_once": opened,
            "serve_calls": serve["calls"] > 0, "serve_errors": serve["errors"]}


def survive(client: MoEClient, layers: list[int], hidden: int, folder: Path) -> dict:
    """A rank of the one replica SIGKILLed while a session's 4 peers step (2 Ray-less processes, 2
    threads of this Ray job): every peer waits while Serve replaces the replica, moves to its new
    group by itself and steps on, with no error and the Serve path's rows."""
    import os
    import signal

    from deployments.common.workers import WORKER_NAMESPACE, worker_name
    from scripts.session_peers import Stepping

    x = rows(9, hidden)
    want = {layer: client.forward(x, layer) for layer in layers}
    with client.session(peers=4, max_tokens=ROWS, name="surviving") as session:
        peers = Stepping(session.ticket, 2, x, want, folder)
        try:
            peers.steps_again(3, RECOVERY_S)
            replica = session.groups()["moe"].replica
            rank1 = ray.get_actor(worker_name("moe", replica, 1), namespace=WORKER_NAMESPACE)
            os.kill(ray.get(rank1.info.remote(), timeout=60)["pid"], signal.SIGKILL)
            pause_s = peers.steps_again(3, RECOVERY_S)
            # read while the session is on: its peers' leaving at the end ends it (a strict session)
            moved = session.groups()["moe"].replica != replica
        finally:
            reports = peers.finish(RECOVERY_S)
    return {"errors": [e for r in reports for e in r["errors"]], "moved": moved,
            "every_peer_moved": all(r["moves"] for r in reports),
            "within_tol": all(r["worst"] is not None and r["worst"] <= TOL for r in reports),
            "rayless": not any(r.get("ray_imported") for r in reports[:2]), "pause_s": round(pause_s, 1)}


def main() -> None:
    steps = int(sys.argv[1])
    ray.init(address="auto", namespace="lms-plain-driver", log_to_driver=False)
    client = MoEClient("default", timeout_s=60)
    layers = sorted({x for ls in client.layer_routes().layers.values() for x in ls})
    hidden = client.status()["deployments"]["moe"]["workers"][0]["hidden_size"]
    report = {}
    for m in (1, 4):
        batch = np.concatenate([rows(i, hidden) for i in range(m)])
        want = {layer: np.split(client.forward(batch, layer), m) for layer in layers}
        workers = [ray.remote(Fixed).options(num_cpus=0).remote(i, hidden) for i in range(m)]
        with client.cohort(workers, max_tokens=ROWS, name=f"plain-cohort-{m}") as cohort:
            for step in range(steps):
                got = cohort.step([step] * m)
                for i in range(m):
                    for layer in layers:
                        if not np.array_equal(got[i][layer], want[layer][i]):
                            raise AssertionError(f"cohort of {m}, worker {i}, step {step}, layer {layer}")
            status = cohort.status()
        report[f"cohort_{m}"] = {k: status[k] for k in ("steps", "session_steps", "serve_steps", "reruns")}
        for w in workers:
            ray.kill(w)
        with client.session(peers=m, max_tokens=ROWS, name=f"plain-session-{m}") as session:
            done = ray.get([peer.remote(session.ticket, i, steps, layers, hidden, want) for i in range(m)],
                           timeout=600)
            paths = {d: s["path"] for d, s in session.status()["deployments"].items()}
        report[f"session_{m}"] = {"steps": done, "paths": paths}
    report["shared"] = shared(client, layers, hidden)
    with tempfile.TemporaryDirectory() as folder:
        report["survive"] = survive(client, layers, hidden, Path(folder))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
