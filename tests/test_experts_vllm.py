"""The optional ``vllm`` experts backend, on the CPU: what it can check without vLLM or a GPU.

vLLM's kernels never run here (no GPU in CI): a stand-in ``fused_experts`` records what the
backend passes and computes the experts with the torch backend's math, so the shapes, the
layouts (gate rows before up rows), the activation's name and the errors are what is tested.
Its numbers on a GPU come from scripts/gpu_check.sh.
"""

from __future__ import annotations

import enum
import sys
import types

import pytest
import torch

from moe_runtime import mxfp4
from moe_runtime.activation import GatedActivation
from moe_runtime.experts import TorchExperts, get_backend, planned_backends, unavailable_reason, vllm_fused
from moe_runtime.weights import ExpertWeights

SITU = GatedActivation(4.0, 25.0)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in vLLM whose ``fused_experts`` computes with the torch backend and records its call."""
    calls = []

    class MoEActivation(enum.Enum):
        SILU = "silu"
        GELU = "gelu"
        SILU_NO_MUL = "silu_no_mul"

    def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", quant_config=None):
        calls.append(dict(w1=w1, w2=w2, topk_ids=topk_ids, topk_weights=topk_weights, activation=activation,
                          quant_config=quant_config))
        if quant_config is None:
            experts = ExpertWeights(w1, w2, dtype=hidden_states.dtype)
        else:
            experts = ExpertWeights(w1, w2, quant_config["w1_scale"], quant_config["w2_scale"],
                                    dtype=hidden_states.dtype)
        out = TorchExperts(packed="decode")(hidden_states, topk_ids.long(), topk_weights, experts, GatedActivation())
        return out.to(hidden_states.dtype)

    root = "vllm.model_executor.layers.fused_moe"
    modules = {root: types.SimpleNamespace(fused_experts=fused_experts),
               f"{root}.activation": types.SimpleNamespace(MoEActivation=MoEActivation),
               f"{root}.config": types.SimpleNamespace(mxfp4_w4a16_moe_quant_config=lambda **k: k)}
    monkeypatch.setattr(vllm_fused, "_module", lambda name: modules[name])
    monkeypatch.setattr(vllm_fused, "vllm_unavailable_reason", lambda: None)
    return calls, modules


def _case(packed: bool, E=5, I=32, D=64, T=7, K=2):
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, D, generator=gen) * D**-0.5, torch.randn(E, D, I, generator=gen) * I**-0.5
    if packed:
        (p13, s13), (p2, s2) = mxfp4.encode(w13), mxfp4.encode(w2)
        experts = ExpertWeights(p13, p2, s13, s2, dtype=torch.bfloat16)
    else:
        experts = ExpertWeights(w13.bfloat16(), w2.bfloat16(), dtype=torch.bfloat16)
    h = torch.randn(T, D, generator=gen).bfloat16()
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    weights = torch.rand(T, K, generator=gen)
    return h, ids, weights / weights.sum(1, keepdim=True), experts


def test_unavailable_without_a_cuda_gpu_or_vllm(monkeypatch) -> None:
    vllm_fused.vllm_unavailable_reason.cache_clear()
    try:
        if not torch.cuda.is_available():
            assert "needs a CUDA GPU" in unavailable_reason("vllm")
            with pytest.raises(ValueError, match="needs a CUDA GPU"):
                get_backend("vllm")
        vllm_fused.vllm_unavailable_reason.cache_clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setitem(sys.modules, "vllm", None)  # importing it raises ImportError
        assert vllm_fused.vllm_unavailable_reason().startswith("vLLM's fused MoE is not importable: ModuleNotFound")
    finally:
        vllm_fused.vllm_unavailable_reason.cache_clear()
    # never planned for CPU ranks, and auto never tries it: a deployment names it
    assert "vllm" not in planned_backends("auto", "cpu") + planned_backends("auto", "gpu")


@pytest.mark.parametrize("packed", [False, True])
def test_shapes_layouts_and_result_match_the_torch_backend(fake_vllm, packed) -> None:
    calls, _ = fake_vllm
    h, ids, weights, experts = _case(packed)
    got = vllm_fused.VllmExperts()(h, ids, weights, experts, GatedActivation())
    ref = TorchExperts(packed="decode")(h, ids, weights, experts, GatedActivation())
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # vLLM sums the K slots in bf16: a few bf16 ulps of max|L| (experts.check's 2e-2 bounds it)
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()
    (call,) = calls
    assert call["w1"] is experts.w13 and call["w2"] is experts.w2  # [E, 2I, D], gate rows first; [E, D, I]
    assert call["topk_ids"].dtype == torch.int32 and call["topk_weights"].dtype == torch.float32
    assert call["activation"] == "silu"
    if packed:
        assert call["quant_config"]["w1_scale"] is experts.w13_scale
        assert call["quant_config"]["w2_scale"] is experts.w2_scale
    else:
        assert call["quant_config"] is None


def test_situ_needs_a_vllm_that_names_it(fake_vllm) -> None:
    calls, modules = fake_vllm
    h, ids, weights, experts = _case(False)
    with pytest.raises(ValueError, match=r"activations are \['silu', 'gelu'\]; the layer's SiTU \(beta 4.0"):
        vllm_fused.VllmExperts()(h, ids, weights, experts, SITU)
    assert vllm_fused.activation_name(SITU, ["silu", "situ"]) == "situ"
    # a vLLM that names situ but whose fused_experts takes no betas is refused, not run without them
    situ_enum = enum.Enum("MoEActivation", {"SILU": "silu", "SITU": "situ"})
    modules["vllm.model_executor.layers.fused_moe.activation"] = types.SimpleNamespace(MoEActivation=situ_enum)
    with pytest.raises(ValueError, match=r"takes no \['beta', 'beta_lin'\]"):
        vllm_fused.VllmExperts()(h, ids, weights, experts, SITU)
    assert not calls


def test_a_vllm_that_takes_the_activation_enum_gets_it(fake_vllm) -> None:
    calls, modules = fake_vllm
    MoEActivation = modules["vllm.model_executor.layers.fused_moe.activation"].MoEActivation  # noqa: N806
    plain = modules["vllm.model_executor.layers.fused_moe"].fused_experts

    def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation: MoEActivation = None,
                      quant_config=None):
        assert isinstance(activation, MoEActivation)
        return plain(hidden_states, w1, w2, topk_weights, topk_ids, activation.value, quant_config)

    modules["vllm.model_executor.layers.fused_moe"] = types.SimpleNamespace(fused_experts=fused_experts)
    h, ids, weights, experts = _case(False)
    vllm_fused.VllmExperts()(h, ids, weights, experts, GatedActivation())
    assert calls[-1]["activation"] == "silu"


def test_inputs_it_refuses(fake_vllm) -> None:
    h, ids, weights, experts = _case(False)
    backend = vllm_fused.VllmExperts()
    with pytest.raises(ValueError, match="no MXFP4 activation fake-quant"):
        backend(h, ids, weights, experts, GatedActivation(), act_quant=mxfp4.quantize_dequantize)
    with pytest.raises(ValueError, match="input in the experts' dtype; got input torch.float32"):
        backend(h.float(), ids, weights, experts, GatedActivation())
    assert vllm_fused.vllm_activations() == ["silu", "gelu"]  # the _no_mul ones are not gated


def test_activations_of_a_vllm_without_the_enum(monkeypatch) -> None:
    def missing(name):
        raise ImportError(name)

    monkeypatch.setattr(vllm_fused, "_module", missing)
    assert vllm_fused.vllm_activations() == ["silu"]
