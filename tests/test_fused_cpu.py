"""The fused MXFP4 decode + GEMM on CPU (issue 17): exact within the order of fp32 additions.

Derivation of the tolerances (u = 2**-24, fp32's unit roundoff):

1. Weights. ``mxfp4.decode`` forms ``v * 2**(s-127)`` in fp32 (then casts); the kernel forms
   ``(2 v) * 2**(s-128)``: the same real number, a value with at most 2 significant bits times a
   power of two, exact down to ``0.5 * 2**-127 = 2**-128`` (an fp32 subnormal, and a bf16 one:
   bf16 reaches 2**-133), and overflowing to inf for the same elements (``|v| >= 2`` at s = 254).
   So the decoded weights are identical, and exact in bf16 too (same 8 exponent bits).
2. Products. ``x * w`` with x bf16/fp16 (<= 11 significant bits) or the kernel's fp32 copy of it,
   and w with <= 2 significant bits, is exact in fp32 (no rounding; for fp32 x the kernel's FMA is
   exact too). Both sides therefore sum the same K exact products in fp32, in different orders.
3. One GEMM element (the kernel test, rigorous): any fp32 summation order of K terms is within
   ``gamma_{K-1} * sum |x_k w_k|`` of the exact sum, ``gamma_n = n u / (1 - n u)``. Non-finite
   results (inf weights at s = 254) do not depend on the order: inf + finite = inf, inf - inf and
   0 * inf = NaN either way, so the pattern of inf/NaN must match exactly.
4. The experts / the layer (backend tests): in fp32 each GEMM element's two orders differ by at
   most ``2 gamma_{K-1} sum|x w|``; with these random inputs the realised difference is a random
   walk, ~sqrt(K) u relative to the element (K <= 512 here: ~1.4e-6); through the activation, the
   second GEMM and the weighted combine that stays ~1e-6 of max|L|, so 1e-5 of max|L|. In bf16 the
   fp32 sums agree to ~1e-6 relative but each GEMM output is rounded to bf16, so a value within
   1e-6 of a rounding midpoint rounds one bf16 ulp (2**-8 relative) the other way. Per slot at
   most two roundings flip (gate/up element and output element), each moving L by at most one ulp
   of that element: 2 * 2**-8 = 2**-7 of max|L| (the remaining pipeline is the same code); the
   layer output adds the up-projection's and final bf16 rounding (identical inputs except for the
   flipped elements): 2**-6 there. With W4A4 activation fake-quant a flipped bf16 activation can
   cross an FP4 rounding boundary: one FP4 step of one element, as experts.check's 5e-2.
"""

from __future__ import annotations

import logging

import pytest
import torch

from moe_runtime import mxfp4
from moe_runtime.activation import GatedActivation
from moe_runtime.experts import TorchExperts, mxfp4_cpu
from moe_runtime.experts.torch_loop import packed_path
from moe_runtime.weights import ExpertWeights

U = 2.0**-24
# tolerances of max|ref| by dtype, derived in the module docstring (item 4)
EXPERTS_REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}
LAYER_REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}
ACT_QUANT_REL_TOL = 5e-2

needs_kernel = pytest.mark.skipif(mxfp4_cpu.unavailable_reason() is not None,
                                  reason=f"fused MXFP4 CPU kernel unavailable: {mxfp4_cpu.unavailable_reason()}")


