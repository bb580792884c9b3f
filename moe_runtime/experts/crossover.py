"""Where a CPU GEMM path starts to beat another, measured on this machine (issue 48).

The fused MXFP4 kernel (and the bf16 GEMV kernel beside it) is memory-bound for a few rows and
compute-bound soon after; torch's GEMM (oneDNN: AMX tiles where the CPU has AMX-BF16, AVX512-BF16
or AVX-512/AVX2 otherwise) costs more per call but computes far faster. Where the two cross
depends on the CPU, its memory and the shapes, so it is measured, once per shape and thread
count, the first time a path choice is needed (at load for the experts: ``TorchExperts.prepare``).

``measure`` times both paths at growing row counts and answers the smallest count from which
the second one wins at every larger count measured, by ``MARGIN``: switching paths changes the
order of fp32 additions (results move within the rounding bound), so it only switches where the
gain is clear of timing noise on a shared machine.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..logs import log_once

logger = logging.getLogger("moe_runtime")

COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # rows per call tried
MARGIN = 1.15  # the second path must be this much faster to be chosen (see the module doc)
# Calls per path and count, in turns, the fastest kept: at least REPS, and short calls until
# MIN_SECONDS of them (a call of a few microseconds that another process interrupts takes
# milliseconds; the minimum of many does not see it), at most MAX_REPS.
REPS, MIN_SECONDS, MAX_REPS = 3, 2e-3, 64


@dataclass(frozen=True)
class Crossover:
    """``rows``: the smallest row count served by the second path (None: never); ``timings``:
    ``(rows, first s, second s)`` per count measured."""

    rows: int | None
    timings: tuple[tuple[int, float, float], ...]

    def uses_second(self, rows: int) -> bool:
        return self.rows is not None and rows >= self.rows

    def describe(self, first: str, second: str) -> str:
        if not self.timings:
            return f"{first} at every row count (not measured)"
        where = "never" if self.rows is None else f"from {self.rows} rows"
        detail = ", ".join(f"{m}: {a * 1e3:.3g}/{b * 1e3:.3g} ms" for m, a, b in self.timings)
        return f"{second} {where} (measured {first}/{second} by rows: {detail})"


NEVER = Crossover(None, ())


def _seconds(fn: Callable[[int], object], rows: int) -> float:
    start = time.perf_counter()
    fn(rows)
    return time.perf_counter() - start


def measure(first: Callable[[int], object], second: Callable[[int], object],
            counts: tuple[int, ...] = COUNTS) -> Crossover:
    """Time ``first(rows)`` and ``second(rows)`` (each called once untimed, then in turns as
    ``REPS`` .. ``MAX_REPS`` say) at every count: a win of the second path at some count stands
    only if it wins at every larger one too (one disturbed timing cannot move the choice down)."""
    timings = []
    for rows in counts:
        first(rows), second(rows)  # warm-up: page faults, oneDNN's kernel generation
        a, b, spent, calls = float("inf"), float("inf"), 0.0, 0
        while calls < REPS or (spent < MIN_SECONDS and calls < MAX_REPS):
            ta, tb = _seconds(first, rows), _seconds(second, rows)
            a, b, spent, calls = min(a, ta), min(b, tb), spent + ta + tb, calls + 1
        timings.append((rows, a, b))
    rows = None
    for m, a, b in reversed(timings):
        if a <= MARGIN * b:
            break
        rows = m
    return Crossover(rows, tuple(timings))


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_amx() -> bool:
    """True where the CPU has AMX-BF16 tiles (and the kernel lets this process use them)."""
    return {"amx_bf16", "amx_tile"} <= cpu_flags()


def native_bf16() -> bool:
    """True where the CPU multiplies bf16 itself (AMX-BF16 or AVX512-BF16), so torch's bf16 GEMM
    is fast; without, oneDNN widens bf16 to fp32 first (~5 GFLOP/s on the AVX2 machines measured)."""
    return has_amx() or "avx512_bf16" in cpu_flags()


def gemm_engine() -> str:
    """What torch's bf16 GEMM runs on here, in words (logged once where a path is chosen)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if has_amx():
        return f"AMX-BF16 tiles (oneDNN; torch CPU capability {cap})"
    why = "no amx_bf16/amx_tile in /proc/cpuinfo"
    if "avx512_bf16" in cpu_flags():
        return f"AVX512-BF16, not AMX ({why}; torch CPU capability {cap})"
    return f"no native bf16 ({why}, no avx512_bf16; torch CPU capability {cap})"


def log_engine() -> None:
    log_once(f"CPU GEMMs: torch's bf16 GEMM runs on {gemm_engine()}", logger)
