"""What determines a measured tail plan, as one key (pure: reads files, no Ray).

A plan measured at warm-up depends on the checkpoint (its config and weight files), the layers
timed, the TP size, the dtype, where the ranks compute, the experts backend and activation
quantisation, the tails and token counts measured, the clock, and the code that runs the
forward. Replicas with the same key reuse one stored measurement (``serve.tuning.tune_group``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from ..config.resolve import ResolvedDeployment
from .accelerator import Accelerator

RUNTIME_ROOT = Path(__file__).resolve().parents[2] / "moe_runtime"


@functools.cache
def code_version() -> str:
    """A hash of the runtime's source (every ``moe_runtime`` module): new code, new key."""
    digest = hashlib.sha256()
    for path in sorted(RUNTIME_ROOT.rglob("*.py")):
        digest.update(str(path.relative_to(RUNTIME_ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def checkpoint_identity(checkpoint: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json hash and its weight files' names, sizes and mtimes."""
    root = Path(checkpoint)
    files = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    return {
        "path": str(root.resolve()),
        "config_sha256": hashlib.sha256((root / "config.json").read_bytes()).hexdigest(),
        "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files if p.name != "config.json"],
    }


def plan_key_fields(resolved: ResolvedDeployment, accelerator: Accelerator, candidates: tuple[str, ...],
                    token_counts: tuple[int, ...], reps: int, clock: str | None) -> dict[str, Any]:
    spec = resolved.spec
    return {
        "checkpoint": checkpoint_identity(resolved.checkpoint),
        "layers": list(resolved.layers),
        "tp_size": spec.tp_size,
        "dtype": spec.dtype,
        "compute": accelerator.compute,
        "backend": spec.backend,
        "experts_activation_quant": spec.experts_activation_quant,
        "preshard_up_proj": spec.preshard_up_proj,
        "tails": list(candidates),
        "token_counts": list(token_counts),
        "reps": reps,
        "clock": clock,
        "code": code_version(),
    }


def plan_key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
