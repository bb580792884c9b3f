"""The Python examples of README.md and docs/*.md: each compiles, imports only names the project
has, and runs as written when it needs no server (in a folder whose ``checkpoints/tiny`` is the
tiny checkpoint); the others are listed in ``SKIP`` with the reason. A ``SKIP`` entry no document
has any more fails as stale. (tests/test_readme_commands.py does the same for the bash blocks.)
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROJECT = ("deployments", "moe_runtime", "examples")
TIMEOUT_S = 120

_SERVER = "needs the app running (serve run)"
_RAY = "needs the app running and a Ray job of its own (actors)"
# '<document>: <the example's first line>' -> why it does not run here.
SKIP = {
    "README.md: import numpy as np": _SERVER,
    "README.md: from deployments.client import HTTPMoEClient": _SERVER + ", and x from the example above",
    "README.md: with MoEClient().lane(max_tokens=16) as lane:": _SERVER + ", and x from the first example",
    "README.md: import ray": _RAY,
    "README.md: from deployments.client import MoEClient, join": _SERVER,
    "docs/afd.md: from examples.afd import Decoder, LocalMoE, RemoteMoE": _SERVER + " on checkpoints/tiny-afd",
    "docs/afd.md: import ray": _RAY,
    "docs/operations.md: import os": "needs the cluster of operations.md (deployment layers-01-31, a token)",
    "docs/serving.md: from deployments.client import MoEClient": _SERVER + " (and an event loop: it awaits)",
    "docs/serving.md: from deployments.client import AsyncHTTPMoEClient, HTTPMoEClient": _SERVER,
    "docs/serving.md: with MoEClient(\"default\").lane(max_tokens=16) as lane:": _SERVER,
    "docs/serving.md: import numpy as np": _SERVER + " on checkpoints/qwen3-tiny",
    "docs/serving.md: # the opener: a process of the app's Ray cluster": _SERVER,
    "docs/serving.md: workers = [ray.remote(MyWorker).remote(...) for _ in range(M)]": _RAY + " (MyWorker, M)",
    "docs/vllm.md: from vllm import LLM, SamplingParams": "needs the vLLM lane's venv and a session's ticket",
    'docs/vllm.md: LLM(model=..., additional_config={"latent_moe": {...}},':
        "a fragment of the example above (its scheduler argument); needs the vLLM lane's venv",
}


def examples() -> dict[str, str]:
    """Every ```python block, by '<document>: <its first line>' (without a trailing comment)."""
    found = {}
    for doc in DOCS:
        for block in re.findall(r"^[ \t]*```python\n(.*?)^[ \t]*```", doc.read_text(), flags=re.S | re.M):
            first = re.sub(r"\s+#.*$", "", block.splitlines()[0]).strip()  # its trailing comment dropped
            found[f"{doc.relative_to(ROOT).as_posix()}: {first}"] = block
    return found


EXAMPLES = examples()


def test_the_skip_list_is_current():
    assert len(EXAMPLES) > 10  # the extraction finds the examples
    assert not sorted(set(SKIP) - set(EXAMPLES)), "SKIP lists examples no document has any more"
    assert all(reason.strip() for reason in SKIP.values())


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_compiles_and_imports_what_exists(name: str):
    tree = compile(EXAMPLES[name], name, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PROJECT):
            module = importlib.import_module(node.module)
            assert not [a.name for a in node.names if not hasattr(module, a.name)], node.module


@pytest.mark.parametrize("name", sorted(set(EXAMPLES) - set(SKIP)))
def test_runs_as_written(name: str, tiny_ckpt: Path, tmp_path: Path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "tiny").symlink_to(tiny_ckpt)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", EXAMPLES[name]], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
