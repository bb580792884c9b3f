"""Measure each legal tail on a live runner (``plan.plan_from_timings`` turns the timings into a
per-range plan).

Every rank of a TP group must call ``time_tails`` with the same arguments (the tails run
collectives). The plan is built from one rank's timings (rank 0's, by convention) so all
ranks agree; the caller distributes it.
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .plan import Clock, TailPlan, Timings
from .runner import LatentMoERunner


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


# -- what a TP rank runs at warm-up (the Serve workers call these; no Ray here) ----------------


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
                timings[tail][T] = time_tails(runner, [T], [tail], reps, tick)[tail][T]
    return timings


def apply_plan(runners: Mapping[int, LatentMoERunner], plan: TailPlan) -> None:
    """Every served layer's runner adopts ``plan`` (raises if a tail is illegal there)."""
    for runner in runners.values():
        runner.set_plan(plan)
