"""Tail choice without a process group: the reference runner's shardability rule (full truth
table), legal tails, resolve_tail, and TailPlan validation and lookup."""

from __future__ import annotations

import itertools
import re

import pytest

from moe_runtime.config import LatentMoEConfig
from moe_runtime.synthetic import preset_config
from moe_runtime.tp.plan import (
    TAILS,
    Shardability,
    TailPlan,
    TailTier,
    legal_tails,
    resolve_tail,
    shardability_for,
    sharded_tail_shardability,
)

BASE_TAILS = ("replicated", "overlap", "single_allreduce")


def cfg(**overrides) -> LatentMoEConfig:
    """The tiny preset: H = 128, I = Is = 64, one shared expert."""
    return LatentMoEConfig.from_dict(preset_config("tiny", **overrides))


def raises(*fragments: str):
    """pytest.raises(ValueError) whose message holds every fragment, in order."""
    return pytest.raises(ValueError, match=".*".join(re.escape(f) for f in fragments))


# -- the rule: the ROCm runner's expression, verbatim, as the oracle --------------------------


def rocm_tail_shardable(up_proj_rows, tp_size, preshard, shared_experts, is_sequence_parallel, scaling):
    """``ROCmLatentMoERunner.__init__``'s ``_tail_shardable`` (shared/reference), with
    ``up_proj.weight.shape[0]`` as ``up_proj_rows`` (None: no up-projection)."""
    return (
        up_proj_rows is not None
        and tp_size > 1
        and (preshard or up_proj_rows % tp_size == 0)
        and shared_experts is not None
        and not is_sequence_parallel
        and scaling == 1.0
    )


def expected_reason_fragments(has_up, tp, rows, preshard, shared, sp, scaling) -> list[str]:
    """One fragment per failed condition, each judged on its own, in the reference's order."""
    failed = []
    if not has_up:
        failed.append("no routed up-projection")
    if tp <= 1:
        failed.append(f"TP size is {tp}")
    if not preshard and rows % tp:
        failed.append(f"{rows} rows do not divide by TP size {tp} ({rows} % {tp} = {rows % tp})")
    if not shared:
        failed.append("no shared experts")
    if sp:
        failed.append("sequence-parallel")
    if scaling != 1.0:
        failed.append(f"scaling factor is {scaling}, not 1.0")
    return failed


TRUTH_TABLE = list(itertools.product(
    (True, False),  # has_up_proj
    (1, 4),  # tp_size
    (128, 130),  # up_proj_rows: 130 % 4 = 2
    (False, True),  # preshard_up_proj
    (True, False),  # has_shared_experts
    (False, True),  # sequence_parallel
    (1.0, 2.5),  # runner_scaling_factor
))


@pytest.mark.parametrize(
    "has_up, tp, rows, preshard, shared, sp, scaling",
    TRUTH_TABLE,
    ids=[f"up{int(c[0])}-P{c[1]}-H{c[2]}-pre{int(c[3])}-sh{int(c[4])}-sp{int(c[5])}-s{c[6]}" for c in TRUTH_TABLE],
)
def test_truth_table_mirrors_the_reference(has_up, tp, rows, preshard, shared, sp, scaling) -> None:
    got = sharded_tail_shardability(
        has_up_proj=has_up, tp_size=tp, up_proj_rows=rows, preshard_up_proj=preshard,
        has_shared_experts=shared, sequence_parallel=sp, runner_scaling_factor=scaling,
    )
    assert got.shardable == rocm_tail_shardable(
        rows if has_up else None, tp, preshard, object() if shared else None, sp, scaling
    )
    fragments = expected_reason_fragments(has_up, tp, rows, preshard, shared, sp, scaling)
    assert len(got.reasons) == len(fragments), got.reasons
    for reason, fragment in zip(got.reasons, fragments, strict=True):
        assert fragment in reason
    assert got.shardable == (not got.reasons)
    if got.shardable:
        assert "legal" in got.reason
    else:
        assert got.reason == "; ".join(got.reasons)


LEGAL = dict(has_up_proj=True, tp_size=4, up_proj_rows=128, preshard_up_proj=False,
             has_shared_experts=True, sequence_parallel=False, runner_scaling_factor=1.0)


@pytest.mark.parametrize("change, fragment", [
    (dict(has_up_proj=False), "the layer has no routed up-projection"),
    (dict(tp_size=1), "TP size is 1: there is nothing to shard"),
    (dict(up_proj_rows=130), "Wup is not pre-sharded and its 130 rows do not divide by TP size 4 (130 % 4 = 2)"),
    (dict(has_shared_experts=False), "there are no shared experts (num_shared_experts = 0)"),
    (dict(sequence_parallel=True), "the deployment is sequence-parallel"),
    (dict(runner_scaling_factor=2.5), "the runner-visible routed scaling factor is 2.5, not 1.0"),
], ids=["no_up_proj", "P1", "H_mod_P", "no_shared", "SP", "scaling"])
def test_each_condition_alone_fails(change: dict, fragment: str) -> None:
    assert sharded_tail_shardability(**LEGAL).shardable
    got = sharded_tail_shardability(**{**LEGAL, **change})
    assert not got.shardable and len(got.reasons) == 1 and got.reason == got.reasons[0]
    assert got.reason.startswith(fragment)


