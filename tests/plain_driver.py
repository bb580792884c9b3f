"""A user's driver in its own Ray job, against an app that `serve run` serves in another process
(tests/test_plain_deployment.py runs it): cohorts of 1 and 4 AttentionWorker actors and sessions
of 1 and 4 peer tasks joined by ticket, each stepped ``steps`` times over every served layer,
every answer compared bit for bit with the Serve path's forward of the same concatenated rows.
Prints one JSON line of counts; exits non-zero on the first mismatch or error.

    python tests/plain_driver.py STEPS
"""

from __future__ import annotations

import json
import sys

import numpy as np
import ray

from deployments.client import AttentionWorker, MoEClient, join

ROWS = 4  # per peer and layer, as in the report


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
def peer(ticket, index: int, steps: int, layers: list[int], hidden: int, want: dict) -> int:
    """Peer ``index`` of a session in a process of its own: ``steps`` steps, checked."""
    x = rows(index, hidden)
    with join(ticket, index) as p:
        for step in range(steps):
            for layer in layers:
                got = p.forward(x, layer)
                if not np.array_equal(got, want[layer][index]):
                    raise AssertionError(f"peer {index}, step {step}, layer {layer}: not the Serve path's rows")
    return steps


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
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
