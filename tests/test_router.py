"""router.route (DESIGN §2 step 1): selection by s + b, weights from the unbiased s."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.config import LatentMoEConfig
from moe_runtime.router import route

E, H = 8, 16


def cfg(**overrides) -> LatentMoEConfig:
    base = dict(hidden_size=H, routed_expert_hidden_size=8, num_experts=E, num_experts_per_token=2,
                moe_intermediate_size=8, num_hidden_layers=1)
    return LatentMoEConfig(**{**base, **overrides})


def run(logits: list[list[float]] | torch.Tensor, c: LatentMoEConfig, bias=None):
    """Route on precomputed logits (x and Wg are then irrelevant and set to junk)."""
    logits = torch.as_tensor(logits, dtype=torch.float32)
    T = logits.shape[0]
    bias_E = torch.zeros(E) if bias is None else torch.as_tensor(bias, dtype=torch.float32)
    x = torch.full((T, H), float("nan"))  # proves x is not read when logits are given
    gate = torch.full((E, H), float("nan"))
    return route(x, gate, bias_E, c, logits)


def test_shapes_and_dtypes() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, H, generator=gen)
    ids, w = route(x, torch.randn(E, H, generator=gen), torch.zeros(E), cfg(num_experts_per_token=3))
    assert ids.shape == (5, 3) and ids.dtype == torch.int64
    assert w.shape == (5, 3) and w.dtype == torch.float32


def test_picks_the_largest_scores_in_order() -> None:
    ids, w = run([[0.0, 3.0, -1.0, 2.0, 0.5, -2.0, 1.0, 0.0]], cfg())
    assert ids.tolist() == [[1, 3]]
    s = torch.sigmoid(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(w, (s / s.sum())[None], rtol=1e-6, atol=0)


def test_ties_go_to_the_lower_expert_id() -> None:
    c = cfg(num_experts_per_token=3)
    # all equal: 0, 1, 2
    ids, _ = run([[0.5] * E], c)
    assert ids.tolist() == [[0, 1, 2]]
    # experts 2, 4 and 6 tie for the top: the two lower ids win
    ids, _ = run([[0.0, 0.0, 2.0, 0.0, 2.0, 0.0, 2.0, 1.0]], cfg(num_experts_per_token=2))
    assert ids.tolist() == [[2, 4]]
    # expert 2 is best, then 4, 6 and 7 tie for the last two places: 4 and 6
    ids, _ = run([[0.0, 0.0, 2.0, 0.0, 1.0, 0.0, 1.0, 1.0]], c)
    assert ids.tolist() == [[2, 4, 6]]
    # a tie created by the bias (s + b equal, s different) also goes to the lower id
    z = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    s = torch.sigmoid(z)[0]
    bias = torch.zeros(E)
    bias[5] = s[1] - s[5]  # expert 5's s + b equals expert 1's
    ids, _ = run(z, cfg(num_experts_per_token=1), bias=bias)
    assert (s[5] + bias[5]).item() == (s[1] + bias[1]).item()
    assert ids.tolist() == [[1]]


def test_ties_in_many_tokens_independently() -> None:
    logits = torch.zeros(4, E)
    logits[1, 7] = 1.0
    logits[2, [3, 5]] = 1.0
    logits[3] = -torch.arange(E, dtype=torch.float32)  # strictly decreasing
    ids, _ = run(logits, cfg())
    assert ids.tolist() == [[0, 1], [7, 0], [3, 5], [0, 1]]


def test_bias_changes_selection_not_weights() -> None:
    z = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    s = torch.sigmoid(z)[0]
    ids, w = run(z, cfg())
    assert ids.tolist() == [[0, 1]]
    bias = torch.zeros(E)
    bias[6] = 1.0  # sigmoid(-3) + 1 beats every unbiased score
    ids_b, w_b = run(z, cfg(), bias=bias)
    assert ids_b.tolist() == [[6, 0]]
    expected = torch.stack([s[6], s[0]])
    torch.testing.assert_close(w_b[0], expected / expected.sum(), rtol=1e-6, atol=0)
    # the weights are the unbiased scores: with renormalisation off, exactly s at the ids
    ids_r, w_r = run(z, cfg(moe_renormalize=False), bias=bias)
    torch.testing.assert_close(w_r[0], expected, rtol=0, atol=0)
    # a negative bias pushes a winner out
    bias = torch.zeros(E)
    bias[0] = -1.0
    ids_n, _ = run(z, cfg(), bias=bias)
    assert ids_n.tolist() == [[1, 2]]


def test_renormalise_off_gives_raw_scores() -> None:
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(6, E, generator=gen)
    ids, w = run(z, cfg(num_experts_per_token=3, moe_renormalize=False))
    torch.testing.assert_close(w, torch.sigmoid(z).gather(1, ids), rtol=0, atol=0)
    assert not torch.allclose(w.sum(-1), torch.ones(6))


def test_routed_scaling_factor() -> None:
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(6, E, generator=gen)
    ids1, w1 = run(z, cfg(num_experts_per_token=3))
    ids, w = run(z, cfg(num_experts_per_token=3, routed_scaling_factor=2.5))
    assert torch.equal(ids, ids1)
    torch.testing.assert_close(w, 2.5 * w1, rtol=1e-6, atol=0)
    torch.testing.assert_close(w.sum(-1), torch.full((6,), 2.5), rtol=1e-6, atol=0)
    # scaling without renormalisation: factor times the raw score
    ids, w = run(z, cfg(num_experts_per_token=3, routed_scaling_factor=2.5, moe_renormalize=False))
    torch.testing.assert_close(w, 2.5 * torch.sigmoid(z).gather(1, ids), rtol=1e-6, atol=0)


def test_softmax_router() -> None:
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(7, E, generator=gen)
    p = torch.softmax(z.double(), -1)
    c = cfg(num_experts_per_token=3, moe_router_activation_func="softmax")
    ids, w = run(z, c)
    assert torch.equal(ids, torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :3])
    top = p.gather(1, ids)
    torch.testing.assert_close(w.double(), top / top.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    ids, w = run(z, cfg(num_experts_per_token=3, moe_router_activation_func="softmax",
                        moe_renormalize=False))
    torch.testing.assert_close(w.double(), p.gather(1, ids), rtol=1e-6, atol=1e-7)


def test_softmax_bias_selects_on_probabilities() -> None:
    # softmax scores of [0, 0, ..., 0] are all 1/8; a bias of 0.01 on expert 3 picks it first
    bias = torch.zeros(E)
    bias[3] = 0.01
    ids, w = run([[0.0] * E], cfg(moe_router_activation_func="softmax"), bias=bias)
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5]]), rtol=1e-6, atol=0)


GROUPED = dict(use_grouped_topk=True, num_expert_group=4, topk_group=2)  # groups {0,1} {2,3} {4,5} {6,7}


def test_grouped_topk_restricts_to_top_groups() -> None:
    # expert 0 has the largest logit, but its group partner is very low, so group 0's score
    # (sum of its two best) is the smallest; groups 1 and 2 win and expert 0 is never chosen.
    z = [[5.0, -9.0, 1.0, 1.0, 0.8, 0.8, -9.0, -9.0]]
    ids, w = run(z, cfg(**GROUPED))
    assert ids.tolist() == [[2, 3]]
    ids_flat, _ = run(z, cfg())
    assert ids_flat.tolist() == [[0, 2]]  # without groups expert 0 wins
    # k = 4 takes every expert of both kept groups, in score order
    ids, w = run(z, cfg(num_experts_per_token=4, **GROUPED))
    assert ids.tolist() == [[2, 3, 4, 5]]
    s = torch.sigmoid(torch.tensor(z[0]))[[2, 3, 4, 5]]
    torch.testing.assert_close(w[0], s / s.sum(), rtol=1e-6, atol=0)


def test_grouped_topk_group_score_uses_the_bias() -> None:
    z = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.5, 0.5, -1.0, -1.0]])
    ids, _ = run(z, cfg(**{**GROUPED, "topk_group": 1}))
    assert ids.tolist() == [[0, 1]]
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.6, 0.6])
    ids, w = run(z, cfg(**{**GROUPED, "topk_group": 1}), bias=bias)
    assert ids.tolist() == [[6, 7]]
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5]]), rtol=1e-6, atol=0)


def test_grouped_topk_group_ties_go_to_the_lower_group() -> None:
    z = [[0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]  # groups 1, 2, 3 tie
    ids, _ = run(z, cfg(num_experts_per_token=4, **GROUPED))
    assert ids.tolist() == [[2, 3, 4, 5]]


def test_grouped_topk_single_expert_groups_match_plain_topk() -> None:
    # groups of one expert: keeping the top `topk_group` groups is plain top-k of that size
    gen = torch.Generator().manual_seed(6)
    z = torch.randn(20, E, generator=gen)
    c_grouped = cfg(num_experts_per_token=3, use_grouped_topk=True, num_expert_group=8, topk_group=3)
    ids_g, w_g = run(z, c_grouped)
    ids, w = run(z, cfg(num_experts_per_token=3))
    assert torch.equal(ids_g, ids) and torch.equal(w_g, w)


def test_grouped_topk_all_groups_kept_is_plain_topk() -> None:
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(20, E, generator=gen)
    ids_g, w_g = run(z, cfg(num_experts_per_token=3, use_grouped_topk=True, num_expert_group=4, topk_group=4))
    ids, w = run(z, cfg(num_experts_per_token=3))
    assert torch.equal(ids_g, ids) and torch.equal(w_g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_logits_computed_in_fp32_from_x(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(9, H, generator=gen).to(dtype)
    gate = torch.randn(E, H, generator=gen)
    bias = torch.randn(E, generator=gen) * 0.05
    c = cfg(num_experts_per_token=3)
    ids, w = route(x, gate, bias, c)
    ids_ref, w_ref = route(x.float(), gate, bias, c, x.float() @ gate.t())
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=0, atol=0)
    assert w.dtype == torch.float32


def test_precomputed_logits_replace_x_times_gate() -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, H, generator=gen)
    gate = torch.randn(E, H, generator=gen)
    logits = torch.full((4, E), -5.0)
    logits[:, 5] = 5.0
    logits[:, 1] = 4.0
    ids, w = route(x, gate, torch.zeros(E), cfg(), logits)
    assert ids.tolist() == [[5, 1]] * 4
    s = torch.sigmoid(torch.tensor([5.0, 4.0]))
    torch.testing.assert_close(w, (s / s.sum()).expand(4, 2), rtol=1e-6, atol=0)
    ids_x, _ = route(x, gate, torch.zeros(E), cfg())
    assert not torch.equal(ids_x, ids)  # computing x·Wg would have picked other experts
    # bf16 logits are accepted and used in fp32
    ids_b, w_b = route(x, gate, torch.zeros(E), cfg(), logits.to(torch.bfloat16))
    assert torch.equal(ids_b, ids) and w_b.dtype == torch.float32
