"""Token-sharded routed input: the quantisers' stated error bounds, and the runner's path on a
real P = 2 gloo group (one group for the module; every case runs inside it).

Legend: T tokens, H hidden (128 on tiny), D latent (64), P TP size.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch

from moe_runtime import mxfp4
from moe_runtime.activation import GatedActivation
from moe_runtime.checkpoint import CheckpointReader
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import down_project, latent_norm, moe_forward, shared_experts
from moe_runtime.router import route
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group
from moe_runtime.tp.plan import TailPlan
from moe_runtime.tp.routed_input import (
    FP8_MAX,
    RoutedInputConfig,
    dequantize,
    fp8_dequantize,
    fp8_quantize,
    quantize,
)
from moe_runtime.tp.runner import activation_quantizer, build_rank_runners, check_activation_quant
from moe_runtime.units import SCALE_RULES, SERVED_DTYPES, torch_dtype

LAYER = 1
P = 2
TOKENS = (1, 33, 257)  # T = 1: rank 1 owns no row and gathers only padding
DTYPES = {name: torch_dtype(name) for name in SERVED_DTYPES}
TAILS = ("replicated", "sharded")


def make_input(T: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(104729 * T + 3)).to(dtype)


# -- the error bounds of routed_input.py's docstring, as functions of the unquantised h -------


def fp8_bound(h_TD: torch.Tensor) -> torch.Tensor:
    """``|x - q| <= |x| * 2**-4 + scale * 2**-10`` with ``scale = amax_row / 448``."""
    h = h_TD.float()
    scale = h.abs().amax(-1, keepdim=True) / FP8_MAX
    return h.abs() * 2**-4 + scale * 2**-10


def mxfp4_bound(h_TD: torch.Tensor, rule: str = "even") -> torch.Tensor:
    """``|x - q| <= max(|x| / 4, amax / 14)`` (``amax / 16`` under the ``floor`` rule), ``amax``
    the largest magnitude of x's block."""
    h = h_TD.float()
    T, D = h.shape
    amax = h.abs().reshape(T, D // mxfp4.BLOCK, mxfp4.BLOCK).amax(-1).repeat_interleave(mxfp4.BLOCK, dim=-1)
    return torch.maximum(h.abs() / 4, amax / (16 if rule == "floor" else 14))


BOUNDS = {
    "fp8-approx": fp8_bound,
    "mxfp4-approx": mxfp4_bound,
    "mxfp4-approx-floor": functools.partial(mxfp4_bound, rule="floor"),
}


def check_bound(err: torch.Tensor, bound: torch.Tensor, what: str, min_tightness: float = 0.5) -> None:
    """Every element within its bound; the bound neither vacuous (some error > 0) nor loose
    (the worst element uses at least ``min_tightness`` of its bound)."""
    ratio = err / bound.clamp_min(torch.finfo(torch.float32).tiny)
    worst = ratio.max().item()
    assert (err <= bound).all(), f"{what}: {int((err > bound).sum())} elements exceed the bound (worst {worst:.3f}x)"
    assert err.max().item() > 0, f"{what}: nothing was quantised"
    assert worst >= min_tightness, f"{what}: the bound is loose, worst element uses {worst:.3f} of it"


# -- single-process unit tests ----------------------------------------------------------------


def _latent_like(T: int = 64, D: int = 256, seed: int = 0) -> torch.Tensor:
    """Rows with very different magnitudes, a few outliers and one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g) * torch.logspace(-3, 2, T).unsqueeze(1)
    h[T // 2, 7] *= 50.0
    h[5 % T] = 0.0
    return h


def test_fp8_layout_and_scales() -> None:
    h = _latent_like()
    codes, scale = fp8_quantize(h)
    assert codes.dtype == torch.uint8 and codes.shape == h.shape
    assert scale.dtype == torch.float32 and scale.shape == (h.shape[0], 1)
    amax = h.abs().amax(-1, keepdim=True)
    nonzero = amax.squeeze(1) > 0
    torch.testing.assert_close(scale[nonzero], amax[nonzero] / FP8_MAX)
    assert torch.isfinite(scale).all() and (scale > 0).all()  # the zero row gets a tiny, finite scale
    q = fp8_dequantize(codes, scale, torch.float32)
    # Each row's largest magnitude lands on the largest e4m3 value (448), exactly.
    idx = h.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(q.gather(1, idx)[nonzero], h.gather(1, idx)[nonzero], rtol=1e-6, atol=0)
    assert torch.equal(q[5], torch.zeros_like(q[5]))


def test_fp8_roundtrip_within_bound() -> None:
    h = _latent_like()
    q = dequantize(quantize(h, "fp8-approx"), "fp8-approx", torch.float32)
    check_bound((q - h).abs(), fp8_bound(h), "fp8", min_tightness=0.9)


def test_fp8_subnormal_term_is_needed() -> None:
    """Elements far below their row's maximum fall into e4m3 subnormals (spacing
    ``2**-9 * scale``): the relative term alone does not bound them, the absolute one does."""
    h = torch.tensor([[448.0, 3.3e-3, -2.1e-3, 1.7e-3, 0.9e-3, 5e-4, 2e-4, 1e-4]])  # scale = 1
    q = dequantize(quantize(h, "fp8-approx"), "fp8-approx", torch.float32)
    err = (q - h).abs()
    assert (err > h.abs() * 2**-4).any()
    assert (err <= fp8_bound(h)).all()


def test_fp8_dequantize_dtype() -> None:
    h = _latent_like(T=8, D=32)
    codes, scale = fp8_quantize(h)
    q16 = fp8_dequantize(codes, scale, torch.bfloat16)
    assert q16.dtype == torch.bfloat16
    torch.testing.assert_close(q16, fp8_dequantize(codes, scale, torch.float32).to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_mxfp4_roundtrip_within_bound(rule: str) -> None:
    h = _latent_like()
    parts = quantize(h, "mxfp4-approx", rule)
    assert [p.dtype for p in parts] == [torch.uint8, torch.uint8]
    assert parts[0].shape == (64, 128) and parts[1].shape == (64, 256 // mxfp4.BLOCK)
    assert torch.equal(parts[1], mxfp4.encode(h, rule)[1])
    q = dequantize(parts, "mxfp4-approx", torch.float32)
    check_bound((q - h).abs(), mxfp4_bound(h, rule), "mxfp4", min_tightness=0.7)
    assert torch.equal(q[5], torch.zeros_like(q[5]))


def test_mxfp4_routed_input_defaults_to_the_activation_rule() -> None:
    h = _latent_like()
    for mode in ("mxfp4", "mxfp4-approx"):
        assert all(torch.equal(a, b) for a, b in zip(quantize(h, mode), mxfp4.encode(h, "even"), strict=True))
        assert not torch.equal(quantize(h, mode)[1], quantize(h, mode, "floor")[1])


def test_quantize_none_is_the_identity() -> None:
    h = _latent_like(T=8, D=32)
    parts = quantize(h, "none")
    assert len(parts) == 1 and parts[0] is h
    assert dequantize(parts, "none", torch.float32) is h


def test_gathered_bytes_shrink_at_k3_size() -> None:
    """DESIGN §4: what a rank all-gathers shrinks ~2x (FP8) or ~3.8x (MXFP4) against bf16 (D = 3584)."""
    h = _latent_like(T=64, D=3584).to(torch.bfloat16)

    def gathered(mode: str) -> int:
        return sum(p.numel() * p.element_size() for p in quantize(h, mode))

    bf16 = gathered("none")
    assert bf16 == 64 * 3584 * 2
    assert bf16 / gathered("fp8-approx") == pytest.approx(2.0, abs=0.01)  # 1 B per element + a 4 B scale per row
    assert bf16 / gathered("mxfp4") == pytest.approx(3.76, abs=0.01)  # 4 bits + one E8M0 scale per 32


def test_config_defaults_and_validation() -> None:
    default = RoutedInputConfig()
    assert (default.enabled, default.quant, default.min_sharded_tokens) == (False, "auto", 256)
    with pytest.raises(ValueError, match=re.escape("'int4' is not one of ('auto', 'none', 'mxfp4', 'fp8-approx'")):
        RoutedInputConfig(enabled=True, quant="int4")
    with pytest.raises(ValueError, match="'fp8' is not one of"):  # the lossy modes say so in their name
        RoutedInputConfig(enabled=True, quant="fp8")
    with pytest.raises(ValueError, match="min_sharded_tokens must be >= 1, got 0"):
        RoutedInputConfig(enabled=True, min_sharded_tokens=0)
    for quant in ("fp8-approx", "mxfp4-approx", "mxfp4"):
        with pytest.raises(ValueError, match=f"'{quant}' needs the token-sharded routed input"):
            RoutedInputConfig(quant=quant)


def test_auto_never_picks_an_approximation() -> None:
    """``auto`` is exact: the experts' own MXFP4 quantisation moved onto the shard when they
    quantise (W4A4), otherwise no quantisation; disabled always resolves to none."""
    on = RoutedInputConfig(enabled=True)
    assert on.resolve("mxfp4", 64).quant == "mxfp4"
    assert on.resolve("none", 64).quant == "none"
    assert RoutedInputConfig().resolve("mxfp4", 64).quant == "none"
    for quant in ("none", "fp8-approx", "mxfp4-approx"):
        assert RoutedInputConfig(enabled=True, quant=quant).resolve("none", 64).quant == quant


def test_resolve_rejects_inexact_or_impossible_combinations() -> None:
    with pytest.raises(ValueError, match=r"needs experts_activation_quant 'mxfp4'.*'mxfp4-approx'"):
        RoutedInputConfig(enabled=True, quant="mxfp4").resolve("none", 64)
    with pytest.raises(ValueError, match=r"use routed-input quantisation 'mxfp4' \(exact\)"):
        RoutedInputConfig(enabled=True, quant="mxfp4-approx").resolve("mxfp4", 64)
    with pytest.raises(ValueError, match="'int8' is not one of"):
        RoutedInputConfig(enabled=True).resolve("int8", 64)
    for quant, act in (("mxfp4-approx", "none"), ("mxfp4", "mxfp4"), ("auto", "mxfp4")):
        with pytest.raises(ValueError, match=re.escape("multiple of 32: 48 % 32 = 16")):
            RoutedInputConfig(enabled=True, quant=quant).resolve(act, 48)
    RoutedInputConfig(enabled=True, quant="fp8-approx").resolve("none", 48)  # per-token: any width


# -- the runner's routed input on a P = 2 group ------------------------------------------------


APPROX = ("fp8-approx", "mxfp4-approx")
W4A4_MIN_TOKENS = 32  # T = 1 stays below it, 33 and 257 are token-sharded
_AUTO = RoutedInputConfig(enabled=True, min_sharded_tokens=W4A4_MIN_TOKENS)  # -> mxfp4 with W4A4
W4A4_VARIANTS = {  # name: (routed input, mxfp4_scale_rule)
    "w4a4": (None, "even"),  # replicated down-projection, experts quantise h and the gated activation
    "w4a4_auto": (_AUTO, "even"),
    "w4a4_sharded_none": (
        RoutedInputConfig(enabled=True, quant="none", min_sharded_tokens=W4A4_MIN_TOKENS), "even"
    ),
    "w4a4_floor": (None, "floor"),  # the OCP rule, selectable for comparison
    "w4a4_auto_floor": (_AUTO, "floor"),
}
W4A4_NAME = {"even": "w4a4", "floor": "w4a4_floor"}  # plain W4A4 per rule


class CountingQuant:
    """Wraps an ``act_quant`` and records the shape of every tensor it quantises."""

    def __init__(self, quant):
        self.quant, self.shapes = quant, []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(t.shape))
        return self.quant(t)


def _rank_routed(comm: Collectives, ckpt: str, mxfp4_ckpt: str) -> dict:
    """Rank body: latents and outputs of every routed-input configuration."""
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    out: dict = {}

    def runner(dtype, tail="replicated", routed_input=None, path=ckpt, act="none", rule="even"):
        return build_rank_runners(path, cfg, [LAYER], comm, TailPlan.single(tail, "test"), dtype=dtype,
                                  routed_input=routed_input, experts_activation_quant=act,
                                  mxfp4_scale_rule=rule)[LAYER]

    for dname, dtype in DTYPES.items():
        for quant in ("none", *APPROX, "mxfp4-approx-floor"):
            ri = RoutedInputConfig(enabled=True, quant=quant.removesuffix("-floor"), min_sharded_tokens=1)
            r = runner(dtype, routed_input=ri, rule="floor" if quant.endswith("-floor") else "even")
            for T in TOKENS:
                comm.counts.clear()
                out[("latent", dname, quant, T)] = (r.routed_input_latent(make_input(T, cfg.hidden_size, dtype)),
                                                    dict(comm.counts))
        for tail in TAILS:
            variants = {
                "sharded_none": RoutedInputConfig(enabled=True, min_sharded_tokens=1),
                "default": RoutedInputConfig(),
                "absent": None,
                "below_threshold": RoutedInputConfig(enabled=True, quant="fp8-approx", min_sharded_tokens=300),
            }
            for name, ri in variants.items():
                r = runner(dtype, tail, ri)
                for T in TOKENS:
                    comm.counts.clear()
                    out[("forward", dname, tail, name, T)] = (r.forward(make_input(T, cfg.hidden_size, dtype)),
                                                              dict(comm.counts))
            for name, (ri, rule) in W4A4_VARIANTS.items():
                r = runner(dtype, tail, ri, mxfp4_ckpt, "mxfp4", rule)
                out[("resolved", name)] = r.routed_input.quant
                r.act_quant = CountingQuant(r.act_quant)
                for T in TOKENS:
                    comm.counts.clear()
                    r.act_quant.shapes = []
                    got = r.forward(make_input(T, cfg.hidden_size, dtype))
                    out[("forward", dname, tail, name, T)] = (got, dict(comm.counts), r.act_quant.shapes)
    return out


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> str:
    return str(make_ckpt())


@pytest.fixture(scope="module")
def mxfp4_ckpt(make_ckpt) -> str:
    return str(make_ckpt(mxfp4=True))


@pytest.fixture(scope="module")
def group(ckpt: str, mxfp4_ckpt: str) -> list[dict]:
    return run_local_group(P, _rank_routed, ckpt, mxfp4_ckpt, timeout_s=240.0)


@functools.cache
def _full(ckpt: str, dtype: torch.dtype):
    from moe_runtime.checkpoint import load_layer_weights

    cfg = LatentMoEConfig.from_pretrained(ckpt)
    return cfg, load_layer_weights(ckpt, cfg, LAYER, dtype)


def full_latent(ckpt: str, dtype: torch.dtype, T: int) -> torch.Tensor:
    """The replicated down-projection of the whole batch on the unsharded weights."""
    cfg, w = _full(ckpt, dtype)
    return down_project(make_input(T, cfg.hidden_size, dtype), w)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("T", TOKENS)
def test_none_mode_equals_replicated_down_projection(group, ckpt, dname: str, T: int) -> None:
    """Each row is the same H-long dot products whichever rank computes it; only the GEMM's
    blocking over a different number of rows can differ, i.e. at most an fp32 rounding
    step (1e-6 relative) or one bf16 ulp: 2**-7 of the value's power of two, so up to 2**-7
    relative to a value just above it (measured: 4.8e-7 on a value of 9.2e-5, 1/192, where the
    rank's bf16 GEMM and the reference's block the 257 rows differently)."""
    ref = full_latent(ckpt, DTYPES[dname], T)
    for rank in range(P):
        h, counts = group[rank][("latent", dname, "none", T)]
        assert counts == {"all_gather": 1}
        assert h.dtype == ref.dtype and h.shape == ref.shape == (T, 64)
        if dname == "float32":
            torch.testing.assert_close(h, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
        else:
            torch.testing.assert_close(h, ref, rtol=2**-7, atol=0)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("quant", (*APPROX, "mxfp4-approx-floor"))
@pytest.mark.parametrize("T", TOKENS)
def test_quantised_latent_within_stated_bound(group, ckpt, dname: str, quant: str, T: int) -> None:
    """Every element of the gathered, dequantised latent is within routed_input.py's bound of
    the full down-projection. Slack on top of the bound: the rank's own GEMM of its rows may
    differ from the reference's by a rounding step (fp32: 1e-6 relative), and in bf16 both the
    latent and the dequantised value are bf16 roundings (one ulp, 2**-8, each)."""
    ref = full_latent(ckpt, DTYPES[dname], T).float()
    slack_rel = 1e-6 if dname == "float32" else 2 * 2**-8
    bound = BOUNDS[quant](ref) * (1 + slack_rel) + slack_rel * ref.abs()
    for rank in range(P):
        h, counts = group[rank][("latent", dname, quant, T)]
        assert counts == {"all_gather": 2}  # values, then scales
        assert h.dtype == DTYPES[dname] and h.shape == (T, 64)
        check_bound((h.float() - ref).abs(), bound, f"{quant} rank {rank}", min_tightness=0.5 if T > 1 else 0.25)
    for rank in range(1, P):
        assert torch.equal(group[rank][("latent", dname, quant, T)][0], group[0][("latent", dname, quant, T)][0])


def assert_like_single_device(got: torch.Tensor, ref: torch.Tensor) -> None:
    """TP 2 against one device, as in test_tp_runner.py: fp32 ~1e-6 relative reorderings;
    bf16 partials (expert output, latent partial, shared partial) rounded to bf16 before the
    bf16 all-reduce, a few ulps of ``m``. Under W4A4 the quantised activations are
    bit-identical on both sides (same ``h``; the rank's gated activation is a 32-column slice
    of the full one, and its MXFP4 blocks are the full tensor's blocks), so they add no error."""
    m = ref.abs().max().item()
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * m)
    else:
        torch.testing.assert_close(got, ref, rtol=2**-7, atol=4 * 2**-8 * m)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("T", TOKENS)
