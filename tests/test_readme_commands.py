"""Every command of README.md's fenced ```bash blocks runs as written, or is listed in ``SKIP``
with the reason it cannot run here.

The commands run in README order in one temporary folder that mirrors the repository (``scripts``
and ``deployments`` linked in), so ``checkpoints/tiny`` and the other paths the README writes land
in that folder: the README's own ``make_checkpoint.py --preset tiny`` makes the checkpoint the later
commands use. A new README command is run too; one that cannot finish within ``TIMEOUT_S`` here
fails until it is added to ``SKIP`` with its reason, and a ``SKIP`` entry no longer in the README
fails as stale.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60  # "under a minute": anything slower belongs in SKIP (a hang bound, not a benchmark)

# Command (as the README writes it, continuation lines joined, trailing comment dropped) -> why
# it is not run here.
SKIP = {
    "scripts/run.sh": "starts local Ray and the Serve app (minutes); tests/test_serve.py covers the same",
    "scripts/test.sh": "the whole suite: this test is part of it",
    "python scripts/make_checkpoint.py --preset small --out checkpoints/small":
        "benchmark size (~120 MB), slow on a 2-core CI machine; the writer is tested on tiny/medium",
    "python scripts/make_checkpoint.py --preset medium --out checkpoints/medium --mxfp4":
        "benchmark size (~25 MB per layer x all layers); tests/test_packed.py writes medium itself",
    "serve run deployments.app:build_app checkpoint=checkpoints/tiny tp_size=2 tail=sharded dtype=float32":
        "long-running server (serves until Ctrl-C); tests/test_serve_cli.py runs serve run",
    "serve run deployments/configs/local.yaml": "long-running server (serves until Ctrl-C)",
    "ray up cluster.yaml -y": "needs the Azure subscription and the MI300X cluster",
    "ray attach cluster.yaml": "needs the launched cluster",
    "serve run deployments/configs/mi300x.yaml": "needs the MI300X cluster (and serves until Ctrl-C)",
    'curl -s -H "Authorization: Bearer $LMS_HTTP_TOKEN" http://127.0.0.1:8000/v1/status | python -m json.tool':
        "needs a running server with a token",
    "python scripts/afd_demo.py":
        "starts local Ray and two TP-2 deployments (minutes on 2 cores); tests/test_afd.py covers it",
    "df -h /work && free -g": "a look at this machine's disk and memory before the real-size demo",
    "python scripts/make_checkpoint.py --preset kimi-k3 --mxfp4 --moe-layers 1 --out /work/ckpt/k3-1layer":
        "real size: ~16 GB written in ~20 min",
    "python -m moe_runtime forward --checkpoint /work/ckpt/k3-1layer --layer 1 --tp 2 --dtype bfloat16 "
    "--random-input 4 --output out.safetensors": "real size: needs the 16 GB checkpoint",
    "python scripts/bench_real.py --checkpoint /work/ckpt/k3-1layer": "real size: benchmark of minutes",
    "python scripts/bench_real.py --checkpoint /work/ckpt/k3-1layer --tp 2 --lone-rank":
        "real size: benchmark of minutes",
    "serve run deployments.app:build_app checkpoint=/work/ckpt/k3-1layer tp_size=2 dtype=bfloat16 layers=1 "
    "tail=sharded auto_tune_tokens=none max_tokens_per_request=64 max_batch_tokens=64":
        "real size, long-running server",
}

# What a command that runs must leave behind or print (beyond exit status 0), where it matters.
EXPECT = {
    "python scripts/make_checkpoint.py --preset tiny --out checkpoints/tiny": ("file", "checkpoints/tiny/config.json"),
    "python -m moe_runtime forward --checkpoint checkpoints/tiny --layer 1 --random-input 4 --output out.safetensors":
        ("stdout", "layer 1: 4 tokens x 128"),
    "python -m moe_runtime forward --checkpoint checkpoints/tiny --layer 1 --random-input 4 --output out.safetensors "
    "--dtype bfloat16 --tp 2 --tail sharded": ("stdout", "TP 2"),
    "python -m moe_runtime plan --checkpoint checkpoints/k3 --experts-format mxfp4 --tp 8 --device-memory-gb 192 "
    "--max-tokens 16384": ("stdout", "3 groups of 30/31 layers (1-31, 32-62, 63-92)"),
}


def readme_commands(text: str) -> list[str]:
    """Each command of the ```bash blocks: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"^[ \t]*```bash\n(.*?)^[ \t]*```", text, flags=re.S | re.M):
        current = ""
        for raw in block.splitlines():
            line = raw.strip()
            if not current and (not line or line.startswith("#")):
                continue
            if line.endswith("\\"):
                current += line[:-1].rstrip() + " "
                continue
            command = re.sub(r"\s+#.*$", "", current + line).strip()  # a trailing "# comment"
            commands.append(re.sub(r"\s+", " ", command))
            current = ""
    return commands


COMMANDS = readme_commands((ROOT / "README.md").read_text())


def test_the_skip_list_is_current_and_every_command_is_seen():
    assert len(COMMANDS) > 10  # the extraction finds the README's commands
    stale = sorted(set(SKIP) - set(COMMANDS))
    assert not stale, f"SKIP lists commands the README no longer has: {stale}"
    assert set(EXPECT) <= set(COMMANDS) - set(SKIP), "EXPECT names commands that do not run"
    assert all(reason.strip() for reason in SKIP.values())
    assert "python scripts/make_checkpoint.py --preset tiny --out checkpoints/tiny" in COMMANDS


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder that looks like the repository root to the README's commands."""
    d = tmp_path_factory.mktemp("readme")
    for name in ("scripts", "deployments", "cluster.yaml"):
        (d / name).symlink_to(ROOT / name)
    return d


RUN = [c for c in COMMANDS if c not in SKIP]


@pytest.mark.slow
@pytest.mark.parametrize("command", RUN, ids=[c[:60] for c in RUN])
def test_readme_command_runs_as_written(workdir, command):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT)}
    try:
        run = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README command did not finish within {TIMEOUT_S} s: make it cheaper or add it to SKIP "
                    f"with the reason: {command}")
    assert run.returncode == 0, f"README command failed ({run.returncode}): {command}\n{run.stdout}\n{run.stderr}"
    kind, what = EXPECT.get(command, (None, None))
    if kind == "file":
        assert (workdir / what).is_file(), (command, what)
    elif kind == "stdout":
        assert what in run.stdout, (command, run.stdout)
