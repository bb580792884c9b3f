"""Token-sharded routed input: the quantisers' stated error bounds, and the runner's path on a
real P = 2 gloo group (one group for the module; every case runs inside it).

Legend: T tokens, H hidden (128 on tiny), D latent (64), P TP size.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from moe_runtime import mxfp4
from moe_runtime.collectives import Collectives
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import down_project, moe_forward
from moe_runtime.local_group import run_local_group
from moe_runtime.plan import TailPlan
from moe_runtime.routed_input import (
    FP8_MAX,
    QUANT_MODES,
    RoutedInputConfig,
    dequantize,
    fp8_dequantize,
    fp8_quantize,
    quantize,
    wire_bytes,
)
from moe_runtime.runner import build_rank_runners

LAYER = 1
P = 2
TOKENS = (1, 33, 257)  # T = 1: rank 1 owns no row and gathers only padding
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TAILS = ("replicated", "sharded")


def make_input(T: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(104729 * T + 3)).to(dtype)


# -- the error bounds of routed_input.py's docstring, as functions of the unquantised h -------


def fp8_bound(h_TD: torch.Tensor) -> torch.Tensor:
    """``|x - q| <= |x| * 2**-4 + scale * 2**-10`` with ``scale = amax_row / 448``."""
    h = h_TD.float()
    scale = h.abs().amax(-1, keepdim=True) / FP8_MAX
    return h.abs() * 2**-4 + scale * 2**-10


def mxfp4_bound(h_TD: torch.Tensor) -> torch.Tensor:
    """``|x - q| <= max(|x| / 4, amax / 12)``, ``amax`` the largest magnitude of x's block."""
    h = h_TD.float()
    T, D = h.shape
    amax = h.abs().reshape(T, D // mxfp4.BLOCK, mxfp4.BLOCK).amax(-1).repeat_interleave(mxfp4.BLOCK, dim=-1)
    return torch.maximum(h.abs() / 4, amax / 12)


BOUNDS = {"fp8": fp8_bound, "mxfp4": mxfp4_bound}


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
    q = dequantize(quantize(h, "fp8"), "fp8", torch.float32)
    check_bound((q - h).abs(), fp8_bound(h), "fp8", min_tightness=0.9)


def test_fp8_subnormal_term_is_needed() -> None:
    """Elements far below their row's maximum fall into e4m3 subnormals (spacing
    ``2**-9 * scale``): the relative term alone does not bound them, the absolute one does."""
    h = torch.tensor([[448.0, 3.3e-3, -2.1e-3, 1.7e-3, 0.9e-3, 5e-4, 2e-4, 1e-4]])  # scale = 1
    q = dequantize(quantize(h, "fp8"), "fp8", torch.float32)
    err = (q - h).abs()
    assert (err > h.abs() * 2**-4).any()
    assert (err <= fp8_bound(h)).all()


def test_fp8_dequantize_dtype() -> None:
    h = _latent_like(T=8, D=32)
    codes, scale = fp8_quantize(h)
    q16 = fp8_dequantize(codes, scale, torch.bfloat16)
    assert q16.dtype == torch.bfloat16
    torch.testing.assert_close(q16, fp8_dequantize(codes, scale, torch.float32).to(torch.bfloat16), rtol=0, atol=0)


def test_mxfp4_roundtrip_within_bound() -> None:
    h = _latent_like()
    parts = quantize(h, "mxfp4")
    assert [p.dtype for p in parts] == [torch.uint8, torch.uint8]
    assert parts[0].shape == (64, 128) and parts[1].shape == (64, 256 // mxfp4.BLOCK)
    q = dequantize(parts, "mxfp4", torch.float32)
    check_bound((q - h).abs(), mxfp4_bound(h), "mxfp4", min_tightness=0.7)
    assert torch.equal(q[5], torch.zeros_like(q[5]))


def test_quantize_none_is_the_identity() -> None:
    h = _latent_like(T=8, D=32)
    parts = quantize(h, "none")
    assert len(parts) == 1 and parts[0] is h
    assert dequantize(parts, "none", torch.float32) is h


@pytest.mark.parametrize("mode", QUANT_MODES)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_wire_bytes_is_what_quantize_gathers(mode: str, dtype: torch.dtype) -> None:
    h = _latent_like(T=7, D=96).to(dtype)
    parts = quantize(h, mode)
    assert wire_bytes(7, 96, mode, dtype) == sum(p.numel() * p.element_size() for p in parts)


def test_wire_bytes_ratios_at_k3_size() -> None:
    """DESIGN §4: gathered bytes shrink ~2x (FP8) or ~3.8x (MXFP4) against bf16 (D = 3584)."""
    bf16 = wire_bytes(1024, 3584, "none", torch.bfloat16)
    assert bf16 / wire_bytes(1024, 3584, "fp8", torch.bfloat16) == pytest.approx(2.0, abs=0.01)
    assert bf16 / wire_bytes(1024, 3584, "mxfp4", torch.bfloat16) == pytest.approx(3.76, abs=0.01)


def test_config_defaults_and_validation() -> None:
    default = RoutedInputConfig()
    assert (default.enabled, default.quant, default.min_sharded_tokens) == (False, "none", 256)
    with pytest.raises(ValueError, match=re.escape("'int4' is not one of ('none', 'fp8', 'mxfp4')")):
        RoutedInputConfig(enabled=True, quant="int4")
    with pytest.raises(ValueError, match="min_sharded_tokens must be >= 1, got 0"):
        RoutedInputConfig(enabled=True, min_sharded_tokens=0)
    for quant in ("fp8", "mxfp4"):
        with pytest.raises(ValueError, match=f"'{quant}' needs the token-sharded routed input"):
            RoutedInputConfig(quant=quant)


def test_check_latent() -> None:
    with pytest.raises(ValueError, match=re.escape("multiple of 32: 48 % 32 = 16")):
        RoutedInputConfig(enabled=True, quant="mxfp4").check_latent(48)
    RoutedInputConfig(enabled=True, quant="mxfp4").check_latent(64)
    RoutedInputConfig(enabled=True, quant="fp8").check_latent(48)  # per-token: any width


# -- the runner's routed input on a P = 2 group ------------------------------------------------


def _rank_routed(comm: Collectives, ckpt: str) -> dict:
    """Rank body: latents and outputs of every routed-input configuration."""
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    out: dict = {}

    def runner(dtype, tail="replicated", routed_input=None):
        return build_rank_runners(ckpt, cfg, [LAYER], comm, TailPlan.single(tail, "test"),
                                  dtype=dtype, routed_input=routed_input)[LAYER]

    for dname, dtype in DTYPES.items():
        for quant in QUANT_MODES:
            r = runner(dtype, routed_input=RoutedInputConfig(enabled=True, quant=quant, min_sharded_tokens=1))
            for T in TOKENS:
                comm.counts.clear()
                out[("latent", dname, quant, T)] = (r.routed_input_latent(make_input(T, cfg.hidden_size, dtype)),
                                                    dict(comm.counts))
        for tail in TAILS:
            variants = {
                "sharded_none": RoutedInputConfig(enabled=True, min_sharded_tokens=1),
                "default": RoutedInputConfig(),
                "absent": None,
                "below_threshold": RoutedInputConfig(enabled=True, quant="fp8", min_sharded_tokens=300),
            }
            for name, ri in variants.items():
                r = runner(dtype, tail, ri)
                for T in TOKENS:
                    comm.counts.clear()
                    out[("forward", dname, tail, name, T)] = (r.forward(make_input(T, cfg.hidden_size, dtype)),
                                                              dict(comm.counts))
    return out


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> str:
    return str(make_ckpt())


@pytest.fixture(scope="module")
def group(ckpt: str) -> list[dict]:
    return run_local_group(P, _rank_routed, ckpt, timeout_s=240.0)


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
    step (1e-6 relative) or one bf16 ulp (2**-8 relative)."""
    ref = full_latent(ckpt, DTYPES[dname], T)
    for rank in range(P):
        h, counts = group[rank][("latent", dname, "none", T)]
        assert counts == {"all_gather": 1}
        assert h.dtype == ref.dtype and h.shape == ref.shape == (T, 64)
        if dname == "float32":
            torch.testing.assert_close(h, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
        else:
            torch.testing.assert_close(h, ref, rtol=2**-8, atol=0)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("quant", ["fp8", "mxfp4"])
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


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("T", TOKENS)
def test_unquantised_routed_input_end_to_end(group, ckpt, dname: str, tail: str, T: int) -> None:
    """Tolerances as in test_tp_runner.py: fp32 reorderings ~1e-6 relative; bf16 partials
    rounded before the all-reduce, a few ulps of the output magnitude."""
    cfg, w = _full(ckpt, DTYPES[dname])
    ref = moe_forward(make_input(T, cfg.hidden_size, DTYPES[dname]), w, cfg)
    m = ref.abs().max().item()
    for rank in range(P):
        got, counts = group[rank][("forward", dname, tail, "sharded_none", T)]
        assert counts == {"all_reduce": 2, "all_gather": 1}
        if dname == "float32":
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * m)
        else:
            torch.testing.assert_close(got, ref, rtol=2**-7, atol=4 * 2**-8 * m)


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
