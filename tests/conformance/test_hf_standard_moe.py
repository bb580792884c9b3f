"""Conformance of ``moe_runtime.standard`` with Hugging Face's own MoE blocks, on CPU.

A tiny ``Qwen3MoeForCausalLM`` / ``DeepseekV3ForCausalLM`` is built by transformers with random
weights (the DeepSeek correction bias made random too, so that it changes choices) and written
with ``save_pretrained``; our layer reads that folder (config.json and safetensors as HF wrote
them) and runs on the same input as HF's ``Qwen3MoeSparseMoeBlock`` / ``DeepseekV3MoE`` of the
model in memory.

Opt-in lane (``scripts/test.sh --vllm``, whose venv brings transformers; docs/conformance.md):
skipped where transformers does not import.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="HF conformance lane: run scripts/test.sh --vllm")

from transformers import (  # noqa: E402
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from moe_runtime.standard.config import load_standard_config  # noqa: E402
from moe_runtime.standard.layer import standard_moe_forward  # noqa: E402
from moe_runtime.standard.weights import load_standard_layer  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             initializer_range=0.1)


def _qwen3(norm_topk_prob: bool):
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **SMALL, num_key_value_heads=1, head_dim=32, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=norm_topk_prob))


def _deepseek(norm_topk_prob: bool):
    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        **SMALL, num_key_value_heads=2, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, scoring_func="sigmoid", topk_method="noaux_tc"))
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return model


# Bounds on max|ours - theirs| / rms(theirs). fp32: both sides compute the same sums in fp32, in
# other orders at most (measured: Qwen3 bit-identical, DeepSeek-V3 1.3e-7 of max|out|), so 1e-5.
# bf16: HF rounds the weighted expert outputs and their index_add to bf16 where we keep fp32, so
# each side is within the float64 oracle's bf16 bound of tests/test_standard_moe.py (32u of rms)
# and the two within twice that, 64u = 12.5 % of rms (measured: 0.5 % of max|out|).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 * 32 * 2.0**-9}


def _compare(model, tmp_path, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = model.to(dtype).eval()
    model.save_pretrained(tmp_path)
    cfg = load_standard_config(tmp_path)
    layer = cfg.moe_layers[-1]
    w = load_standard_layer(tmp_path, cfg, layer, dtype)
    x = torch.randn(1, 96, cfg.hidden_size).to(dtype)
    with torch.no_grad():
        theirs = model.model.layers[layer].mlp(x)[0].float()
    ours = standard_moe_forward(x[0], w, cfg).float()
    rms = theirs.pow(2).mean().sqrt().item()
    assert (ours - theirs).abs().max().item() <= TOLERANCE[dtype] * rms


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_matches_hf_sparse_moe_block(tmp_path, norm_topk_prob: bool) -> None:
    torch.manual_seed(1)
    _compare(_qwen3(norm_topk_prob), tmp_path, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_moe_matches_hf_deepseek_v3_moe(tmp_path, dtype: torch.dtype, norm_topk_prob: bool) -> None:
    torch.manual_seed(2)
    _compare(_deepseek(norm_topk_prob), tmp_path, dtype)