def test_unquantised_routed_input_end_to_end(group, ckpt, dname: str, tail: str, T: int) -> None:
    cfg, w = _full(ckpt, DTYPES[dname])
    ref = moe_forward(make_input(T, cfg.hidden_size, DTYPES[dname]), w, cfg)
    for rank in range(P):
        got, counts = group[rank][("forward", dname, tail, "sharded_none", T)]
        assert counts == {"all_reduce": 2, "all_gather": 1}
        assert_like_single_device(got, ref)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("T", TOKENS)
def test_routed_input_off_leaves_the_path_unchanged(group, dname: str, tail: str, T: int) -> None:
    """The default config, no config, and an enabled config below ``min_sharded_tokens`` all
    run the replicated down-projection: no all-gather and bit-identical outputs."""
    for rank in range(P):
        absent, absent_counts = group[rank][("forward", dname, tail, "absent", T)]
        assert absent_counts == {"all_reduce": 2}
        for name in ("default", "below_threshold"):
            got, counts = group[rank][("forward", dname, tail, name, T)]
            assert counts == absent_counts, name
            assert torch.equal(got, absent), name


# -- W4A4 emulation (experts_activation_quant: mxfp4) and the exact deferred routed input ------


def w4a4_explicit(x_TH: torch.Tensor, w, cfg: LatentMoEConfig) -> torch.Tensor:
    """The layer with the experts' activations fake-quantised by hand, token by token and slot
    by slot: MXFP4 ``h`` into the gate/up GEMM, MXFP4 gated activation into the down GEMM."""
    act = GatedActivation.from_config(cfg)
    ids_TK, weights_TK = route(x_TH, w.gate_EH, w.bias_E, cfg)
    E, I = w.experts.num_experts, w.experts.intermediate_size
    w13, w2 = w.experts.decode(torch.arange(E))
    hq_TD = mxfp4.quantize_dequantize(down_project(x_TH, w))
    L_TD = torch.zeros(x_TH.shape[0], w.experts.latent_size)
    for t, (ids, weights) in enumerate(zip(ids_TK.tolist(), weights_TK.tolist(), strict=True)):
        for e, wt in zip(ids, weights, strict=True):
            gate_up = hq_TD[t : t + 1] @ w13[e].t()
            a = act(gate_up[:, :I], gate_up[:, I:]).to(x_TH.dtype)
            L_TD[t] += wt * (mxfp4.quantize_dequantize(a) @ w2[e].t()).float()[0]
    R_TH = latent_norm(L_TD, w, cfg.rms_norm_eps).to(x_TH.dtype) @ w.up_HD.t()
    return R_TH + shared_experts(x_TH, w, act)


