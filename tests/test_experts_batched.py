"""The batched path for packed CPU experts and the measured crossovers (issue 48).

Tolerances, from tests/test_fused_cpu.py's derivation (u = 2**-24):

- ``decode_into`` writes the reference decode's values exactly (fp32 and bf16 hold every FP4
  value times an E8M0 power of two): compared with ``torch.equal``.
- ``batched.linear`` is torch's GEMM on those exact weights: the K products are exact in fp32
  (bf16 x bf16, or fp32 x a 2-bit weight), summed in fp32 in oneDNN's order, so within
  ``gamma_{K-1} * sum|x w|`` of the exact sum (as the fused kernel); a bf16 result is then rounded
  once more, by at most 2**-8 of itself (8 significant bits). The inputs here are normal numbers: oneDNN's AVX512-BF16
  and AMX instructions flush subnormals, which the rounding bound does not cover (the decode
  path's torch GEMM does the same).
- The experts through the batched path against the decode path: the fused path's tolerances
  (EXPERTS_REL_TOL: 1e-5 of max|L| in fp32, 2**-7 in bf16), as the two differ in the same way.
"""

from __future__ import annotations

import logging

import pytest
import torch
from test_fused_cpu import (
    EXPERTS_REL_TOL,
    assert_fused_close,
    check_against_exact,
    gamma,
    kernel_case,
    packed_experts,
)

from moe_runtime import logs, mxfp4
from moe_runtime.activation import GatedActivation
from moe_runtime.experts import TorchExperts, batched, crossover, mxfp4_cpu, torch_loop

needs_kernel = pytest.mark.skipif(mxfp4_cpu.unavailable_reason() is not None,
                                  reason=f"MXFP4 CPU kernel unavailable: {mxfp4_cpu.unavailable_reason()}")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_into_equals_reference_decode(dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (37, 80), dtype=torch.uint8, generator=gen)
    scale = torch.randint(0, 255, (37, 5), dtype=torch.uint8, generator=gen)  # subnormal .. inf
    scale[0] = 0
    scale[1] = 254
    ref = mxfp4.decode(packed, scale, dtype)
    got = mxfp4_cpu.decode_into(packed, scale, torch.empty(37, 160, dtype=dtype))
    assert torch.equal(got, ref)  # no NaN possible: scale 255 is refused, 0 * inf never formed
    with pytest.raises(ValueError, match="needs packed"):
        mxfp4_cpu.decode_into(packed, scale, torch.empty(37, 192, dtype=dtype))
    with pytest.raises(ValueError, match="contiguous fp32 or bf16"):
        mxfp4_cpu.decode_into(packed, scale, torch.empty(37, 160, dtype=torch.float16))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_batched_linear_within_summation_bound(dtype, T) -> None:
    x, packed, scale = kernel_case(T, 544, 70, dtype, seed=T)
    w = mxfp4.decode(packed, scale).double()
    exact, magnitude = x.double() @ w.t(), x.double().abs() @ w.abs().t()
    # a 3-row tile: many tiles, the last one short (70 = 23 * 3 + 1)
    got = batched.linear(x, packed, scale, torch.empty(3 * 544 + 5, dtype=dtype))
    assert got.dtype == dtype and got.shape == (T, 70)
    rounding = 2.0**-8 if dtype == torch.bfloat16 else 0.0  # bf16: 8 significant bits
    bound = gamma(543) * magnitude * (1 + rounding) + rounding * exact.abs()
    assert ((got.double() - exact).abs() <= bound).all()
    with pytest.raises(ValueError, match="cannot hold one row"):
        batched.linear(x, packed, scale, torch.empty(100, dtype=dtype))


