"""Names and units every part shares: dtypes by name, bytes for people, layer ranges.

Units: GB is 10**9 bytes throughout (an MI300X is sold as 192 GB of HBM3).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GB = 10**9
# Every compute dtype by its config/spec name (the name of its torch dtype), with its size in
# bytes; a deployment serves the SERVED_DTYPES subset. Names, not torch dtypes: processes that
# only check or route (the HTTP ingress, the app builder) need no torch.
DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
SERVED_DTYPES = ("float32", "bfloat16")
MXFP4, DENSE = "mxfp4", "dense"  # how a layer's routed experts are stored
EXPERT_FORMATS = (MXFP4, DENSE)


def _known(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, _known(name))


def dtype_bytes(name: str) -> int:
    return DTYPES[_known(name)]


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
