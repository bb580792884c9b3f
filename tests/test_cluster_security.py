"""No launcher config in the repository exposes the Ray dashboard without token authentication.

The dashboard's Jobs API (port 8265) runs whatever code it is sent. A head started with
``--dashboard-host=0.0.0.0`` (or any non-loopback address) and without Ray's token
authentication (``RAY_AUTH_MODE=token``) hands that to anyone who reaches the port. The shipped
configs bind it to 127.0.0.1; users reach it through ``ray dashboard <config>`` (an SSH port
forward, docs/operations.md).

Every Ray cluster-launcher config found in the repository is checked, so a new one is covered
without touching this file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"checkpoints", "artifacts", "node_modules", "__pycache__"}
LOOPBACK = re.compile(r"^(127(\.\d{1,3}){3}|localhost|::1|\[::1\])$")
DASHBOARD_HOST = re.compile(r"--dashboard-host(?:=|\s+)(['\"]?)([^\s'\";]+)\1")
TOKEN_AUTH = re.compile(r"\bRAY_AUTH_MODE=(['\"]?)token\1(?![\w-])")
DEFAULT_DASHBOARD_HOST = "127.0.0.1"  # what `ray start --head` binds without the flag


def launcher_configs(root: Path = ROOT) -> list[Path]:
    """YAML files under ``root`` that are Ray cluster-launcher configs (a mapping with
    ``cluster_name`` and ``provider``), skipping hidden folders (.venv, .git) and outputs."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith((".yaml", ".yml")):
                continue
            path = Path(folder) / name
            try:
                data = yaml.safe_load(path.read_text())
            except (yaml.YAMLError, UnicodeDecodeError):
                continue
            if isinstance(data, dict) and "cluster_name" in data and "provider" in data:
                found.append(path)
    return found


def _commands(config: dict[str, Any]) -> list[str]:
    return [c for key, cmds in config.items() if key.endswith("_commands") and isinstance(cmds, list)
            for c in cmds if isinstance(c, str)]


def dashboard_exposure(config: dict[str, Any]) -> list[str]:
    """Why the config's head dashboard is reachable from the network without token
    authentication: one line per offending ``ray start --head`` (empty: it is not)."""
    docker = config.get("docker") or {}
    container_env = " ".join(str(o) for key in ("run_options", "head_run_options")
                             for o in docker.get(key) or [])
    problems = []
    for command in _commands(config):
        if not re.search(r"\bray start\b", command) or "--head" not in command:
            continue
        if re.search(r"--include-dashboard(?:=|\s+)(false|False|0)\b", command):
            continue
        hosts = [m.group(2) for m in DASHBOARD_HOST.finditer(command)] or [DEFAULT_DASHBOARD_HOST]
        exposed = [h for h in hosts if not LOOPBACK.match(h)]
        if exposed and not (TOKEN_AUTH.search(command) or TOKEN_AUTH.search(container_env)):
            problems.append(f"dashboard on {exposed[-1]} without RAY_AUTH_MODE=token: {' '.join(command.split())}")
    return problems


def test_the_repository_has_launcher_configs() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in launcher_configs()}
    assert {"cluster.yaml", "cluster.local.yaml"} <= names, names
    assert not {p for p in names if p.startswith("deployments/configs/")}  # Serve configs are not launcher configs


@pytest.mark.parametrize("path", launcher_configs(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_dashboard_reachable_from_the_network_without_token_auth(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    heads = [c for c in _commands(config) if re.search(r"\bray start\b", c) and "--head" in c]
    assert heads, f"{path.name}: no `ray start --head` found, so nothing was checked"
    assert dashboard_exposure(config) == []


HEAD = "ulimit -n 65536; ray start --head --port=6379 {flags} --num-gpus=0"


@pytest.mark.parametrize(("flags", "run_options", "exposed"), [
    ("--dashboard-host=0.0.0.0", [], True),
    ("--dashboard-host 0.0.0.0", [], True),
    ("--dashboard-host='10.0.0.4'", [], True),
    ("--dashboard-host=::", [], True),
    ("--dashboard-host=127.0.0.1", [], False),
    ("--dashboard-host=localhost", [], False),
    ("", [], False),  # Ray's default: loopback
    ("--dashboard-host=0.0.0.0 --include-dashboard=false", [], False),
    ("--dashboard-host=0.0.0.0", ["--env=RAY_AUTH_MODE=token"], False),
    ("--dashboard-host=0.0.0.0", ["--env=RAY_AUTH_MODE=disabled"], True),
    ("--dashboard-host=0.0.0.0", ["--env=RAY_AUTH_MODE=tokens"], True),
])
def test_the_check_itself(flags: str, run_options: list[str], exposed: bool) -> None:
    config = {"cluster_name": "t", "provider": {"type": "local"}, "docker": {"run_options": run_options},
              "head_start_ray_commands": ["ray stop", HEAD.format(flags=flags)]}
    assert bool(dashboard_exposure(config)) is exposed
    token_inline = {**config, "docker": {}, "head_start_ray_commands": [f"RAY_AUTH_MODE=token {HEAD.format(flags=flags)}"]}
    assert dashboard_exposure(token_inline) == []
