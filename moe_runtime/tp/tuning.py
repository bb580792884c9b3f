"""Measure each legal tail on a live runner and turn the timings into a per-range plan.

Every rank of a TP group must call ``time_tails`` with the same arguments (the tails run
collectives). The plan is built from one rank's timings (rank 0's, by convention) so all
ranks agree; the caller distributes it.
"""

from __future__ import annotations

import contextvars
import importlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .plan import TailPlan, TailTier
from .runner import LatentMoERunner

Clock = Callable[[], float]
Timings = dict[str, dict[int, float]]

_measuring: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "moe_tail_measurement", default=None
)


def time_tails(
    runner: LatentMoERunner,
    token_counts: Sequence[int],
    tails: Sequence[str] | None = None,
    reps: int = 3,
    clock: Clock = time.perf_counter,
    seed: int = 0,
) -> dict[str, dict[int, float]]:
    """Median milliseconds of a whole forward for each tail at each token count."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    tails = list(tails or runner.legal_tails)
    gen = torch.Generator().manual_seed(seed)
    dtype, device = runner.w.dtype, runner.device
    timings: dict[str, dict[int, float]] = {tail: {} for tail in tails}
    for T in token_counts:
        x = torch.randn(T, runner.cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
        for tail in tails:
            runner.forward(x, tail=tail)  # warm-up: allocator, thread pools
            samples = []
            for _ in range(reps):
                runner.timer.sync()
                start = clock()
                runner.forward(x, tail=tail)
                runner.timer.sync()
                samples.append((clock() - start) * 1e3)
            timings[tail][T] = statistics.median(samples)
    return timings


def plan_from_timings(timings: dict[str, dict[int, float]], reason: str = "measured") -> TailPlan:
    """Keep the fastest tail per measured token count; neighbouring winners merge.

    A tier ends at the largest measured token count its tail won; batches between two
    measured counts take the tier of the smaller one's upper neighbour.
    """
    if not timings or not any(timings.values()):
        raise ValueError("no timings to build a tail plan from")
    counts = sorted({T for per_tail in timings.values() for T in per_tail})
    missing = [(tail, T) for tail, per_tail in timings.items() for T in counts if T not in per_tail]
    if missing:
        raise ValueError(f"every tail needs a timing at every token count; missing {missing}")
    winners = [min(timings, key=lambda tail, T=T: (timings[tail][T], tail)) for T in counts]
    tiers: list[TailTier] = []
    for T, tail in zip(counts, winners, strict=True):
        if tiers and tiers[-1].tail == tail:
            tiers[-1] = TailTier(T, tail)
        else:
            tiers.append(TailTier(T, tail))
    tiers[-1] = TailTier(None, tiers[-1].tail)
    summary = ", ".join(
        f"T={T}: {tail} {timings[tail][T]:.2f} ms" for T, tail in zip(counts, winners, strict=True)
    )
    return TailPlan(tuple(tiers), f"{reason}: fastest per token count ({summary})", timings)


# -- what a TP rank runs at warm-up (the Serve workers call these; no Ray here) ----------------


def current_measurement() -> tuple[str, int] | None:
    """``(tail, tokens)`` while :func:`measure_runners` times that pair, else None (fake clocks)."""
    return _measuring.get()


def resolve_clock(path: str | None) -> Clock:
    """``"module:callable"`` -> the callable (a zero-argument clock in seconds)."""
    if path is None:
        return time.perf_counter
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"tune_clock must look like 'module:callable', got {path!r}")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"tune_clock {path!r} cannot be imported: {e}") from None
    if not callable(obj):
        raise ValueError(f"tune_clock {path!r} is not callable")
    return obj


def measure_runners(runners: Mapping[int, LatentMoERunner], token_counts: Sequence[int], reps: int,
                    clock: str | None, tails: Sequence[str]) -> Timings:
    """Time ``tails`` at every token count on this rank (every rank of the group calls this with
    the same arguments). ``runners``: layer -> runner; the lowest layer is timed for all."""
    if not runners:
        raise ValueError("no runners to measure")
    runner = runners[min(runners)]
    tick = resolve_clock(clock)
    timings: Timings = {tail: {} for tail in tails}
    with torch.inference_mode():
        for T in token_counts:
            for tail in tails:
                token = _measuring.set((tail, T))
                try:
                    timings[tail][T] = time_tails(runner, [T], [tail], reps, tick)[tail][T]
                finally:
                    _measuring.reset(token)
    return timings


def apply_plan(runners: Mapping[int, LatentMoERunner], plan: TailPlan) -> None:
    """Every served layer's runner adopts ``plan`` (raises if a tail is illegal there)."""
    for runner in runners.values():
        runner.set_plan(plan)