def test_preshard_makes_h_mod_p_irrelevant() -> None:
    """As in the reference: a pre-sharded Wup already holds its rows, so H % P is not asked."""
    got = sharded_tail_shardability(**{**LEGAL, "up_proj_rows": 130, "preshard_up_proj": True})
    assert got == Shardability(True, ())


def test_several_failures_list_every_reason() -> None:
    got = sharded_tail_shardability(
        has_up_proj=True, tp_size=4, up_proj_rows=130, preshard_up_proj=False,
        has_shared_experts=False, sequence_parallel=True, runner_scaling_factor=0.5,
    )
    assert not got.shardable and len(got.reasons) == 4
    assert re.fullmatch(r"[^;]*130 % 4 = 2\)?; [^;]*no shared experts[^;]*; [^;]*sequence-parallel; [^;]*0\.5, not 1\.0",
                        got.reason), got.reason


def test_tp_size_zero_fails_without_dividing_by_it() -> None:
    got = sharded_tail_shardability(**{**LEGAL, "tp_size": 0})
    assert got.reasons == ("TP size is 0: there is nothing to shard",)


def test_rule_on_a_config() -> None:
    assert shardability_for(cfg(), 4).shardable
    assert shardability_for(cfg(), 1).reasons == ("TP size is 1: there is nothing to shard",)
    # Our router folds routed_scaling_factor into the top-k weights (as K3 does): the runner
    # sees 1.0, so a config factor of 2.5 does not block the sharded tail.
    assert shardability_for(cfg(routed_scaling_factor=2.5), 4).shardable
    assert "no shared experts" in shardability_for(cfg(num_shared_experts=0), 4).reason
    assert "128 % 3 = 2" in shardability_for(cfg(), 3).reason
    assert shardability_for(cfg(), 3, preshard_up_proj=True).shardable
    assert shardability_for(cfg(), 4, sequence_parallel=True).reasons == ("the deployment is sequence-parallel",)


# -- legal tails -------------------------------------------------------------------------------


def test_legal_tails() -> None:
    assert legal_tails(cfg(), 4) == ("sharded", *BASE_TAILS)
    assert legal_tails(cfg(), 1) == BASE_TAILS
    assert legal_tails(cfg(num_shared_experts=0), 4) == BASE_TAILS
    assert legal_tails(cfg(hidden_size=130), 4) == BASE_TAILS
    assert legal_tails(cfg(), 4, sequence_parallel=True) == ("sequence_parallel",)


def test_legal_tails_with_preshard_is_sharded_only() -> None:
    """A pre-sharded Wup holds H / P rows: every other tail needs all H of them."""
    assert legal_tails(cfg(), 4, preshard_up_proj=True) == ("sharded",)


# -- resolve_tail -------------------------------------------------------------------------------


def test_auto_picks_sharded_when_legal() -> None:
    plan = resolve_tail("auto", cfg(), 4)
    assert plan.tails == ("sharded",) and plan.reason.startswith("auto: ") and "legal" in plan.reason
    assert resolve_tail("auto", cfg(routed_scaling_factor=2.5), 2).tails == ("sharded",)
    assert resolve_tail("auto", cfg(), 4, preshard_up_proj=True).tails == ("sharded",)


@pytest.mark.parametrize("config, tp, fragment", [
    (dict(), 1, "TP size is 1: there is nothing to shard"),
    (dict(num_shared_experts=0), 4, "no shared experts"),
    (dict(hidden_size=130), 4, "130 % 4 = 2"),
], ids=["P1", "no_shared", "H_mod_P"])
def test_auto_falls_back_to_replicated_and_says_why(config: dict, tp: int, fragment: str) -> None:
    plan = resolve_tail("auto", cfg(**config), tp)
    assert plan.tails == ("replicated",)
    assert plan.reason.startswith("auto: falling back to replicated because ") and fragment in plan.reason
    with raises("tail 'sharded' is illegal here: ", fragment):
        resolve_tail("sharded", cfg(**config), tp)


@pytest.mark.parametrize("tail", ("sharded", *BASE_TAILS))
def test_forced_legal_tails(tail: str) -> None:
    plan = resolve_tail(tail, cfg(), 4)
    assert plan.tiers == (TailTier(None, tail),)
    assert plan.tail_for(1) == plan.tail_for(10**6) == tail


@pytest.mark.parametrize("tail", BASE_TAILS)
def test_forced_non_sharded_tails_are_legal_anywhere(tail: str) -> None:
    assert resolve_tail(tail, cfg(num_shared_experts=0), 1).tails == (tail,)


def test_sequence_parallel() -> None:
    plan = resolve_tail("auto", cfg(), 4, sequence_parallel=True)
    assert plan.tails == ("sequence_parallel",)
    for tail in ("sharded", *BASE_TAILS):
        with raises(f"tail {tail!r} cannot run sequence-parallel", "use tail 'auto'"):
            resolve_tail(tail, cfg(), 4, sequence_parallel=True)
    with raises("pre-sharded Wup needs the sharded tail, which sequence parallelism excludes"):
        resolve_tail("auto", cfg(), 4, preshard_up_proj=True, sequence_parallel=True)