def test_w4a4_hook_quantises_both_activations(mxfp4_ckpt: str) -> None:
    """The experts backend with ``act_quant`` is the hand-quantised layer (fp32: GEMM
    reordering only, 1e-5 * m as everywhere), and visibly not the W4A16 one."""
    cfg, w = _full(mxfp4_ckpt, torch.float32)
    x = make_input(33, cfg.hidden_size, torch.float32)
    got = moe_forward(x, w, cfg, act_quant=mxfp4.quantize_dequantize)
    ref = w4a4_explicit(x, w, cfg)
    m = ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * m)
    assert (moe_forward(x, w, cfg) - ref).abs().max().item() > 100 * 1e-5 * m


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("T", TOKENS)
def test_w4a4_tp2_matches_single_device_w4a4(group, mxfp4_ckpt, dname: str, tail: str, T: int, rule: str) -> None:
    cfg, w = _full(mxfp4_ckpt, DTYPES[dname])
    act_quant = functools.partial(mxfp4.quantize_dequantize, scale_rule=rule)
    ref = moe_forward(make_input(T, cfg.hidden_size, DTYPES[dname]), w, cfg, act_quant=act_quant)
    for rank in range(P):
        got, counts, quantised = group[rank][("forward", dname, tail, W4A4_NAME[rule], T)]
        assert counts == {"all_reduce": 2}
        assert_like_single_device(got, ref)
        # h once ([T, D]), then one gated activation [rows, I / P] per active expert
        assert quantised[0] == (T, 64) and quantised[1:] and all(q[1] == 32 for q in quantised[1:])


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("T", TOKENS)
def test_deferred_mxfp4_routed_input_is_exact_under_the_floor_rule(group, dname: str, tail: str, T: int) -> None:
    """The OCP rule stays selectable and reaches both places: the deferred MXFP4 routed input
    quantises with it on the shard exactly as the experts do unsharded (bit-identical), and
    the outputs are not the default rule's (some blocks of h or of the gated activation have
    an amax mantissa >= 1.75 at these sizes)."""
    for rank in range(P):
        deferred, counts, _ = group[rank][("forward", dname, tail, "w4a4_auto_floor", T)]
        plain, _, _ = group[rank][("forward", dname, tail, "w4a4_floor", T)]
        assert torch.equal(deferred, plain)
        assert counts == ({"all_reduce": 2, "all_gather": 2} if T >= W4A4_MIN_TOKENS else {"all_reduce": 2})
        assert not torch.equal(plain, group[rank][("forward", dname, tail, "w4a4", T)][0])


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("T", TOKENS)
def test_deferred_mxfp4_routed_input_is_exact(group, dname: str, tail: str, T: int) -> None:
    """With W4A4 experts, ``auto`` token-shards the routed input as MXFP4: each rank quantises
    its own token rows before the all-gather (values, then scales) and the experts do not
    quantise ``h`` again. Bit-identical to the same experts quantising the gathered
    unquantised latent, and to plain (non-deferred) W4A4: MXFP4 blocks lie within a token, and
    the rank's down-projection GEMM gives its rows the same bits as the full-batch GEMM (true
    of torch's CPU GEMM; the first comparison does not even need that). Below
    ``min_sharded_tokens`` nothing is gathered."""
    assert group[0][("resolved", "w4a4_auto")] == "mxfp4"
    assert group[0][("resolved", "w4a4_sharded_none")] == "none"
    for rank in range(P):
        deferred, counts, quantised = group[rank][("forward", dname, tail, "w4a4_auto", T)]
        plain, plain_counts, plain_quantised = group[rank][("forward", dname, tail, "w4a4", T)]
        assert torch.equal(deferred, plain)
        if T >= W4A4_MIN_TOKENS:
            gathered, gathered_counts, gathered_quantised = group[rank][("forward", dname, tail, "w4a4_sharded_none", T)]
            assert counts == {"all_reduce": 2, "all_gather": 2}
            assert gathered_counts == {"all_reduce": 2, "all_gather": 1}
            assert torch.equal(deferred, gathered)
            assert (T, 64) not in quantised and gathered_quantised[0] == (T, 64)
            assert quantised == gathered_quantised[1:]
        else:
            assert counts == plain_counts == {"all_reduce": 2} and quantised == plain_quantised