@needs_kernel
@pytest.mark.parametrize("isa", sorted(mxfp4_cpu.ISAS))
def test_each_isa_build_within_fp32_summation_bound(isa, monkeypatch) -> None:
    """The AVX2 and AVX-512 builds keep the kernel's contract (the default build is tested by
    test_fused_cpu.py; here each one the CPU runs, edge scales included)."""
    monkeypatch.setenv(mxfp4_cpu.ISA_ENV, isa)
    if mxfp4_cpu._load()[0] is None:
        pytest.skip(mxfp4_cpu._load()[1])
    assert mxfp4_cpu.isa() == isa
    for T in range(1, 12):  # every token-group tail of both builds (8 and 4 tokens per pass)
        check_against_exact(*kernel_case(T, 96 if T % 2 else 1536, 37, torch.bfloat16, seed=T))
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (12, 32), dtype=torch.uint8, generator=gen)
    scale = torch.tensor([[0, 254], [1, 127], [2, 3], [253, 2], [127, 128], [126, 129],
                          [254, 254], [0, 253], [100, 150], [5, 250], [127, 127], [128, 126]], dtype=torch.uint8)
    check_against_exact(torch.randn(5, 64, generator=gen), packed, scale)
    x, w = torch.randn(6, 544, generator=gen).bfloat16(), torch.randn(19, 544, generator=gen).bfloat16()
    exact, magnitude = x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t()
    assert ((mxfp4_cpu.bf16_linear(x, w).double() - exact).abs() <= gamma(543) * magnitude).all()
    out = torch.empty(12, 64)
    assert torch.equal(mxfp4_cpu.decode_into(packed, scale, out), mxfp4.decode(packed, scale))


