"""The ``grouped`` experts backend (torch's grouped GEMM) against the torch backend and the reference."""

from __future__ import annotations

import pytest
import torch
from test_tp_runner import LAYER, TAILS, assert_matches_reference, gather_output, make_input, reference

from moe_runtime import mxfp4
from moe_runtime import private_api as torch_api
from moe_runtime.activation import GatedActivation
from moe_runtime.config import LatentMoEConfig
from moe_runtime.experts import TorchExperts, get_backend
from moe_runtime.experts.grouped import GroupedExperts
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group
from moe_runtime.tp.plan import TailPlan
from moe_runtime.tp.runner import build_rank_runners
from moe_runtime.weights import ExpertWeights

E, I, D, T, K = 6, 64, 96, 40, 3
ACT = GatedActivation(4.0, 25.0)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def experts(dtype: torch.dtype, packed: bool) -> ExpertWeights:
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, D, generator=gen) * D**-0.5
    w2 = torch.randn(E, D, I, generator=gen) * I**-0.5
    (p13, s13), (p2, s2) = mxfp4.encode(w13), mxfp4.encode(w2)
    if packed:
        return ExpertWeights(p13, p2, s13, s2, dtype=dtype)
    return ExpertWeights(mxfp4.decode(p13, s13, dtype), mxfp4.decode(p2, s2, dtype), dtype=dtype)


def batch(dtype: torch.dtype, tokens: int = T, num_experts: int = E):
    gen = torch.Generator().manual_seed(tokens)
    h = torch.randn(tokens, D, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:K] for _ in range(tokens)])
    return h, ids, torch.rand(tokens, K, generator=gen)


def row_quant(t: torch.Tensor) -> torch.Tensor:
    """A row-wise fake quantiser (per-row scale, 3 fractional bits) standing in for W4A4."""
    scale = t.abs().amax(-1, keepdim=True).clamp_min(1e-6) / 8
    return ((t / scale).round() * scale).to(t.dtype)


CASES = [
    *[(dtype, packed, T, E, None) for dtype in DTYPES for packed in (False, True)],
    (torch.bfloat16, False, T, 4, None),  # experts 4, 5 inactive: empty groups
    (torch.bfloat16, True, T, 4, None),  # inactive packed experts are never decoded
    (torch.float32, True, 1, E, None),  # a single decode token
    (torch.bfloat16, False, T, E, row_quant),
    (torch.bfloat16, True, T, 4, row_quant),
]


@pytest.mark.parametrize("dtype,packed,tokens,num_experts,act_quant", CASES)
def test_grouped_equals_torch_backend(dtype, packed, tokens, num_experts, act_quant) -> None:
    ex = experts(dtype, packed)
    h, ids, w = batch(dtype, tokens, num_experts)
    got = get_backend("grouped")(h, ids, w, ex, ACT, act_quant)
    # packed: against the torch backend's decode path (the fused CPU path is test_fused_cpu's)
    ref = TorchExperts(packed="decode")(h, ids, w, ex, ACT, act_quant)
    assert got.dtype == torch.float32 and got.shape == (tokens, D)
    # On CPU the grouped GEMM multiplies each row block exactly as the per-expert GEMM does, and
    # the combine adds the same rows in the same (expert-sorted) order: bit-identical.
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("experts_per_chunk", [1, 2, 4, E])
def test_packed_chunking_does_not_change_the_result(experts_per_chunk) -> None:
    ex = experts(torch.bfloat16, packed=True)
    h, ids, w = batch(torch.bfloat16)
    scratch = int((experts_per_chunk + 0.5) * ex.decoded_bytes_per_expert())
    got = GroupedExperts(scratch)(h, ids, w, ex, ACT)
    torch.testing.assert_close(got, GroupedExperts(2**30)(h, ids, w, ex, ACT), rtol=0, atol=0)


def test_bad_dtype_and_missing_op_are_clear_errors(monkeypatch) -> None:
    ex = experts(torch.float32, packed=False)
    h, ids, w = batch(torch.float32)
    with pytest.raises(ValueError, match="input torch.bfloat16, experts torch.float32"):
        get_backend("grouped")(h.bfloat16(), ids, w, ex, ACT)
    with pytest.raises(ValueError, match="positive byte count"):
        GroupedExperts(0)
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(ValueError, match=f"no {torch_api.GROUPED_MM}"):
        get_backend("grouped")


# -- every tail and dtype on a TP-2 gloo group, grouped next to torch ----------------------------

JOB_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENS = (1, 33, 257)


def _rank_jobs(comm: Collectives, ckpts: dict[str, str]) -> dict:
    out = {}
    for ck, path in ckpts.items():
        cfg = LatentMoEConfig.from_pretrained(path)
        for dname, dtype in JOB_DTYPES.items():
            for tail in TAILS:
                runner = build_rank_runners(path, cfg, [LAYER], comm, TailPlan.single(tail, "test"),
                                            dtype=dtype, backend="grouped")[LAYER]
                out[(ck, dname, tail, "checks")] = [c.to_dict() for c in runner.backend_checks]
                for T in TOKENS:
                    out[(ck, dname, tail, T)] = {"out": runner.forward(make_input(T, cfg.hidden_size, dtype))}
    return out


@pytest.fixture(scope="module")
def tp2_results(make_ckpt):
    ckpts = {"base": str(make_ckpt()), "mxfp4": str(make_ckpt(mxfp4=True))}
    return ckpts, run_local_group(2, _rank_jobs, ckpts, timeout_s=240.0)


@pytest.mark.parametrize("ck", ["base", "mxfp4"])
@pytest.mark.parametrize("dname", list(JOB_DTYPES))
@pytest.mark.parametrize("tail", TAILS)
def test_grouped_backend_every_tail_matches_reference(tp2_results, ck, dname, tail) -> None:
    ckpts, results = tp2_results
    for r in range(2):
        (check,) = results[r][(ck, dname, tail, "checks")]
        assert check["backend"] == "grouped" and check["passed"] and check["rel_err"] <= check["tolerance"]
    for T in TOKENS:
        got = gather_output(results, (ck, dname, tail, T), tail, 2, T)
        assert_matches_reference(got, reference(ckpts[ck], JOB_DTYPES[dname], T))