def test_w4a4_needs_mxfp4_experts_and_whole_blocks(ckpt: str, mxfp4_ckpt: str) -> None:
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    with pytest.raises(ValueError, match=r"emulates W4A4 MXFP4 experts, but the experts of layer\(s\) \[1\] are stored dense"):
        build_rank_runners(ckpt, cfg, [LAYER], Collectives(), TailPlan.single("replicated", "t"),
                           dtype=torch.float32, experts_activation_quant="mxfp4")
    with pytest.raises(ValueError, match=re.escape("I / P = 64 / 4 to be a multiple of 32: 16 % 32 = 16")):
        check_activation_quant("mxfp4", cfg, 4, CheckpointReader(mxfp4_ckpt), [LAYER])
    with pytest.raises(ValueError, match=re.escape("latent size D to be a multiple of 32: 48 % 32 = 16")):
        activation_quantizer("mxfp4", dataclasses.replace(cfg, routed_expert_hidden_size=48), 1)
    with pytest.raises(ValueError, match="'fp8' is not one of"):
        activation_quantizer("fp8", cfg, 1)
    assert activation_quantizer("none", cfg, 4) is None
    check_activation_quant("none", cfg, 4, CheckpointReader(ckpt), [LAYER])


def test_mxfp4_scale_rule_default_and_validation(ckpt: str, mxfp4_ckpt: str) -> None:
    """W4A4 quantises with the production rule unless told otherwise; an unknown rule, or the
    non-default rule where nothing quantises MXFP4 activations, is refused at construction."""
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    h = torch.tensor([[1.8 * 8, 0.3] + [0.1] * 30])  # amax mantissa 1.8: the rules differ
    default = activation_quantizer("mxfp4", cfg, 1)
    assert torch.equal(default(h), mxfp4.quantize_dequantize(h, "even"))
    assert torch.equal(activation_quantizer("mxfp4", cfg, 1, "floor")(h), mxfp4.quantize_dequantize(h, "floor"))
    assert not torch.equal(default(h), mxfp4.quantize_dequantize(h, "floor"))
    with pytest.raises(ValueError, match=re.escape("MXFP4 scale rule 'ceil' is not one of ('even', 'floor')")):
        activation_quantizer("mxfp4", cfg, 1, "ceil")
    plan = TailPlan.single("replicated", "t")
    with pytest.raises(ValueError, match="mxfp4_scale_rule 'floor' would have no effect.*'none'.*'none'"):
        build_rank_runners(ckpt, cfg, [LAYER], Collectives(), plan, dtype=torch.float32, mxfp4_scale_rule="floor")
    with pytest.raises(ValueError, match="scale rule 'round'"):
        build_rank_runners(mxfp4_ckpt, cfg, [LAYER], Collectives(), plan, dtype=torch.float32,
                           experts_activation_quant="mxfp4", mxfp4_scale_rule="round")
    # an MXFP4 routed input in front of unquantised experts uses the rule too
    ri = RoutedInputConfig(enabled=True, quant="mxfp4-approx")
    r = build_rank_runners(ckpt, cfg, [LAYER], Collectives(), plan, dtype=torch.float32, routed_input=ri,
                           mxfp4_scale_rule="floor")[LAYER]
    assert r.mxfp4_scale_rule == "floor" and r.act_quant is None


