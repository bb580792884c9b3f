"""Latent-MoE runtime: config, checkpoint I/O, reference math, TP sharding, tails, runner.

This package never imports Ray.
"""

from .config import LatentMoEConfig
from .layer import moe_forward
from .tp.plan import TailPlan, resolve_tail

__all__ = ["LatentMoEConfig", "TailPlan", "moe_forward", "resolve_tail"]
