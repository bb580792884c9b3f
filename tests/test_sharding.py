"""The sharding table (DESIGN §4) and TPShard's span arithmetic."""

from __future__ import annotations

import itertools
import re

import pytest

from moe_runtime.tp.sharding import SHARDING_TABLE, Split, TPShard, check_tp_size


def raises(*fragments: str):
    return pytest.raises(ValueError, match=".*".join(re.escape(f) for f in fragments))


# DESIGN §4, row by row: Wg, b, Wdown, gamma replicated; w13 rows along I; w2 columns along I;
# Wsg, Wsu rows along Is; Wsd columns along Is; Wup replicated or pre-sharded by rows.
DESIGN_TABLE = {
    "gate.weight": Split.REPLICATE,
    "gate.e_score_correction_bias": Split.REPLICATE,
    "routed_expert_down_proj.weight": Split.REPLICATE,
    "routed_expert_norm.weight": Split.REPLICATE,
    "routed_expert_up_proj.weight": Split.REPLICATE,
    "w1": Split.ROWS,
    "w3": Split.ROWS,
    "w2": Split.COLS,
    "shared_experts.gate_proj.weight": Split.ROWS,
    "shared_experts.up_proj.weight": Split.ROWS,
    "shared_experts.down_proj.weight": Split.COLS,
}


def test_table_is_the_design_table() -> None:
    assert SHARDING_TABLE == DESIGN_TABLE


@pytest.mark.parametrize("preshard", [False, True])
def test_placement(preshard: bool) -> None:
    shard = TPShard(1, 4, preshard)
    for key, split in DESIGN_TABLE.items():
        expected = Split.ROWS if preshard and key == "routed_expert_up_proj.weight" else split
        assert shard.placement(key) is expected, key


def test_preshard_changes_only_wup() -> None:
    plain, pre = TPShard(0, 2), TPShard(0, 2, preshard_up_proj=True)
    differ = [k for k in DESIGN_TABLE if plain.placement(k) is not pre.placement(k)]
    assert differ == ["routed_expert_up_proj.weight"]


def test_unknown_key_is_not_silently_replicated() -> None:
    with pytest.raises(KeyError):
        TPShard().placement("experts.0.w1.weight")  # the table keys strip "experts.{e}." and ".weight"


@pytest.mark.parametrize("world, size", [
    (world, size) for world in (1, 2, 3, 4, 8) for size in (24, 64, 3072) if size % world == 0
])
def test_spans_tile_the_dimension(world: int, size: int) -> None:
    spans = [TPShard(r, world).span(size, "dim") for r in range(world)]
    assert spans[0][0] == 0 and spans[-1][1] == size
    for (_, stop), (start, _) in itertools.pairwise(spans):
        assert stop == start
    assert {stop - start for start, stop in spans} == {size // world}


def test_span_values() -> None:
    assert TPShard(0, 1).span(64, "I") == (0, 64)
    assert TPShard(0, 2).span(64, "I") == (0, 32)
    assert TPShard(1, 2).span(64, "I") == (32, 64)
    assert TPShard(3, 4).span(3072, "I") == (2304, 3072)
    assert TPShard(5, 8).span(7168, "H") == (4480, 5376)


@pytest.mark.parametrize("rank, world, size, remainder", [(0, 3, 64, 1), (2, 3, 64, 1), (1, 4, 130, 2), (0, 8, 12, 4)])
def test_span_not_divisible_names_the_arithmetic(rank: int, world: int, size: int, remainder: int) -> None:
    with raises(f"dim 1 of w2 = {size} cannot be split across TP size {world}: {size} % {world} = {remainder}"):
        TPShard(rank, world).span(size, "dim 1 of w2")


@pytest.mark.parametrize("rank, world, fragment", [
    (0, 0, "TP size must be >= 1, got 0"),
    (0, -2, "TP size must be >= 1, got -2"),
    (2, 2, "rank 2 is outside the TP group 0..1"),
    (-1, 4, "rank -1 is outside the TP group 0..3"),
])
def test_shard_validation(rank: int, world: int, fragment: str) -> None:
    with raises(fragment):
        TPShard(rank, world)


def test_defaults_are_a_single_device() -> None:
    shard = TPShard()
    assert (shard.rank, shard.world, shard.preshard_up_proj) == (0, 1, False)
    assert shard.span(7, "anything") == (0, 7)


# -- check_tp_size: every split dimension must divide ----------------------------------------


def test_check_tp_size_accepts_divisors() -> None:
    for tp in (1, 2, 4, 8):
        check_tp_size(tp, 3072, 6144, 7168)
    check_tp_size(3, 96, 96)  # H not pre-sharded: H % P is not asked
    check_tp_size(4, 64, 0)  # no shared experts: nothing to split


@pytest.mark.parametrize("args, fragment", [
    ((0, 64, 64), "TP size must be a positive integer, got 0"),
    ((-2, 64, 64), "TP size must be a positive integer, got -2"),
    ((True, 64, 64), "TP size must be a positive integer, got True"),
    ((2.0, 64, 64), "TP size must be a positive integer, got 2.0"),
    ((3, 64, 96), "TP size 3 does not divide moe_intermediate_size 64: 64 % 3 = 1"),
    ((3, 96, 64), "TP size 3 does not divide shared intermediate size 64: 64 % 3 = 1"),
    ((4, 64, 64, 130), "TP size 4 does not divide hidden_size (pre-sharded Wup) 130: 130 % 4 = 2"),
])
def test_check_tp_size_errors(args: tuple, fragment: str) -> None:
    with raises(fragment):
        check_tp_size(*args)