def assert_fused_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, msg: str = "",
                       layer: bool = True) -> None:
    """Fused vs decode path, ``max|diff| <= tol * max|ref|`` with the docstring's tolerances."""
    assert got.shape == ref.shape, msg
    if not ref.numel():  # e.g. a sequence-parallel rank that owns no token
        return
    tol = (LAYER_REL_TOL if layer else EXPERTS_REL_TOL)[dtype]
    diff, scale = (got.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
    assert diff <= tol * scale, f"{msg}: max|diff| {diff:.3g} > {tol:.3g} * max|ref| {scale:.3g}"


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def kernel_case(T: int, K: int, N: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * torch.exp2(torch.randint(-20, 20, (N, 1), generator=gen).float())
    packed, scale = mxfp4.encode(w)
    x = torch.randn(T, K, generator=gen).to(dtype)
    return x, packed, scale


def check_against_exact(x, packed, scale) -> None:
    w = mxfp4.decode(packed, scale).double()
    exact = x.double() @ w.t()
    magnitude = x.double().abs() @ w.abs().t()
    got = mxfp4_cpu.linear(x, packed, scale).double()
    # Elements whose finite terms sum (in |x w|) to 2**127 or more may overflow an fp32 partial sum
    # in one order and not another: left out. Everywhere else an inf weight gives the same inf or
    # NaN in any order, and every finite element must meet the rounding bound.
    finite_terms = x.double().abs() @ torch.where(torch.isfinite(w), w.abs(), 0).t()
    safe = finite_terms < 2.0**127
    nonfinite = ~torch.isfinite(exact) & safe
    assert torch.equal(torch.isnan(exact) & safe, torch.isnan(got) & safe)
    assert torch.equal(exact[nonfinite & ~torch.isnan(exact)], got[nonfinite & ~torch.isnan(exact)])
    finite = torch.isfinite(exact) & safe
    assert finite.any()
    bound = gamma(x.shape[1] - 1) * magnitude[finite]
    err = (got[finite] - exact[finite]).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound.clamp_min(1e-300)).max():.3g}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13])  # every token-group tail (6, 5..1)
@pytest.mark.parametrize("K", [32, 96, 1536])  # one block, odd block count, a TP 2 w2 width
def test_kernel_within_fp32_summation_bound(dtype, T, K) -> None:
    check_against_exact(*kernel_case(T, K, 37, dtype, seed=T + K))


