"""Packaging audit: a fresh virtualenv, `pip install .` without extras, and everything the README and
docs/*.md tell users to import or run works from the installed package.

The venv has no access to this one's site-packages (``venv`` without
``--system-site-packages``) and runs from outside the repository, so only what `pip install .`
put there can be imported. torch comes first, from the spec ``scripts/env.sh`` uses
(``LMS_TORCH`` / ``LMS_TORCH_INDEX``, by default the 2.13.0 CPU wheel pip finds on this
machine's disk), as a user on a CPU machine would install it; the rest comes from the
project's own dependency list. Slow (~3 min on a busy 2-core machine: it installs Ray and torch).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("deployments", "moe_runtime")
INSTALL_TIMEOUT_S = 600


def readme_imports() -> tuple[set[str], set[str]]:
    """Modules the README and docs/*.md import (``from X import`` / ``import X``) and run
    (``python -m X``, ``serve run X:attr``), restricted to this project's packages."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    project = "|".join(PACKAGES)
    imported = set(re.findall(rf"^\s*(?:from|import)\s+((?:{project})[\w.]*)", text, re.M))
    imported |= set(re.findall(rf"serve run\s+((?:{project})[\w.]*):\w+", text))
    run = set(re.findall(rf"python -m\s+((?:{project})[\w.]*)", text))
    return imported, run


@pytest.mark.slow
@pytest.mark.packaging
def test_pip_install_without_extras_gives_every_readme_import(tmp_path: Path) -> None:
    imported, run = readme_imports()
    # The documented entry points, so that a rewrite of the docs cannot make this test vacuous.
    assert {"deployments.client", "deployments.app"} <= imported and "moe_runtime" in run
    env_dir = tmp_path / "venv"
    # No pip of its own (installing one and its first run cost ~12 s here): this environment's pip
    # installs into it (--python).
    venv.create(env_dir, with_pip=False, system_site_packages=False)
    python = env_dir / "bin" / "python"
    torch_spec = os.environ.get("LMS_TORCH", "torch==2.13.0")
    index = os.environ.get("LMS_TORCH_INDEX")
    # One resolution: torch as env.sh picks it, the project without extras and not editable
    # (only what its wheel ships). --no-compile: byte-compiling torch and Ray is most of the time.
    args = [torch_spec, str(ROOT), *(["--extra-index-url", index] if index else [])]
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    proc = subprocess.run([*pip, "install", "-q", "--no-compile", *args], capture_output=True, text=True,
                          timeout=INSTALL_TIMEOUT_S)
    assert proc.returncode == 0, f"pip install {' '.join(args)} failed:\n{proc.stderr[-3000:]}"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    check = "\n".join([
        "import importlib, importlib.util, pathlib, sys",
        f"for name in {sorted(imported)!r}:",
        "    module = importlib.import_module(name)",
        "    assert 'site-packages' in module.__file__, (name, module.__file__)",
        # The `test` extra stays out of a plain install.
        "assert importlib.util.find_spec('pytest') is None and importlib.util.find_spec('matplotlib') is None",
        "print('ok')",
    ])
    proc = subprocess.run([str(python), "-c", check], cwd=outside, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    for module in sorted(run):
        proc = subprocess.run([str(python), "-m", module, "--help"], cwd=outside, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, f"python -m {module} --help:\n{proc.stderr[-2000:]}"
    # The packaged configs for `serve run` ship with the wheel.
    configs = subprocess.run(
        [str(python), "-c", "import deployments, pathlib; print(sorted(p.name for p in "
                            "(pathlib.Path(deployments.__file__).parent / 'configs').glob('*.yaml')))"],
        cwd=outside, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert "local.yaml" in configs.stdout and "mi300x.yaml" in configs.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