@pytest.mark.parametrize("requested", ["fast", "sequence_parallel", "", "Sharded"])
def test_unknown_requested_tail(requested: str) -> None:
    with raises(f"unknown tail {requested!r}; expected one of ('auto',"):
        resolve_tail(requested, cfg(), 2)


def test_preshard_errors() -> None:
    with raises("hidden_size (pre-sharded Wup) 130: 130 % 4 = 2"):
        resolve_tail("sharded", cfg(hidden_size=130), 4, preshard_up_proj=True)
    with raises("Wup is pre-sharded but the sharded tail is illegal: ", "no shared experts"):
        resolve_tail("auto", cfg(num_shared_experts=0), 4, preshard_up_proj=True)
    with raises("Wup is pre-sharded but the sharded tail is illegal: TP size is 1"):
        resolve_tail("sharded", cfg(), 1, preshard_up_proj=True)
    for tail in BASE_TAILS:
        with raises(f"tail {tail!r} needs the full Wup on every rank; it is pre-sharded"):
            resolve_tail(tail, cfg(), 4, preshard_up_proj=True)


@pytest.mark.parametrize("tp, fragment", [
    (0, "TP size must be a positive integer, got 0"),
    (True, "TP size must be a positive integer, got True"),
    (3, "moe_intermediate_size 64: 64 % 3 = 1"),
])
def test_tp_size_must_split_the_intermediate_dims(tp, fragment: str) -> None:
    with raises(fragment):
        resolve_tail("replicated", cfg(), tp)


# -- TailPlan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiers, fragment", [
    ((), "a tail plan needs at least one tier"),
    ((TailTier(16, "overlap"),), "only the last tier may be unbounded, got bounds [16]"),
    ((TailTier(None, "overlap"), TailTier(None, "sharded")), "only the last tier may be unbounded, got bounds [None, None]"),
    ((TailTier(None, "overlap"), TailTier(16, "sharded")), "only the last tier may be unbounded"),
    ((TailTier(32, "overlap"), TailTier(16, "overlap"), TailTier(None, "sharded")), "strictly ascending, got [32, 16, None]"),
    ((TailTier(16, "overlap"), TailTier(16, "overlap"), TailTier(None, "sharded")), "strictly ascending, got [16, 16, None]"),
    ((TailTier(0, "overlap"), TailTier(None, "sharded")), "positive and strictly ascending, got [0, None]"),
    ((TailTier(-4, "overlap"), TailTier(None, "sharded")), "positive and strictly ascending"),
    ((TailTier(None, "fast"),), "unknown tail 'fast'; expected one of ('replicated',"),
    ((TailTier(8, "auto"), TailTier(None, "sharded")), "unknown tail 'auto'"),
], ids=["empty", "last_bounded", "two_unbounded", "unbounded_first", "descending", "equal", "zero", "negative",
        "unknown", "auto_is_not_a_tail"])
def test_tail_plan_validation(tiers: tuple, fragment: str) -> None:
    with raises(fragment):
        TailPlan(tiers, "test")


def test_every_tail_may_be_planned() -> None:
    for tail in TAILS:
        assert TailPlan.single(tail, "r").tails == (tail,)


def test_tail_for_at_the_boundaries() -> None:
    plan = TailPlan(
        (TailTier(1, "single_allreduce"), TailTier(16, "overlap"), TailTier(None, "sharded")), "measured"
    )
    assert [plan.tail_for(T) for T in (1, 2, 15, 16, 17, 10**9)] == [
        "single_allreduce", "overlap", "overlap", "overlap", "sharded", "sharded"
    ]
    assert plan.tails == ("single_allreduce", "overlap", "sharded")
    assert plan.describe() == (
        "T in [1, 1] -> single_allreduce; T in [2, 16] -> overlap; T in [17, inf] -> sharded"
    )


def test_tails_deduplicate_in_order() -> None:
    plan = TailPlan((TailTier(8, "overlap"), TailTier(64, "sharded"), TailTier(None, "overlap")), "t")
    assert plan.tails == ("overlap", "sharded")
    assert [plan.tail_for(T) for T in (8, 9, 64, 65)] == ["overlap", "sharded", "sharded", "overlap"]


def test_to_dict_and_equality() -> None:
    a = TailPlan((TailTier(16, "overlap"), TailTier(None, "sharded")), "measured",
                 timings_ms={"overlap": {16: 0.5}})
    assert a.to_dict() == {
        "tiers": [{"max_tokens": 16, "tail": "overlap"}, {"max_tokens": None, "tail": "sharded"}],
        "reason": "measured",
        "describe": "T in [1, 16] -> overlap; T in [17, inf] -> sharded",
        "timings_ms": {"overlap": {16: 0.5}},
    }
    # Timings are evidence, not identity: two plans with the same tiers and reason are equal.
    assert a == TailPlan(a.tiers, "measured")