@needs_kernel
def test_kernel_edge_scales_saturation_and_nonfinite() -> None:
    K, N = 64, 12
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    packed[0] = 0x77  # +6 +6: the saturation code
    packed[1] = 0xFF  # -6 -6
    packed[2] = 0x19  # -0.5 and +0.5
    scale = torch.tensor([[0, 254], [1, 127], [0, 0], [253, 2], [127, 128], [126, 129],
                          [254, 254], [0, 253], [100, 150], [5, 250], [127, 127], [128, 126]],
                         dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(5, K, generator=gen).to(dtype)
        x[0, :5] = 0  # 0 * inf = NaN must match
        check_against_exact(x, packed, scale)
    # the OCP encoder saturates outliers to +-6 * scale: the kernel reads them back exactly
    w = torch.tensor([[1e3] + [1.0] * 31, [-1e3] + [-0.01] * 31])
    p, s = mxfp4.encode(w)
    check_against_exact(torch.eye(32), p, s)


def packed_experts(dtype: torch.dtype, E=6, I=64, D=96, seed=0) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    (p13, s13), (p2, s2) = mxfp4.encode(torch.randn(E, 2 * I, D, generator=gen) * D**-0.5), mxfp4.encode(
        torch.randn(E, D, I, generator=gen) * I**-0.5)
    return ExpertWeights(p13, p2, s13, s2, dtype=dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_quant", [None, mxfp4.quantize_dequantize])
def test_fused_backend_equals_decode_backend(dtype, act_quant) -> None:
    experts, act = packed_experts(dtype), GatedActivation(4.0, 25.0)
    gen = torch.Generator().manual_seed(1)
    for T in (1, 33, 40):
        h = torch.randn(T, experts.latent_size, generator=gen).to(dtype)
        ids = torch.stack([torch.randperm(5, generator=gen)[:3] for _ in range(T)])  # expert 5 idle
        weights = torch.rand(T, 3, generator=gen)
        fused = TorchExperts(packed="fused")(h, ids, weights, experts, act, act_quant)
        ref = TorchExperts(packed="decode")(h, ids, weights, experts, act, act_quant)
        if act_quant is None:
            assert_fused_close(fused, ref, dtype, f"T {T}", layer=False)
        else:
            diff = (fused - ref).abs().max().item()
            assert diff <= ACT_QUANT_REL_TOL * ref.abs().max().item()


def test_default_path_and_fallback(monkeypatch, caplog) -> None:
    packed = packed_experts(torch.bfloat16, E=2)
    dense = ExpertWeights(*packed.decode(torch.arange(2)), dtype=torch.bfloat16)
    assert packed_path(dense)[0] == "dense"
    assert packed_path(packed, "decode")[0] == "decode"
    expected = "fused" if mxfp4_cpu.unavailable_reason() is None else "decode"
    assert packed_path(packed)[0] == expected  # fused is the CPU default when it builds
    # fp16: the decode path's fp16 weights under/overflow where fp32 does not: decode keeps them
    assert packed_path(packed_experts(torch.float16, E=2))[0] == "decode"
    # no compiler (or any build failure): a WARNING with the reason, and the decode path serves
    monkeypatch.setattr(mxfp4_cpu, "_load", lambda: (None, "no C++ compiler found (test)"))
    with caplog.at_level(logging.WARNING, logger="moe_runtime"):
        path, why = packed_path(packed)
    assert path == "decode" and "no C++ compiler found (test)" in why
    assert any("fall back to decode" in r.getMessage() for r in caplog.records)
    h = torch.randn(3, 96).bfloat16()
    ids, weights = torch.tensor([[0], [1], [0]]), torch.ones(3, 1)
    act = GatedActivation()
    out = TorchExperts()(h, ids, weights, packed, act)
    torch.testing.assert_close(out, TorchExperts(packed="decode")(h, ids, weights, packed, act), rtol=0, atol=0)
    with pytest.raises(ValueError, match="no C.. compiler"):
        packed_path(packed, "fused")
    with pytest.raises(ValueError, match="packed experts path"):
        TorchExperts(packed="fast")


def test_build_failure_is_a_reason_not_an_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(mxfp4_cpu.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")  # a "compiler" that fails
    monkeypatch.setattr(mxfp4_cpu.shutil, "which", lambda name: "/bin/false" if name else None)
    mxfp4_cpu._build.cache_clear()
    try:
        lib, why = mxfp4_cpu._load()
        assert lib is None and why
    finally:
        mxfp4_cpu._build.cache_clear()
    monkeypatch.setenv(mxfp4_cpu.ENV_SWITCH, "0")
    try:
        assert mxfp4_cpu._load() == (None, f"{mxfp4_cpu.ENV_SWITCH}=0 in the environment")
    finally:
        mxfp4_cpu._build.cache_clear()


@needs_kernel
@pytest.mark.parametrize("T", [1, 3, 4, 5, 9])  # every token-group tail (4, 3, 2, 1)
def test_bf16_kernel_within_fp32_summation_bound_and_dense_linear(T) -> None:
    gen = torch.Generator().manual_seed(T)
    K, N = 544, 19  # 17 blocks: more than one K chunk when T is large enough
    x, w = torch.randn(T, K, generator=gen).bfloat16(), torch.randn(N, K, generator=gen).bfloat16()
    exact, magnitude = x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t()
    got = mxfp4_cpu.bf16_linear(x, w).double()
    assert ((got - exact).abs() <= gamma(K - 1) * magnitude).all()  # item 3: bf16 products are exact
    # dense_linear rounds once to bf16 where torch's bf16 GEMM rounds its fp32 sum: equal, or one
    # bf16 ulp apart where the two fp32 orders straddle a rounding midpoint (item 4)
    ours, torchs = mxfp4_cpu.dense_linear(x, w), x @ w.t()
    assert ours.dtype == torch.bfloat16
    assert ((ours.float() - torchs.float()).abs() <= 2.0**-8 * torchs.float().abs()).all()
    xf, wf = x.float(), w.float()  # fp32 (and anything but bf16 x bf16): torch itself
    assert torch.equal(mxfp4_cpu.dense_linear(xf, wf), xf @ wf.t())


def test_dense_linear_falls_back_to_torch(monkeypatch) -> None:
    monkeypatch.setattr(mxfp4_cpu, "_load", lambda: (None, "no C++ compiler found (test)"))
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    assert torch.equal(mxfp4_cpu.dense_linear(x, w), x @ w.t())
