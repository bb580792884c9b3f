"""moe_forward (DESIGN §2) against an independent float64 loop over tokens and slots.

The oracle below re-derives every step from the DESIGN §2 text: it does not call
``router.route``, an experts backend or ``GatedActivation``. It reads the same weights
(``load_layer_weights`` output, cast to float64), so both sides see bit-identical parameters
and inputs and only the arithmetic differs.

Legend: T tokens, H hidden, D latent, E experts, K experts per token, I expert intermediate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from moe_runtime.checkpoint import load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.experts import get_backend
from moe_runtime.layer import check_input, moe_forward
from moe_runtime.weights import LayerWeights

# ------------------------------------------------------------------------------------------
# Tolerances.
#
# Selection. The layer routes in fp32 on x cast to fp32 (exact, also for bf16 x) and the fp32
# gate, so it sees exactly the oracle's inputs and differs only by fp32 rounding of z = x·Wg^T:
# |dz| <= H * u32 * sum|x_i g_i| (u32 = 2^-24). On the tiny preset H = 128 and
# sum|x_i g_i| ~ 0.64 * sqrt(H) ~ 7, so |dz| <= 5.4e-5 and, sigmoid' <= 1/4 (softmax is
# similar), the selection score s + b moves by <= 1.4e-5, plus a few fp32 ulps for the
# sigmoid and the bias add. A token whose k-th and (k+1)-th selection scores (or, under
# grouped top-k, whose topk_group-th and next group scores) are closer than MARGIN = 1e-4 may
# legitimately pick a different expert, so it is left out of the comparison. That bound is
# on the router's fp32 path only: bf16 rounding of the expert/latent intermediates never
# feeds back into selection. With random data such tokens are rare (gap density ~ 1 per unit
# score), and the test asserts at most 2% of tokens (or one token) are left out.
MARGIN = 1e-4
MAX_SKIPPED_FRACTION = 0.02

# fp32 values. Each output element passes through at most 5 chained reductions (down-proj
# over H = 128, gate/up over D = 64, down over I = 64, the K-slot combine + RMSNorm mean over
# D, up-proj over D; shared experts over H and Is). A length-n dot product has error
# <= n * u32 * sum|a_i b_i|; with n <= 128 and sum|a b| within ~sqrt(n) of the result's
# scale, each stage contributes <= 128 * 6e-8 * 11 ~ 8.5e-5 of the output scale in the worst
# case, and random rounding makes the typical error ~sqrt(n) * u32 ~ 1e-6 (measured: rms
# error ~7 u32, worst element 56 u32 = 3.3e-6 of rms). We allow rtol = 1e-4 and
# atol = 1e-4 * rms(reference): below the worst case of one stage, ~30x the worst measured
# error, and a real bug (a wrong weight, a missed slot, a wrong norm) is O(1).
FP32_TOL = 1e-4

# bf16 values. bf16 has an 8-bit mantissa: round-to-nearest unit roundoff u = 2^-9 ~ 1.95e-3.
# The layer rounds to bf16 at ~9 points (h; each expert's gate|up GEMM output; the fp32
# activation cast back; each expert output; the normed latent before Wup; R; the shared
# gate and up outputs, their activation, S; and R + S), and CPU bf16 GEMMs accumulate in fp32.
# Each rounding is a relative error <= u (std u/sqrt(3)) of an intermediate whose magnitude is
# ~ the output scale (weights are ~1/sqrt(fan_in)); independent roundings add in quadrature
# through the following GEMMs, so the per-element error is ~ sqrt(9) * u / sqrt(3) ~ 1.7u of
# rms(out) (measured: 2.2u-2.5u on every case below). Its maximum over up to 511 x 128 = 65k
# elements is ~4.5 sigma ~ 11u, with a heavier tail where intermediates are larger than their
# rms (measured worst: 21u, on the no-norm case). We allow atol = 32u * rms(reference)
# (6% of rms) plus rtol = 4u for the final rounding of large elements: ~2x the worst measured
# error, while a real bug (wrong weight, missed slot, norm off) is O(rms). The oracle is
# float64 on the same bf16 weights and bf16 input, so weight rounding is not part of the error.
# The fp32 cases (tolerance 1e-4, measured worst 3.3e-6 of rms) are the sharp check of every
# feature; the bf16 cases check the bf16 path end to end.
BF16_U = 2.0**-9
BF16_ATOL_IN_U = 32
BF16_RTOL_IN_U = 4


@dataclass
class Oracle:
    out_TH: torch.Tensor  # float64
    margin_T: torch.Tensor  # float64: how far each token's selection is from a tie
    ids: list[list[int]]


def _sigmoid(v: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-v))


def _act(g: torch.Tensor, u: torch.Tensor, cfg: LatentMoEConfig) -> torch.Tensor:
    """DESIGN §2 step 3 written out: SiTU when beta is set, else SiLU(g) * u."""
    beta, beta_lin = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    if beta is None:
        return g * _sigmoid(g) * u
    if beta_lin is not None:
        u = beta_lin * torch.tanh(u / beta_lin)
    return beta * torch.tanh(g / beta) * _sigmoid(g) * u


def _ranked(values: list[float], candidates: list[int]) -> list[int]:
    """Candidates by descending value, ties to the lower id (DESIGN §2)."""
    return sorted(candidates, key=lambda i: (-values[i], i))


def oracle_forward(x_TH: torch.Tensor, w: LayerWeights, cfg: LatentMoEConfig,
                   router_logits_TE: torch.Tensor | None = None) -> Oracle:
    f64 = torch.float64
    T = x_TH.shape[0]
    E, K, I = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size
    x = x_TH.to(f64)
    gate, bias = w.gate_EH.to(f64), w.bias_E.to(f64)
    down, up = w.down_DH.to(f64), w.up_HD.to(f64)
    w13, w2 = (t.to(f64) for t in w.experts.decode(torch.arange(E)))
    gamma = None if w.norm_D is None else w.norm_D.to(f64)
    shared = None
    if w.has_shared:
        shared = (w.shared_gate_SH.to(f64), w.shared_up_SH.to(f64), w.shared_down_HS.to(f64))

    out = torch.zeros(T, cfg.hidden_size, dtype=f64)
    margins = torch.zeros(T, dtype=f64)
    all_ids = []
    for t in range(T):
        # 1. router
        z = router_logits_TE[t].to(f64) if router_logits_TE is not None else gate @ x[t]
        if cfg.moe_router_activation_func == "softmax":
            e = torch.exp(z - z.max())
            s = e / e.sum()
        else:
            s = _sigmoid(z)
        sel = (s + bias).tolist()
        candidates = list(range(E))
        margin = math.inf
        if cfg.use_grouped_topk and cfg.num_expert_group > 1:
            # Group score: the sum of the group's two best selection scores (bias-corrected
            # grouped routing); keep the best topk_group groups, ties to the lower group.
            G = cfg.num_expert_group
            n = E // G
            group_score = [sum(sorted(sel[g * n:(g + 1) * n], reverse=True)[:min(2, n)]) for g in range(G)]
            groups = _ranked(group_score, list(range(G)))
            if cfg.topk_group < G:
                margin = group_score[groups[cfg.topk_group - 1]] - group_score[groups[cfg.topk_group]]
            candidates = [g * n + j for g in sorted(groups[:cfg.topk_group]) for j in range(n)]
        order = _ranked(sel, candidates)
        ids = order[:K]
        if K < len(order):
            margin = min(margin, sel[order[K - 1]] - sel[order[K]])
        margins[t] = margin
        all_ids.append(ids)
        weights = s[ids]
        if cfg.moe_renormalize:
            weights = weights / weights.sum()
        weights = weights * cfg.routed_scaling_factor

        # 2. down-projection, 3. experts, 4. combine
        h = down @ x[t]
        L = torch.zeros(cfg.routed_expert_hidden_size, dtype=f64)
        for slot, expert in enumerate(ids):
            g_u = w13[expert] @ h
            a = _act(g_u[:I], g_u[I:], cfg)
            L = L + weights[slot] * (w2[expert] @ a)

        # 5. latent norm and up-projection
        if gamma is not None:
            L = L / torch.sqrt((L * L).mean() + cfg.rms_norm_eps) * gamma
        R = up @ L

        # 6. shared experts, 7. output
        if shared is not None:
            sg, su, sd = shared
            R = R + sd @ _act(sg @ x[t], su @ x[t], cfg)
        out[t] = R
    return Oracle(out, margins, all_ids)


def compare(out_TH: torch.Tensor, ref: Oracle, dtype: torch.dtype) -> None:
    keep = ref.margin_T >= MARGIN
    skipped = int((~keep).sum())
    assert skipped <= max(1.0, MAX_SKIPPED_FRACTION * len(keep)), (
        f"{skipped} of {len(keep)} tokens are within {MARGIN} of a routing tie"
    )
    if not keep.any():
        pytest.skip("the only token is within MARGIN of a routing tie")
    expected = ref.out_TH[keep]
    actual = out_TH[keep].to(torch.float64)
    rms = expected.pow(2).mean().sqrt().item()
    if dtype == torch.float32:
        rtol, atol = FP32_TOL, FP32_TOL * rms
    else:
        rtol, atol = BF16_RTOL_IN_U * BF16_U, BF16_ATOL_IN_U * BF16_U * rms
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------------
# Cases: a covering set rather than the full product. Every feature is seen in both dtypes,
# and every token count appears with the default K3-like config; the last cases combine the
# non-default options.

SILU = dict(hidden_act="silu", activation_situ_beta=None, activation_situ_linear_beta=None)
GROUPED = dict(use_grouped_topk=True, num_expert_group=4, topk_group=2)  # E = 8: 4 groups of 2
F32, BF16 = torch.float32, torch.bfloat16

CASES = [
    # (name, T, dtype, mxfp4, config overrides, precomputed router logits)
    *[(f"k3-T{T}", T, dt, False, {}, False) for T in (1, 33, 511) for dt in (F32, BF16)],
    ("mxfp4", 33, F32, True, {}, False),
    ("mxfp4", 511, BF16, True, {}, False),
    ("no-shared", 511, F32, False, dict(num_shared_experts=0), False),
    ("no-shared", 33, BF16, False, dict(num_shared_experts=0), False),
    ("two-shared", 33, BF16, False, dict(num_shared_experts=2), False),
    ("no-norm", 33, F32, False, dict(latent_moe_use_norm=False), False),
    ("no-norm", 511, BF16, False, dict(latent_moe_use_norm=False), False),
    ("softmax", 511, F32, False, dict(moe_router_activation_func="softmax"), False),
    ("softmax", 33, BF16, False, dict(moe_router_activation_func="softmax"), False),
    ("grouped", 33, F32, False, GROUPED, False),
    ("grouped", 511, BF16, False, GROUPED, False),
    ("grouped-k3", 511, F32, False, dict(GROUPED, num_experts_per_token=3), False),
    ("silu", 511, F32, False, SILU, False),
    ("silu", 1, BF16, False, SILU, False),
    ("situ-no-linear-beta", 33, F32, False, dict(activation_situ_linear_beta=None), False),
    ("logits", 33, F32, False, {}, True),
    ("logits", 511, BF16, False, {}, True),
    ("scaled-no-renorm", 33, F32, False,
     dict(routed_scaling_factor=2.5, moe_renormalize=False, num_experts_per_token=3), False),
    ("scaled-no-renorm", 511, BF16, False,
     dict(routed_scaling_factor=2.5, moe_renormalize=False, num_experts_per_token=3), False),
    *[("everything-else", 511, dt, True,
       dict(GROUPED, **SILU, moe_router_activation_func="softmax", num_shared_experts=0,
            latent_moe_use_norm=False, routed_scaling_factor=0.5), True) for dt in (F32, BF16)],
]


def _case_id(case) -> str:
    name, T, dtype, mxfp4, _, _ = case
    name = name.removesuffix(f"-T{T}")
    return f"{name}-T{T}-{str(dtype).removeprefix('torch.')}" + ("-mxfp4" if mxfp4 and "mxfp4" not in name else "")


def _inputs(T: int, cfg: LatentMoEConfig, dtype: torch.dtype, with_logits: bool):
    gen = torch.Generator().manual_seed(1000 + T)
    x = torch.randn(T, cfg.hidden_size, generator=gen).to(dtype)
    logits = torch.randn(T, cfg.num_experts, generator=gen) * 2.0 if with_logits else None
    return x, logits


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_forward_matches_float64_oracle(make_ckpt, case) -> None:
    _, T, dtype, mxfp4, overrides, with_logits = case
    ckpt = make_ckpt(mxfp4=mxfp4, **overrides)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    layer = cfg.moe_layers[-1]
    w = load_layer_weights(ckpt, cfg, layer, dtype=dtype)
    x, logits = _inputs(T, cfg, dtype, with_logits)
    check_input(x, cfg, dtype, logits)

    out = moe_forward(x, w, cfg, router_logits_TE=logits)
    assert out.shape == (T, cfg.hidden_size) and out.dtype == dtype
    compare(out, oracle_forward(x, w, cfg, logits), dtype)


def test_oracle_is_not_trivially_satisfied(make_ckpt) -> None:
    """The oracle reacts to each ingredient: dropping the norm, the shared experts, the bias,
    or the β_lin cap changes the output by far more than the tolerances."""
    ckpt = make_ckpt()
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    w = load_layer_weights(ckpt, cfg, 1)
    x, _ = _inputs(33, cfg, F32, False)
    big = x * 8  # large enough that the SiTU caps (beta = 4, beta_lin = 25) bite
    base = oracle_forward(big, w, cfg).out_TH
    rms = base.pow(2).mean().sqrt()
    variants = {
        "no norm": (LatentMoEConfig.from_dict({**cfg.to_dict(), "latent_moe_use_norm": False}),
                    LayerWeights(**{**w.__dict__, "norm_D": None})),
        "no shared": (cfg, LayerWeights(**{**w.__dict__, "shared_gate_SH": None, "shared_up_SH": None,
                                           "shared_down_HS": None})),
        "no bias": (cfg, LayerWeights(**{**w.__dict__, "bias_E": torch.zeros_like(w.bias_E)})),
        "no beta_lin": (LatentMoEConfig.from_dict({**cfg.to_dict(), "activation_situ_linear_beta": None}), w),
    }
    for name, (c, wv) in variants.items():
        diff = (oracle_forward(big, wv, c).out_TH - base).abs().max()
        assert diff > 100 * FP32_TOL * rms, name
        # ...and the layer agrees with the oracle on each variant (on unscaled input: x * 8
        # saturates fp32 sigmoids to exactly 1.0, which makes near-ties common)
        compare(moe_forward(x, wv, c), oracle_forward(x, wv, c), F32)


def test_backend_object_and_name_agree(tiny_ckpt) -> None:
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    w = load_layer_weights(tiny_ckpt, cfg, 1)
    x, _ = _inputs(17, cfg, F32, False)
    torch.testing.assert_close(moe_forward(x, w, cfg, backend=get_backend("torch")), moe_forward(x, w, cfg),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown experts backend 'nope'"):
        moe_forward(x, w, cfg, backend="nope")


def test_tokens_are_independent(tiny_ckpt) -> None:
    """A token's output does not depend on the rest of the batch (up to GEMM blocking)."""
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    w = load_layer_weights(tiny_ckpt, cfg, 2)
    x, _ = _inputs(33, cfg, F32, False)
    full = moe_forward(x, w, cfg)
    for t in (0, 17, 32):
        torch.testing.assert_close(moe_forward(x[t : t + 1], w, cfg)[0], full[t], rtol=FP32_TOL, atol=FP32_TOL)


