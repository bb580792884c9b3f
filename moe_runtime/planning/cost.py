"""Time estimates before anything runs: the replica start bound and the warm-up's cost.

Deliberately slow device figures, so an estimate errs long.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..config import LatentMoEConfig
from ..units import GB, MXFP4, dtype_bytes

if TYPE_CHECKING:  # the plan's module loads the weights' (torch): this one stays light for config.timeouts
    from .memory import MemoryPlan

# Startup (moe_runtime never reads faster than storage allows): a TP group's ranks read their
# slices at the same time from the node's storage; 0.25 GB/s is a slow network filesystem (local
# NVMe is ~10x faster), so derived bounds are generous rather than tight.
ASSUMED_READ_BYTES_PER_S = 0.25 * GB
STARTUP_FLOOR_S = 900.0
ASSUMED_DEVICE_SPEED = {  # (bytes/s of memory traffic, FLOP/s)
    "cpu": (1.0 * GB, 2.0e10),
    "gpu": (1.0e12, 1.0e14),
}


def startup_timeout_s(plan: MemoryPlan | None) -> float:
    """Replica start bound: the group's bytes read from the checkpoint (every rank reads its slices
    from the same node's storage) at ``ASSUMED_READ_BYTES_PER_S``, at least ``STARTUP_FLOOR_S``."""
    if plan is None:
        return STARTUP_FLOOR_S
    read = plan.read_bytes * plan.tp_size
    return max(STARTUP_FLOOR_S, math.ceil(read / ASSUMED_READ_BYTES_PER_S))


def forward_cost_s(plan: MemoryPlan, cfg: LatentMoEConfig, tokens: int, device: str) -> float:
    """A deliberately pessimistic estimate of one forward of one layer on one rank.

    Memory traffic: the layer's non-expert weights, plus the experts ``tokens`` are expected to
    activate (a fraction ``1 - (1 - K/E)^T`` of them); packed experts also count their decoded
    copy written and read once. FLOPs: ``2 T`` times (router E H + projections 2 D H + routed
    K x 3 I_l D + shared 3 S_l H). Speeds: ``ASSUMED_DEVICE_SPEED[device]``.
    """
    bandwidth, flops = ASSUMED_DEVICE_SPEED[device]
    layer = plan.layers[0]
    parts = plan.per_layer[layer]
    E, K = cfg.num_experts, cfg.num_experts_per_token
    active = 1.0 - (1.0 - K / E) ** tokens
    experts = parts["experts_packed"] + parts["experts_dense"]
    if plan.formats[layer] == MXFP4:
        decoded = E * 3 * (cfg.moe_intermediate_size // plan.tp_size) * cfg.routed_expert_hidden_size
        experts += 2 * decoded * dtype_bytes(plan.dtype)
    others = sum(parts.values()) - parts["experts_packed"] - parts["experts_dense"] - parts["experts_backend"]
    traffic = others + active * experts
    H, D = cfg.hidden_size, cfg.routed_expert_hidden_size
    I_l, S_l = cfg.moe_intermediate_size // plan.tp_size, cfg.shared_intermediate_size // plan.tp_size
    work = 2 * tokens * (E * H + 2 * D * H + K * 3 * I_l * D + 3 * S_l * H)
    return traffic / bandwidth + work / flops


def bounded_token_counts(
    token_counts: Sequence[int], cost_s: Any, calls_per_count: int, budget_s: float
) -> tuple[list[int], float]:
    """The ascending prefix of ``token_counts`` whose estimated measurement time
    (``calls_per_count x cost_s(T)`` summed) fits ``budget_s``, and that estimate."""
    kept, total = [], 0.0
    for T in sorted(token_counts):
        step = calls_per_count * cost_s(T)
        if total + step > budget_s:
            break
        kept.append(T)
        total += step
    return kept, total