def test_isa_choice_is_checked(monkeypatch) -> None:
    monkeypatch.setenv(mxfp4_cpu.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="MOE_RUNTIME_MXFP4_ISA='sse2': expected one of"):
        mxfp4_cpu.wanted_isa()
    monkeypatch.delenv(mxfp4_cpu.ISA_ENV)
    monkeypatch.setattr(crossover, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert mxfp4_cpu.wanted_isa() == "avx2"  # AVX-512 without BW/VL/DQ keeps the AVX2 build
    monkeypatch.setattr(crossover, "cpu_flags", lambda: frozenset({"avx2", "fma", *mxfp4_cpu.AVX512}))
    assert mxfp4_cpu.wanted_isa() == "avx512"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_and_mixed_experts_equal_decode_path(dtype, monkeypatch) -> None:
    experts, act = packed_experts(dtype), GatedActivation(4.0, 25.0)
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(40, experts.latent_size, generator=gen).to(dtype)
    # expert 0 gets 30 slots, experts 1-4 22-23 each, expert 5 none
    ids = torch.tensor([[0, 1 + t % 4, 1 + (t + 1) % 4] if t < 30 else [1 + (t + j) % 4 for j in range(3)]
                        for t in range(40)])
    weights = torch.rand(40, 3, generator=gen)
    ref = TorchExperts(packed="decode")(h, ids, weights, experts, act)
    assert TorchExperts(packed="batched").path(experts)[0] == "batched"
    assert_fused_close(TorchExperts(packed="batched")(h, ids, weights, experts, act), ref, dtype, layer=False)
    # auto with a crossover of 30 slots: expert 0 batched, the others fused, in one forward
    assert torch.bincount(ids.flatten(), minlength=6).tolist() == [30, 23, 23, 22, 22, 0]
    monkeypatch.setitem(torch_loop._CROSSOVERS, torch_loop._crossover_key(experts), crossover.Crossover(30, ()))
    calls = []
    monkeypatch.setattr(batched, "linear", lambda *a, real=batched.linear: calls.append(1) or real(*a))
    mixed = TorchExperts()(h, ids, weights, experts, act)
    assert len(calls) == 2  # expert 0's two projections
    assert_fused_close(mixed, ref, dtype, layer=False)
    assert (mixed - ref).abs().max() <= EXPERTS_REL_TOL[dtype] * ref.abs().max()
    # MOE_RUNTIME_CPU_BATCHED=0: fused at every count, as before issue 48
    monkeypatch.setenv(mxfp4_cpu.BATCHED_ENV, "0")
    calls.clear()
    assert_fused_close(TorchExperts()(h, ids, weights, experts, act), ref, dtype, layer=False)
    assert not calls


@needs_kernel
def test_prepare_measures_the_crossover_once_and_reports_it(monkeypatch, caplog) -> None:
    experts = packed_experts(torch.bfloat16, E=2)
    monkeypatch.setattr(torch_loop, "_CROSSOVERS", {})
    monkeypatch.setattr(logs, "_logged", set())  # log_once: as in a fresh process
    measured = []
    monkeypatch.setattr(crossover, "measure", lambda a, b: measured.append(1) or crossover.Crossover(
        6, ((1, 2e-3, 4e-3), (6, 9e-3, 3e-3))))
    backend = TorchExperts()
    with caplog.at_level(logging.INFO, logger="moe_runtime"):
        backend.prepare(experts)
        backend.prepare(experts)
    assert measured == [1]
    path, why = backend.path(experts)
    assert path == "fused" and "batched from 6 rows" in why and "torch's GEMM on" in why
    assert any("CPU GEMMs: torch's bf16 GEMM runs on" in r.getMessage() for r in caplog.records)
    TorchExperts(packed="fused").prepare(packed_experts(torch.float32, E=2))  # nothing to choose
    assert measured == [1]


def test_measure_picks_the_first_count_from_which_the_second_path_always_wins(monkeypatch) -> None:
    times = {"a": {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}, "b": {1: 3.0, 2: 1.9, 4: 5.0, 8: 4.0, 16: 4.0}}
    monkeypatch.setattr(crossover, "_seconds", lambda fn, rows: times[fn(rows)][rows])
    found = crossover.measure(lambda m: "a", lambda m: "b", counts=(1, 2, 4, 8, 16))
    # 2 wins by less than MARGIN, 4 loses: the crossover is 8, where b wins from then on
    assert found.rows == 8 and found.uses_second(9) and not found.uses_second(7)
    assert [m for m, _, _ in found.timings] == [1, 2, 4, 8, 16]
    assert "batched from 8 rows" in found.describe("fused", "batched")
    # a win that a larger count takes back does not count: 1 and 2 win, 4 loses
    times["b"] = {1: 0.1, 2: 0.2, 4: 5.0, 8: 1.0, 16: 1.0}
    assert crossover.measure(lambda m: "a", lambda m: "b", counts=(1, 2, 4, 8, 16)).rows == 8
    times["b"] = {m: t * 10 for m, t in times["a"].items()}
    never = crossover.measure(lambda m: "a", lambda m: "b", counts=(1, 2, 4, 8, 16))
    assert never.rows is None and not never.uses_second(10**6)
    assert "batched never" in never.describe("fused", "batched")


def test_amx_detection_and_the_engine_it_reports(monkeypatch) -> None:
    monkeypatch.setattr(crossover, "cpu_flags", lambda: frozenset({"avx512f", "amx_tile", "amx_bf16"}))
    assert crossover.has_amx() and crossover.native_bf16() and crossover.gemm_engine().startswith("AMX-BF16")
    monkeypatch.setattr(crossover, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert not crossover.has_amx() and crossover.native_bf16()
    assert crossover.gemm_engine().startswith("AVX512-BF16, not AMX (no amx_bf16/amx_tile in /proc/cpuinfo")
    monkeypatch.setattr(crossover, "cpu_flags", lambda: frozenset({"avx2"}))
    assert not crossover.native_bf16() and crossover.gemm_engine().startswith("no native bf16")


@needs_kernel
def test_dense_linear_takes_torch_from_the_measured_crossover(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(24, 96, generator=gen).bfloat16()
    x = torch.randn(9, 96, generator=gen).bfloat16()
    kernel = mxfp4_cpu.bf16_linear(x, w).to(torch.bfloat16)
    monkeypatch.setattr(mxfp4_cpu, "DENSE_CROSSOVERS", {})
    monkeypatch.setattr(crossover, "native_bf16", lambda: False)  # torch widens bf16 in software
    assert mxfp4_cpu.dense_crossover(w) is crossover.NEVER
    assert torch.equal(mxfp4_cpu.dense_linear(x, w), kernel)
    monkeypatch.setattr(mxfp4_cpu, "DENSE_CROSSOVERS", {(24, 96, torch.get_num_threads()): crossover.Crossover(4, ())})
    assert torch.equal(mxfp4_cpu.dense_linear(x[:3], w), kernel[:3])
    assert torch.equal(mxfp4_cpu.dense_linear(x, w), x @ w.t())
    monkeypatch.setenv(mxfp4_cpu.BATCHED_ENV, "0")
    assert torch.equal(mxfp4_cpu.dense_linear(x, w), kernel)
    monkeypatch.setattr(mxfp4_cpu, "DENSE_CROSSOVERS", {})
    monkeypatch.setattr(crossover, "native_bf16", lambda: True)
    monkeypatch.setattr(crossover, "measure", lambda a, b: a(2) is not None and b(2) is not None
                        and crossover.Crossover(None, ((2, 1.0, 2.0),)))
    assert mxfp4_cpu.dense_crossover(w).rows is None