# ------------------------------------------------------------------------------------------
# check_input


@pytest.fixture(scope="module")
def tiny_cfg(tiny_ckpt) -> LatentMoEConfig:
    return LatentMoEConfig.from_pretrained(tiny_ckpt)


def test_check_input_accepts_good_input(tiny_cfg) -> None:
    check_input(torch.zeros(3, 128), tiny_cfg, F32)
    check_input(torch.zeros(3, 128, dtype=BF16), tiny_cfg, BF16, torch.zeros(3, 8), max_tokens=3)


@pytest.mark.parametrize(
    ("x", "logits", "max_tokens", "message"),
    [
        (torch.zeros(3, 127), None, None, "hidden_states must have shape [T, 128], got [3, 127]"),
        (torch.zeros(128), None, None, "hidden_states must have shape [T, 128], got [128]"),
        (torch.zeros(1, 3, 128), None, None, "hidden_states must have shape [T, 128], got [1, 3, 128]"),
        (torch.zeros(3, 128, dtype=BF16), None, None,
         "hidden_states dtype is torch.bfloat16, this layer runs in torch.float32"),
        (torch.zeros(3, 128, dtype=torch.float64), None, None, "hidden_states dtype is torch.float64"),
        (torch.zeros(0, 128), None, None, "hidden_states has no tokens (T == 0)"),
        (torch.zeros(5, 128), None, 4, "hidden_states has 5 tokens, more than the limit of 4"),
        (torch.zeros(3, 128).index_fill_(0, torch.tensor([1]), float("nan")), None, None,
         "hidden_states contains NaN or Inf"),
        (torch.zeros(3, 128).index_fill_(1, torch.tensor([7]), float("inf")), None, None,
         "hidden_states contains NaN or Inf"),
        (torch.full((3, 128), -float("inf")), None, None, "hidden_states contains NaN or Inf"),
        (torch.zeros(3, 128), torch.zeros(3, 7), None,
         "router_logits must have shape [3, 8] (T of hidden_states, num_experts), got [3, 7]"),
        (torch.zeros(3, 128), torch.zeros(4, 8), None, "router_logits must have shape [3, 8]"),
        (torch.zeros(3, 128), torch.zeros(3, 8, 1), None, "got [3, 8, 1]"),
        (torch.zeros(3, 128), torch.zeros(3, 8, dtype=torch.int64), None,
         "router_logits must be floating point, got torch.int64"),
        (torch.zeros(3, 128), torch.full((3, 8), float("nan")), None, "router_logits contains NaN or Inf"),
        (torch.zeros(3, 128), [[0.0] * 8] * 3, None, "router_logits must be a tensor, got list"),
        ([[0.0] * 128], None, None, "hidden_states must be a tensor, got list"),
    ],
    ids=["width", "1d", "3d", "bf16-vs-fp32", "fp64", "T0", "too-many", "nan", "inf", "neg-inf",
         "logits-width", "logits-T", "logits-3d", "logits-int", "logits-nan", "logits-list", "x-list"],
)
def test_check_input_rejects(tiny_cfg, x, logits, max_tokens, message) -> None:
    with pytest.raises(ValueError) as info:
        check_input(x, tiny_cfg, F32, logits, max_tokens=max_tokens)
    assert message in str(info.value)
