"""Per-rank memory budgets: a GPU's memory, or a CPU node's memory shared by its ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..units import GB, gb

MI300X_MEMORY_GB = 192.0
DEFAULT_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class Budget:
    """Bytes one rank may use, and where the number comes from."""

    bytes_per_rank: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"bytes_per_rank": self.bytes_per_rank, "source": self.source}


def _check_fraction(memory_fraction: float) -> None:
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")


def gpu_budget(
    device_memory_gb: float = MI300X_MEMORY_GB, memory_fraction: float = DEFAULT_MEMORY_FRACTION
) -> Budget:
    """One GPU per rank: ``device_memory_gb x memory_fraction``."""
    _check_fraction(memory_fraction)
    if not device_memory_gb > 0:
        raise ValueError(f"device_memory_gb must be > 0, got {device_memory_gb}")
    total = int(device_memory_gb * GB * memory_fraction)
    return Budget(total, f"GPU: {device_memory_gb:g} GB x {memory_fraction:g} = {gb(total)} per rank")


def node_memory_bytes() -> int:
    """This node's memory: physical RAM, capped by the cgroup (container) limit when one is set."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def cpu_budget(
    ranks: int, memory_fraction: float = DEFAULT_MEMORY_FRACTION, node_bytes: int | None = None
) -> Budget:
    """Ranks on CPU share their node: ``node memory x memory_fraction / ranks``."""
    _check_fraction(memory_fraction)
    node = node_memory_bytes() if node_bytes is None else node_bytes
    per_rank = int(node * memory_fraction) // ranks
    return Budget(
        per_rank,
        f"CPU: node memory {gb(node)} x {memory_fraction:g} / {ranks} rank(s) = {gb(per_rank)} per rank",
    )
