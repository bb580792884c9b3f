"""ExpertWeights (dense or MXFP4-packed) and the torch experts backend's chunked decode."""

from __future__ import annotations

import re

import pytest
import torch

from moe_runtime import mxfp4
from moe_runtime.activation import GatedActivation
from moe_runtime.experts import TorchExperts, get_backend
from moe_runtime.weights import ExpertWeights

E, I, D, T, K = 6, 64, 96, 40, 3
ACT = GatedActivation(4.0, 25.0)


def _packed_and_dense(dtype: torch.dtype) -> tuple[ExpertWeights, ExpertWeights]:
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, D, generator=gen) * D**-0.5
    w2 = torch.randn(E, D, I, generator=gen) * I**-0.5
    (p13, s13), (p2, s2) = mxfp4.encode(w13), mxfp4.encode(w2)
    packed = ExpertWeights(p13, p2, s13, s2, dtype=dtype)
    dense = ExpertWeights(mxfp4.decode(p13, s13, dtype), mxfp4.decode(p2, s2, dtype), dtype=dtype)
    return packed, dense


def _batch(dtype: torch.dtype, num_experts: int = E):
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(T, D, generator=gen).to(dtype)
    # experts 0..num_experts-1 only: with num_experts < E some experts stay inactive
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    return h, ids, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts_per_chunk", [1, 2, E])
def test_packed_equals_decoded_for_any_chunking(dtype, experts_per_chunk) -> None:
    packed, dense = _packed_and_dense(dtype)
    h, ids, weights = _batch(dtype, num_experts=5)
    scratch_bytes = int((experts_per_chunk + 0.5) * packed.decoded_bytes_per_expert())
    got = TorchExperts(scratch_bytes, packed="decode")(h, ids, weights, packed, ACT)
    ref = TorchExperts()(h, ids, weights, dense, ACT)
    # Same decode function, so the same weight bits, and the same per-expert GEMMs on the same
    # rows in the same order: the results are bit-identical, no tolerance is needed.
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_decode_returns_only_the_requested_experts() -> None:
    packed, dense = _packed_and_dense(torch.bfloat16)
    ids = torch.tensor([4, 1])
    for got, ref in zip(packed.decode(ids), dense.decode(ids), strict=True):
        assert got.shape[0] == 2 and got.dtype == torch.bfloat16
        assert torch.equal(got, ref)
    assert (packed.num_experts, packed.intermediate_size, packed.latent_size) == (E, I, D)
    assert (dense.num_experts, dense.intermediate_size, dense.latent_size) == (E, I, D)
    # packed holds 4.25 bits per weight (nibble + one scale byte per 32), dense 16
    assert packed.nbytes() == E * 3 * I * D * 17 // 32
    assert dense.nbytes() == E * 3 * I * D * 2


def test_act_quant_is_applied_to_expert_inputs_and_activations() -> None:
    _, dense = _packed_and_dense(torch.float32)
    h, ids, weights = _batch(torch.float32)
    seen: list[tuple[int, ...]] = []

    def to_bf16(t: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(t.shape))
        return t.to(torch.bfloat16).to(t.dtype)

    got = TorchExperts()(h, ids, weights, dense, ACT, act_quant=to_bf16)
    assert seen[0] == (T, D)  # the expert input rows, once
    assert all(s[1] == I for s in seen[1:]) and len(seen) == 1 + E  # each expert's activation
    # reference: quantise h up front, and the activation inside the expert
    ref = torch.zeros(T, D)
    hq = h.to(torch.bfloat16).float()
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            gu = dense.w13[e] @ hq[t]
            a = ACT(gu[:I], gu[I:]).to(torch.bfloat16).float()
            ref[t] += weights[t, k] * (dense.w2[e] @ a)
    # fp32 GEMMs in a different association (rows at once vs one token): a few fp32 ulps
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, TorchExperts()(h, ids, weights, dense, ACT), rtol=0, atol=1e-6)


def test_bad_scratch_and_bad_expert_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="scratch budget must be a positive byte count, got 0"):
        get_backend("torch", scratch_bytes=0)
    packed, dense = _packed_and_dense(torch.float32)
    with pytest.raises(ValueError, match="need both w13_scale and w2_scale"):
        ExpertWeights(packed.w13, packed.w2, packed.w13_scale, None)
    with pytest.raises(ValueError, match=re.escape("experts' w2_scale has shape (6, 96, 1), expected (6, 96, 2)")):
        ExpertWeights(packed.w13, packed.w2, packed.w13_scale, packed.w2_scale[..., :1])
    with pytest.raises(ValueError, match="dense experts' w13 is torch.float32, expected the compute torch.bfloat16"):
        ExpertWeights(dense.w13, dense.w2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="packed experts' w13 must be uint8"):
        ExpertWeights(dense.w13, packed.w2, packed.w13_scale, packed.w2_scale)


def test_nan_scale_bytes_are_refused_when_the_experts_are_built() -> None:
    # E8M0 byte 255 is NaN: caught once, at load, so forwards decode without scanning scales.
    packed, _ = _packed_and_dense(torch.float32)
    corrupt = packed.w2_scale.clone()
    corrupt[2, 5, 0] = 255
    with pytest.raises(ValueError, match="MXFP4 experts' w2_scale byte 255 encodes NaN"):
        ExpertWeights(packed.w13, packed.w2, packed.w13_scale, corrupt)
