"""Latent-MoE runtime: config, checkpoint I/O, reference math, TP sharding, tails, runner.

This package never imports Ray. Its top-level names load on first use: importing a light
submodule (``moe_runtime.config``, ``moe_runtime.units``) does not import torch with the math.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"LatentMoEConfig": ".config", "moe_forward": ".layer", "TailPlan": ".tp.plan",
          "resolve_tail": ".tp.plan"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)
