"""The topology users run: the app under `serve run` in its own process (its own Ray instance),
the client in another Ray job (``ray.init(address="auto")``), stepping cohorts and sessions of 1
and 4 peers 200 times over the data plane (tests/plain_driver.py), then two sessions at once on
the one replica (one's peers Ray-less processes) beside Serve-path requests sent back to back,
with a third session's status read mid-session, then a session stepping on while a rank of the
replica is SIGKILLed (its peers move to the replacement). With Ray Compiled Graphs a one-worker cohort hung
within ~15 steps in exactly this topology.

`serve run` gets a Ray temp dir of its own (RAY_TMPDIR); the driver's "auto" is pointed at that
instance by RAY_ADDRESS (its GCS port is read from that temp dir), never at another one on the
machine (the test process's own, or a parallel test's): "auto" alone picks any. Both use token
authentication with a token of their own (RAY_AUTH_TOKEN), as a cluster started where Ray finds a
token does, without depending on ~/.ray/auth_token.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import plain_driver as driver_module
import pytest
from ray.util import get_node_ip_address
from test_serve_cli import SERVE, SIGINT_RESTORED, STOP_TIMEOUT_S, local_config, wait_ready

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 200
DRIVER_TIMEOUT_S = 600.0


def test_cohorts_and_sessions_step_200_times_from_another_ray_job(tiny_ckpt, tmp_path):
    path, port = local_config(tiny_ckpt, tmp_path)
    ray_tmp = tempfile.mkdtemp(prefix="lms-ray-")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_OVERRIDE_RESOURCES", "RAY_ADDRESS")}
    env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([*SIGINT_RESTORED, str(SERVE), "run", str(path)], cwd=ROOT,
                                  env={**env, "RAY_ADDRESS": "local"}, stdout=out, stderr=subprocess.STDOUT)
    try:
        with wait_ready(server, port, log):
            pass
        (port_file,) = Path(ray_tmp, "ray", "session_latest").glob("gcs_server_port_*")
        gcs = f"{get_node_ip_address()}:{port_file.read_text().strip()}"
        driver = subprocess.run([sys.executable, str(ROOT / "tests/plain_driver.py"), str(STEPS)], cwd=ROOT,
                                env={**env, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": gcs}, capture_output=True,
                                text=True, timeout=DRIVER_TIMEOUT_S)
        assert driver.returncode == 0, f"driver failed:\n{driver.stdout[-3000:]}\n{driver.stderr[-6000:]}"
        report = json.loads(driver.stdout.strip().splitlines()[-1])
        for m in (1, 4):
            cohort = report[f"cohort_{m}"]
            # every step on the data plane, none re-run or sent the Serve way
            assert cohort == {"steps": STEPS, "session_steps": STEPS, "serve_steps": 0, "reruns": 0}, report
            assert report[f"session_{m}"] == {"steps": [STEPS] * m, "paths": {"moe": "session"}}, report
        # two sessions stepping at once on the one replica (Ray tasks and Ray-less processes), a
        # third counted mid-session, Serve-path requests the whole time: all answered, all open
        steps = [driver_module.SHARED_STEPS] * 2
        assert report["shared"] == {"steps_a": steps, "steps_b": steps, "rayless": True, "serve_calls": True,
                                    "open_at_once": ["counted", "shared-a", "shared-b"], "serve_errors": []}, report
        # a rank of the one replica SIGKILLed under a stepping session: the peers pause while Serve
        # replaces the replica, move to its new group by themselves, and step on without an error
        survive = report["survive"]
        assert survive["errors"] == [] and survive["moved"] and survive["every_peer_moved"], survive
        assert survive["within_tol"] and survive["rayless"], survive
        check_the_session_cli(env, gcs, port, tmp_path)
        server.send_signal(signal.SIGINT)
        server.wait(timeout=STOP_TIMEOUT_S)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
        shutil.rmtree(ray_tmp, ignore_errors=True)  # its Ray's session files and logs


def open_sessions(port: int) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=60) as r:
        return json.loads(r.read())["deployments"]["moe"]["sessions"]["open"]


def check_the_session_cli(env: dict, gcs: str, port: int, tmp_path: Path) -> None:
    """`python -m deployments.client session --detach` leaves the session open after it exits,
    `close --ticket` ends it, and a session that cannot be opened exits 2 naming why."""
    cli = [sys.executable, "-m", "deployments.client"]
    run_env = {**env, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": gcs}
    ticket = tmp_path / "ticket.json"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args], cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=300)

    opened = run("session", "--peers", "2", "--ticket", str(ticket), "--detach", "--name", "detached")
    assert opened.returncode == 0 and ticket.is_file(), opened.stderr[-3000:]
    assert [s["client"] for s in open_sessions(port)] == ["detached"]
    closed = run("close", "--ticket", str(ticket))
    assert closed.returncode == 0 and "closed on 1 of 1 group(s)" in closed.stdout, closed.stderr[-3000:]
    assert open_sessions(port) == []
    refused = run("session", "--peers", "256", "--max-tokens", "1000", "--ticket", str(tmp_path / "no.json"))
    assert refused.returncode == 2 and "max_tokens_per_request" in refused.stderr, refused.stderr[-3000:]
    assert not (tmp_path / "no.json").exists()
