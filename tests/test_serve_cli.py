"""Smoke tests of the `serve run` command line: the local config file and the import-path form.

Each test starts `serve run` in a subprocess with RAY_ADDRESS=local, so it starts a local
instance of its own: the local config as a user's CPU machine has it (no GPUs: the accelerator
is CPU), the import path with two logical GPUs through RAY_OVERRIDE_RESOURCES (the GPU layout,
computing on CPU, as after `ray start --head --num-gpus 2`). It then stops it as a user does,
with Ctrl-C (SIGINT, to the process it started, by PID: `serve run` shuts Serve down and its
Ray instance exits with it), and fails if that takes longer than its bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from waiting import wait_until

from deployments.client import HTTPMoEClient, MoEServeError
from moe_runtime.checkpoint import load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import moe_forward
from moe_runtime.tp.collectives import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SERVE = Path(sys.executable).parent / "serve"
# `serve run` stops on SIGINT, but a process started in the background (`cmd &`, as a CI script
# may start the suite) inherits SIGINT ignored, and so would `serve run` (it then ran out the stop
# bound every time): the child restores the default before it becomes `serve run`.
SIGINT_RESTORED = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.argv[1], sys.argv[1:])"]
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def wait_ready(proc: subprocess.Popen, port: int, log: Path) -> HTTPMoEClient:
    """An HTTP client of the app once `serve run` (``proc``) answers /healthz; fails if it exits."""
    http = HTTPMoEClient(f"http://127.0.0.1:{port}", timeout_s=30)

    def ready() -> bool:
        assert proc.poll() is None, f"serve run exited early:\n{log.read_text()[-4000:]}"  # fails at once
        return http.healthz()["ok"]

    wait_until(ready, timeout_s=READY_TIMEOUT_S, every_s=0.5, ignoring=(MoEServeError,),
               what=lambda: f"serve run ready:\n{log.read_text()[-4000:]}")
    return http


def _run_and_check(cmd: list[str], port: int, ckpt: Path, log: Path, gpus: int, measured: bool = False) -> None:
    # RAY_ADDRESS=local: `serve run` starts its own instance, never joins one found on the machine.
    env = {k: v for k, v in os.environ.items() if k != "RAY_OVERRIDE_RESOURCES"}
    env.update(RAY_ADDRESS="local", LMS_HTTP_PORT=str(port))  # the port of the import-path form
    if gpus:
        env["RAY_OVERRIDE_RESOURCES"] = json.dumps({"GPU": gpus})
    with log.open("w") as out:
        proc = subprocess.Popen([*SIGINT_RESTORED, *cmd], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        with wait_ready(proc, port, log) as http:
            status = http.status()["deployments"]["moe"]
            assert status["tp_size"] == 2
            if not gpus and not torch.cuda.is_available():  # auto without GPUs: CPU bundles, gloo
                assert status["controller"]["accelerator"] == "cpu", log.read_text()[-3000:]
                assert "no GPU" in status["controller"]["accelerator_reason"]
                assert [w["device"] for w in status["workers"]] == ["cpu", "cpu"] and status["backend"] == "gloo"
            if measured:  # tail auto: the controller timed the legal tails on the group at warm-up
                decision = status["controller"]
                assert decision["measured"] and decision["requested_tail"] == "auto"
                assert {t["tail"] for t in status["tail_plan"]["tiers"]} <= set(decision["candidates"])
                assert set(decision["timings_ms"]) == set(decision["candidates"])
            else:
                assert status["tail_plan"]["tiers"] == [{"max_tokens": None, "tail": "sharded"}]
            cfg = LatentMoEConfig.from_pretrained(ckpt)
            x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
            ref = moe_forward(x, load_layer_weights(ckpt, cfg, 1), cfg)
            # fp32, TP-2 reduction order only (see tests/test_serve.py)
            torch.testing.assert_close(http.forward(x, 1), ref, rtol=1e-5, atol=1e-5)
        # Ctrl-C: `serve run` shuts Serve and its Ray instance down and exits.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve run still running {STOP_TIMEOUT_S} s after SIGINT:\n{log.read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def local_config(ckpt: Path, folder: Path) -> tuple[Path, int]:
    """deployments/configs/local.yaml serving ``ckpt`` on a free HTTP port: its path and port."""
    config = yaml.safe_load((ROOT / "deployments/configs/local.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["checkpoint"] = str(ckpt)
    path = folder / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


def test_serve_run_local_config_on_a_machine_without_gpus(tiny_ckpt, tmp_path):
    """The README's `serve run deployments/configs/local.yaml` with no Ray running and no GPU:
    it starts its own Ray, accelerator auto picks the CPU, and it serves (it once waited
    forever for GPU bundles)."""
    path, port = local_config(tiny_ckpt, tmp_path)
    _run_and_check([str(SERVE), "run", str(path)], port, tiny_ckpt, tmp_path / "serve.log", gpus=0)


def test_serve_run_import_path(tiny_ckpt, tmp_path):
    # tail=auto: also exercises the controller's warm-up measurement and CLI string coercion.
    cmd = [str(SERVE), "run", "deployments.app:build_app", f"checkpoint={tiny_ckpt}", "tp_size=2",
           "tail=auto", "auto_tune_tokens=1,64", "layers=1-2", "max_batch_tokens=64", "ingress_replicas=1"]
    _run_and_check(cmd, free_port(), tiny_ckpt, tmp_path / "serve.log", gpus=2, measured=True)
