"""Names and units every part shares: dtypes by name, bytes for people, layer ranges.

Units: GB is 10**9 bytes throughout (an MI300X is sold as 192 GB of HBM3).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

GB = 10**9
# Every compute dtype by its config/spec name; a deployment serves the SERVED_DTYPES subset.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
SERVED_DTYPES = ("float32", "bfloat16")


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def dtype_bytes(name: str) -> int:
    return torch_dtype(name).itemsize


def gb(n: float) -> str:
    """Bytes for people: GB (1e9) down to MB (1e6) and kB, two decimals."""
    for unit, size in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_layers(layers: Iterable[int]) -> str:
    """Compact ranges: [1, 2, 3, 7] -> "1-3,7"."""
    runs: list[list[int]] = []
    for x in sorted(layers):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
