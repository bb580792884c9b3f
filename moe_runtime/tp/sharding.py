"""The tensor-parallel sharding table (DESIGN §4), declared once and applied at load time.

Every tensor of a MoE layer is either replicated or split along its intermediate dimension
(``I`` for routed experts, ``Is`` for shared experts); ``Wup`` may also be pre-sharded by
rows. Nothing else in the package does rank arithmetic on weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Split(Enum):
    REPLICATE = "replicated"
    ROWS = "rows"  # dim 0 (output features) split across ranks
    COLS = "cols"  # dim 1 (input features) split across ranks


# Suffix after the layer prefix (experts.{e}. stripped) -> placement.
SHARDING_TABLE: dict[str, Split] = {
    "gate.weight": Split.REPLICATE,
    "gate.e_score_correction_bias": Split.REPLICATE,
    "routed_expert_down_proj.weight": Split.REPLICATE,
    "routed_expert_norm.weight": Split.REPLICATE,
    "routed_expert_up_proj.weight": Split.REPLICATE,  # Split.ROWS when pre-sharded
    "w1": Split.ROWS,
    "w3": Split.ROWS,
    "w2": Split.COLS,
    "shared_experts.gate_proj.weight": Split.ROWS,
    "shared_experts.up_proj.weight": Split.ROWS,
    "shared_experts.down_proj.weight": Split.COLS,
}


@dataclass(frozen=True)
class TPShard:
    """This rank's place in a TP group of ``world`` ranks."""

    rank: int = 0
    world: int = 1
    preshard_up_proj: bool = False

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"TP size must be >= 1, got {self.world}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside the TP group 0..{self.world - 1}")

    def placement(self, key: str) -> Split:
        if key == "routed_expert_up_proj.weight" and self.preshard_up_proj:
            return Split.ROWS
        return SHARDING_TABLE[key]

    def span(self, size: int, what: str) -> tuple[int, int]:
        """The ``[start, stop)`` of this rank's equal share of ``size`` elements."""
        if size % self.world:
            raise ValueError(
                f"{what} = {size} cannot be split across TP size {self.world}: "
                f"{size} % {self.world} = {size % self.world}"
            )
        step = size // self.world
        return self.rank * step, (self.rank + 1) * step


def check_tp_size(
    tp_size: int, intermediate_size: int, shared_intermediate_size: int, hidden_size: int | None = None
) -> None:
    """Raise ValueError unless every split dimension divides by ``tp_size``."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"TP size must be a positive integer, got {tp_size!r}")
    dims = {"moe_intermediate_size": intermediate_size, "shared intermediate size": shared_intermediate_size}
    if hidden_size is not None:
        dims["hidden_size (pre-sharded Wup)"] = hidden_size
    for what, size in dims.items():
        if size % tp_size:
            raise ValueError(
                f"TP size {tp_size} does not divide {what} {size}: {size} % {tp_size} = {size % tp_size}"
            )