def test_deployment_spec_checks_w4a4_at_build_time(ckpt: str, mxfp4_ckpt: str) -> None:
    from deployments.app import decide_app

    def resolve_app(args: dict) -> tuple:
        app_args, resolved, _ = decide_app({"auto_tune_tokens": "none", **args})  # the build-time checks
        return app_args, resolved

    args = {"tp_size": 2, "experts_activation_quant": "mxfp4"}
    _, [resolved] = resolve_app({"checkpoint": mxfp4_ckpt, **args})
    assert resolved.spec.experts_activation_quant == "mxfp4"
    with pytest.raises(ValueError, match="deployment 'moe': .*stored dense"):
        resolve_app({"checkpoint": ckpt, **args})
    with pytest.raises(ValueError, match=re.escape("I / P = 64 / 4 to be a multiple of 32")):
        resolve_app({"checkpoint": mxfp4_ckpt, **args, "tp_size": 4})
    with pytest.raises(ValueError, match="experts_activation_quant"):
        resolve_app({"checkpoint": mxfp4_ckpt, "experts_activation_quant": "fp8"})
    assert resolved.spec.mxfp4_scale_rule == "even"
    _, [floor] = resolve_app({"checkpoint": mxfp4_ckpt, **args, "mxfp4_scale_rule": "floor"})
    assert floor.spec.mxfp4_scale_rule == "floor"
    with pytest.raises(ValueError, match="mxfp4_scale_rule 'floor' would have no effect"):
        resolve_app({"checkpoint": mxfp4_ckpt, "mxfp4_scale_rule": "floor"})
    with pytest.raises(ValueError, match="mxfp4_scale_rule"):
        resolve_app({"checkpoint": mxfp4_ckpt, **args, "mxfp4_scale_rule": "ceil"})
