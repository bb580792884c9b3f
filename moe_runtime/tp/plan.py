"""Tail choice: the shardability rule of the reference ROCm runner and per-batch tail plans.

Everything here is pure (no process group), so every decision is unit-testable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import LatentMoEConfig
from .sharding import check_tp_size

# STANDARD_TAIL: a standard (non-latent) MoE layer's one way to finish (``standard.layer``): no choice
STANDARD_TAIL = "standard"
TAILS = ("replicated", "overlap", "sharded", "single_allreduce", "sequence_parallel", STANDARD_TAIL)
REQUESTABLE_TAILS = ("auto", "replicated", "overlap", "sharded", "single_allreduce")
Clock = Callable[[], float]  # a warm-up's clock (seconds)
Timings = dict[str, dict[int, float]]  # tail -> token count -> median ms


@dataclass(frozen=True)
class Shardability:
    shardable: bool
    reasons: tuple[str, ...]  # one entry per failed condition; empty when shardable

    @property
    def reason(self) -> str:
        if self.shardable:
            return "sharded tail is legal: every condition of the reference runner holds"
        return "; ".join(self.reasons)


def sharded_tail_shardability(
    *,
    has_up_proj: bool,
    tp_size: int,
    up_proj_rows: int,
    preshard_up_proj: bool,
    has_shared_experts: bool,
    sequence_parallel: bool,
    runner_scaling_factor: float,
) -> Shardability:
    """The reference runner's six conditions for the column-parallel (sharded) tail.

    ``runner_scaling_factor`` is the factor the runner itself would still have to apply to
    the routed output; our router folds ``routed_scaling_factor`` into the top-k weights,
    as K3 does, so a runner built on it passes 1.0.
    """
    failed = []
    if not has_up_proj:
        failed.append("the layer has no routed up-projection")
    if tp_size <= 1:
        failed.append(f"TP size is {tp_size}: there is nothing to shard")
    if not preshard_up_proj and tp_size > 0 and up_proj_rows % tp_size:
        failed.append(
            f"Wup is not pre-sharded and its {up_proj_rows} rows do not divide by TP size "
            f"{tp_size} ({up_proj_rows} % {tp_size} = {up_proj_rows % tp_size})"
        )
    if not has_shared_experts:
        failed.append(
            "there are no shared experts (num_shared_experts = 0), so there is no shared "
            "partial to fold the up-projection shard into"
        )
    if sequence_parallel:
        failed.append("the deployment is sequence-parallel")
    if runner_scaling_factor != 1.0:
        failed.append(f"the runner-visible routed scaling factor is {runner_scaling_factor}, not 1.0")
    return Shardability(not failed, tuple(failed))


def shardability_for(
    cfg: LatentMoEConfig, tp_size: int, preshard_up_proj: bool = False, sequence_parallel: bool = False
) -> Shardability:
    """The rule applied to a model config (our router applies the scaling factor)."""
    return sharded_tail_shardability(
        has_up_proj=True,
        tp_size=tp_size,
        up_proj_rows=cfg.hidden_size,
        preshard_up_proj=preshard_up_proj,
        has_shared_experts=cfg.num_shared_experts > 0,
        sequence_parallel=sequence_parallel,
        runner_scaling_factor=1.0,
    )


@dataclass(frozen=True)
class TailTier:
    """Use ``tail`` for batches of at most ``max_tokens`` tokens (None: no upper bound)."""

    max_tokens: int | None
    tail: str


@dataclass(frozen=True)
class TailPlan:
    """Token-count ranges mapped to tails, ascending; the last tier has no bound."""

    tiers: tuple[TailTier, ...]
    reason: str
    timings_ms: dict[str, dict[int, float]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("a tail plan needs at least one tier")
        bounds = [t.max_tokens for t in self.tiers]
        if bounds[-1] is not None or any(b is None for b in bounds[:-1]):
            raise ValueError(f"only the last tier may be unbounded, got bounds {bounds}")
        if any(b < 1 for b in bounds[:-1]) or bounds[:-1] != sorted(set(bounds[:-1])):
            raise ValueError(f"tier bounds must be positive and strictly ascending, got {bounds}")
        for tier in self.tiers:
            if tier.tail not in TAILS:
                raise ValueError(f"unknown tail {tier.tail!r}; expected one of {TAILS}")

    @classmethod
    def single(cls, tail: str, reason: str) -> TailPlan:
        return cls((TailTier(None, tail),), reason)

    @property
    def tails(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.tail for t in self.tiers))

    def tail_for(self, num_tokens: int) -> str:
        for tier in self.tiers:
            if tier.max_tokens is None or num_tokens <= tier.max_tokens:
                return tier.tail
        raise AssertionError("unreachable: the last tier is unbounded")

    def describe(self) -> str:
        parts, low = [], 1
        for tier in self.tiers:
            high = "inf" if tier.max_tokens is None else tier.max_tokens
            parts.append(f"T in [{low}, {high}] -> {tier.tail}")
            low = (tier.max_tokens or math.inf) + 1
        return "; ".join(parts)

    @classmethod
    def from_dict(cls, record: dict) -> TailPlan:
        """The plan :meth:`to_dict` wrote (JSON: token counts come back as strings)."""
        tiers = tuple(TailTier(t["max_tokens"], t["tail"]) for t in record["tiers"])
        timings = {tail: {int(T): float(ms) for T, ms in per.items()}
                   for tail, per in record.get("timings_ms", {}).items()}
        return cls(tiers, record["reason"], timings)

    def with_fallback_above(self, max_tokens: int, tail: str, why: str) -> TailPlan:
        """This plan up to ``max_tokens`` tokens, and ``tail`` above (merged when the same)."""
        tiers = [t for t in self.tiers if t.max_tokens is not None and t.max_tokens < max_tokens]
        top = self.tail_for(max_tokens)
        tiers.append(TailTier(max_tokens, top))
        if top == tail:
            tiers[-1] = TailTier(None, tail)
        else:
            tiers.append(TailTier(None, tail))
        reason = f"{self.reason}; above T = {max_tokens}: {tail} ({why})"
        return TailPlan(tuple(tiers), reason, self.timings_ms)

    def to_dict(self) -> dict:
        return {
            "tiers": [{"max_tokens": t.max_tokens, "tail": t.tail} for t in self.tiers],
            "reason": self.reason,
            "describe": self.describe(),
            "timings_ms": {tail: dict(v) for tail, v in self.timings_ms.items()},
        }


def legal_tails(
    cfg: LatentMoEConfig, tp_size: int, preshard_up_proj: bool = False, sequence_parallel: bool = False
) -> tuple[str, ...]:
    """Every tail that may run for this deployment, in order of preference.

    A pre-sharded ``Wup`` leaves each rank only its row block, so only ``sharded`` can run
    (and nothing when the sharded tail is illegal).
    """
    if sequence_parallel:
        return ("sequence_parallel",)
    shardable = shardability_for(cfg, tp_size, preshard_up_proj).shardable
    if preshard_up_proj:
        return ("sharded",) if shardable else ()
    base = ("replicated", "overlap", "single_allreduce")
    return ("sharded", *base) if shardable else base


def check_sequence_parallel_tail(requested: str, sequence_parallel: bool) -> None:
    """Sequence-parallel deployments run the sequence_parallel tail, so they request ``auto``."""
    if sequence_parallel and requested != "auto":
        raise ValueError(
            f"tail {requested!r} cannot run sequence-parallel; sequence-parallel deployments "
            "use tail 'auto' (the sequence_parallel tail)"
        )


def check_preshard(rule: Shardability, preshard_up_proj: bool) -> None:
    """A pre-sharded ``Wup`` leaves each rank only its rows: the sharded tail must be legal."""
    if preshard_up_proj and not rule.shardable:
        raise ValueError(f"Wup is pre-sharded but the sharded tail is illegal: {rule.reason}")


def resolve_tail(
    requested: str,
    cfg: LatentMoEConfig,
    tp_size: int,
    preshard_up_proj: bool = False,
    sequence_parallel: bool = False,
) -> TailPlan:
    """A static plan for a requested tail; ``ValueError`` when it is illegal here.

    ``auto`` without measurements picks ``sharded`` when legal and otherwise falls back to
    ``replicated`` with the rule's reason (the controller refines ``auto`` by timing).
    """
    if requested not in REQUESTABLE_TAILS:
        raise ValueError(f"unknown tail {requested!r}; expected one of {REQUESTABLE_TAILS}")
    check_tp_size(
        tp_size,
        cfg.moe_intermediate_size,
        cfg.shared_intermediate_size,
        cfg.hidden_size if preshard_up_proj else None,
    )
    if preshard_up_proj and sequence_parallel:
        raise ValueError("a pre-sharded Wup needs the sharded tail, which sequence parallelism excludes")
    check_sequence_parallel_tail(requested, sequence_parallel)
    if sequence_parallel:
        return TailPlan.single("sequence_parallel", "sequence_parallel requested: reduce-scatter over tokens")
    rule = shardability_for(cfg, tp_size, preshard_up_proj)
    check_preshard(rule, preshard_up_proj)
    if preshard_up_proj and requested not in ("auto", "sharded"):
        raise ValueError(f"tail {requested!r} needs the full Wup on every rank; it is pre-sharded")
    if requested == "sharded":
        if not rule.shardable:
            raise ValueError(f"tail 'sharded' is illegal here: {rule.reason}")
        return TailPlan.single("sharded", rule.reason)
    if requested == "auto":
        if rule.shardable:
            return TailPlan.single("sharded", f"auto: {rule.reason}")
        return TailPlan.single("replicated", f"auto: falling back to replicated because {rule.reason}")
    return TailPlan.single(requested, f"{requested} requested")


def standard_plan(family: str, tp_size: int) -> TailPlan:
    """The one plan of a standard MoE layer (``moe_runtime.standard``): every rank's routed and
    shared partial sums added by one all-reduce (none at TP 1). It has no latent, so no tail."""
    how = ("one all-reduce of the ranks' partial outputs" if tp_size > 1
           else "TP 1: no collective")
    return TailPlan.single(STANDARD_TAIL, f"{family} MoE layer: one fixed plan ({how}); the latent "
                                          "layer's tails do not apply")


def plan_from_timings(timings: Timings, reason: str = "measured") -> TailPlan:
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
