"""Write a tiny model folder that vLLM loads, for the vLLM plugin (docs/vllm.md).

``--arch qwen3`` (default): a Qwen3-MoE shape. Random weights for everything vLLM keeps
(embeddings, attention, the dense first layer, norms, head), and for the MoE blocks' gate and
experts as a real checkpoint has them (the plugin's model skips those: the tier serves its own);
``config.json`` names the plugin's alias ``LatentMoeQwen3MoeForCausalLM``. Its ``hidden_size``
matches the tier checkpoint it pairs with (``scripts/make_checkpoint.py --preset tiny``: 128; MoE
layers 1 and 2).

``--arch kimi_k3``: a Kimi-K3 shape (vLLM's ``kimi_k3`` config: KDA and MLA attention, latent
MoE) under the alias ``LatentMoeKimiK3ForConditionalGeneration``. Its MoE config and MoE tensors
are those of ``make_checkpoint.py --preset PRESET --seed SEED`` (same names, same values), so
vLLM's own Kimi-K3 model runs the very experts the tier serves; the text-only engine needs no
vision weights (``language_model_only=True``). Needs a GPU to run (vLLM's CPU backend has no KDA).

``--arch deepseek_v3``: a DeepSeek-V3 shape (MLA attention, dense layer 0, MoE layers of 8 routed
experts in 4 groups, the best 2 eligible, sigmoid scores with a correction bias, one shared expert,
routed scaling 2.5), bfloat16, under the alias ``LatentMoeDeepseekV3ForCausalLM``. Its MoE tensors
are ``moe_runtime.standard.synthetic``'s, so the folder is a whole DeepSeek-V3 that vLLM's own
``DeepseekV3ForCausalLM`` runs and the plugin's ``{"checkpoint": <this folder>}`` serves. vLLM's
CPU MLA backend takes only DeepSeek's latent cache (kv_lora_rank 512 + rope 64 = 576): those two
are full size, the other attention sizes small.

All come with a word-level tokenizer of ``--vocab`` words (``w0`` ...), so ``vllm serve``
answers text.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ALIAS = "LatentMoeQwen3MoeForCausalLM"
DEEPSEEK_ALIAS = "LatentMoeDeepseekV3ForCausalLM"
KIMI_ALIAS = "LatentMoeKimiK3ForConditionalGeneration"
ROOT = Path(__file__).resolve().parents[1]

# Kimi-K3's attention sizes. The MLA latent is DeepSeek's (kv_lora_rank 512 + rope 64 = 576), the
# one head size every CUDA MLA decode kernel takes; KDA's head_dim 128 with a width-4 convolution
# is what its fused kernels take (others fall back to Triton). They do not depend on hidden_size.
KIMI_ATTENTION = {
    "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
}
# DeepSeek-V3's: the latent cache full size (vLLM's CPU MLA decode kernel takes only 576), the rest small.
DEEPSEEK_ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
                      "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32}
KDA = {"num_heads": 2, "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
       "gate_lower_bound": -5.0}


def config(hidden: int, layers: int, vocab: int, heads: int, head_dim: int) -> dict:
    return {
        "architectures": [ALIAS], "model_type": "qwen3_moe", "torch_dtype": "float32",
        "hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab,
        "num_attention_heads": heads, "num_key_value_heads": heads // 2, "head_dim": head_dim,
        "intermediate_size": 2 * hidden, "mlp_only_layers": [0], "decoder_sparse_step": 1,
        # Read by vLLM's config checks only: the MoE blocks are the tier's.
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2,
        "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }


Rand = Callable[..., torch.Tensor]


def randoms(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Generator, Rand]:
    """A seeded generator and its random matrices in ``dtype``."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        # Fan-in scaled, so activations keep their size through the stack and logits are not flat.
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    return g, rand


def mlp(p: str, hidden: int, inter: int, rand: Rand) -> dict[str, torch.Tensor]:
    return {f"{p}.mlp.gate_proj.weight": rand(inter, hidden), f"{p}.mlp.up_proj.weight": rand(inter, hidden),
            f"{p}.mlp.down_proj.weight": rand(hidden, inter)}


def mla(a: str, t: dict, rand: Rand, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The MLA attention tensors under ``a`` (DeepSeek's names; Kimi-K3 adds an output gate)."""
    H, heads, q, kv, rope, nope, v = (t[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank",
                                                     "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                     "v_head_dim"))
    out = {f"{a}.q_a_proj.weight": rand(q, H), f"{a}.q_a_layernorm.weight": torch.ones(q, dtype=dtype),
           f"{a}.q_b_proj.weight": rand(heads * (nope + rope), q),
           f"{a}.kv_a_proj_with_mqa.weight": rand(kv + rope, H),
           f"{a}.kv_a_layernorm.weight": torch.ones(kv, dtype=dtype),
           f"{a}.kv_b_proj.weight": rand(heads * (nope + v), kv)}
    if t.get("mla_use_output_gate"):
        out[f"{a}.g_proj.weight"] = rand(heads * v, H)
    return out | {f"{a}.o_proj.weight": rand(H, heads * v)}


def weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g, rand = randoms(seed)
    H, V, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    out = {"model.embed_tokens.weight": torch.randn(V, H, generator=g), "model.norm.weight": torch.ones(H),
           "lm_head.weight": rand(V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        out |= {f"{p}.input_layernorm.weight": torch.ones(H),
                f"{p}.post_attention_layernorm.weight": torch.ones(H),
                f"{a}.q_proj.weight": rand(q, H), f"{a}.k_proj.weight": rand(kv, H),
                f"{a}.v_proj.weight": rand(kv, H), f"{a}.o_proj.weight": rand(H, q),
                f"{a}.q_norm.weight": torch.ones(hd), f"{a}.k_norm.weight": torch.ones(hd)}
        if i in cfg["mlp_only_layers"]:
            out |= mlp(p, H, inter, rand)
        else:  # a real checkpoint's MoE tensors, which the plugin's model must skip on load
            E, Im = cfg["num_experts"], cfg["moe_intermediate_size"]
            out[f"{p}.mlp.gate.weight"] = rand(E, H)
            for e in range(E):
                x = f"{p}.mlp.experts.{e}"
                out |= {f"{x}.gate_proj.weight": rand(Im, H), f"{x}.up_proj.weight": rand(Im, H),
                        f"{x}.down_proj.weight": rand(H, Im)}
    return out


def kimi_config(moe: dict, vocab: int) -> dict:
    """A Kimi-K3 ``config.json``: ``moe`` (a tier preset's config) as its text model's MoE, KDA
    attention in every layer but each fourth and the last, which are MLA (K3's 3:1 pattern)."""
    layers = moe["num_hidden_layers"]
    full = [i for i in range(1, layers + 1) if i % 4 == 0 or i == layers]  # 1-based, as vLLM reads them
    text = dict(moe) | KIMI_ATTENTION | {
        "model_type": "kimi_linear", "vocab_size": vocab, "intermediate_size": 2 * moe["hidden_size"],
        "linear_attn_config": KDA | {"kda_layers": [i for i in range(1, layers + 1) if i not in full],
                                     "full_attn_layers": full},
        "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0,
    }
    # The smallest vision tower, should an engine build one (a text-only engine does not).
    vision = {"vt_num_attention_heads": 2, "vt_num_hidden_layers": 1, "vt_hidden_size": 64,
              "vt_intermediate_size": 128, "qkv_hidden_size": 192}
    return {"architectures": [KIMI_ALIAS], "model_type": "kimi_k3", "torch_dtype": moe["torch_dtype"],
            "text_config": text, "vision_config": vision, "media_placeholder_token_id": vocab - 1,
            "pad_token_id": 0}


def kimi_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the text model, in the names a Kimi-K3 checkpoint uses. The MoE tensors are
    the tier checkpoint's (moe_runtime.synthetic with the same config and seed)."""
    sys.path.insert(0, str(ROOT))
    from moe_runtime.synthetic import write_checkpoint
    from moe_runtime.units import torch_dtype

    t = cfg["text_config"]
    dtype = torch_dtype(t["torch_dtype"])
    g, rand = randoms(seed, dtype)
    H, V, inter = t["hidden_size"], t["vocab_size"], t["intermediate_size"]
    kda = t["linear_attn_config"]
    proj, hd = kda["num_heads"] * kda["head_dim"], kda["head_dim"]

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    out = {"language_model.model.embed_tokens.weight": torch.randn(V, H, generator=g).to(dtype),
           "language_model.model.norm.weight": ones(H), "language_model.lm_head.weight": rand(V, H)}
    for i in range(t["num_hidden_layers"]):
        p = f"language_model.layers.{i}"
        a = f"{p}.self_attn"
        out |= {f"{p}.input_layernorm.weight": ones(H), f"{p}.post_attention_layernorm.weight": ones(H)}
        if i + 1 in kda["kda_layers"]:
            out |= {f"{a}.{n}.weight": rand(proj, H) for n in ("q_proj", "k_proj", "v_proj", "g_proj")}
            out |= {f"{a}.{n}_conv1d.weight": rand(proj, 1, kda["short_conv_kernel_size"]) for n in "qkv"}
            out |= {f"{a}.f_a_proj.weight": rand(hd, H), f"{a}.f_b_proj.weight": rand(proj, hd),
                    f"{a}.b_proj.weight": rand(kda["num_heads"], H), f"{a}.o_proj.weight": rand(H, proj),
                    f"{a}.o_norm.weight": ones(hd),
                    # Zero log-decay and bias: a gate of moderate strength in every head.
                    f"{a}.A_log": torch.zeros(kda["num_heads"]), f"{a}.dt_bias": torch.zeros(proj)}
        else:
            out |= mla(a, t, rand, dtype)
        if i < t["first_k_dense_replace"]:
            out |= mlp(p, H, inter, rand)
    with tempfile.TemporaryDirectory() as tmp:
        moe = write_checkpoint(tmp, t, seed=seed, single_file=True)
        out |= load_file(str(moe / "model.safetensors"))
    return out


def deepseek_config(hidden: int, layers: int, vocab: int) -> dict:
    return {
        "architectures": [DEEPSEEK_ALIAS], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
        "hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab, **DEEPSEEK_ATTENTION,
        "intermediate_size": 2 * hidden, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "moe_intermediate_size": hidden // 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        # Written out: vLLM reads an absent scoring_func as softmax, and adds the bias only under noaux_tc.
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "attention_bias": False, "num_nextn_predict_layers": 0, "bos_token_id": 1, "eos_token_id": 2,
    }


def deepseek_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the model in DeepSeek-V3's names; the MoE layers' (router, correction bias,
    experts, shared expert) from moe_runtime.standard.synthetic with the same seed."""
    sys.path.insert(0, str(ROOT))
    from moe_runtime.standard.synthetic import write_standard_checkpoint

    g, rand = randoms(seed, torch.bfloat16)
    H, V = cfg["hidden_size"], cfg["vocab_size"]

    def ones() -> torch.Tensor:
        return torch.ones(H, dtype=torch.bfloat16)

    out = {"model.embed_tokens.weight": torch.randn(V, H, generator=g).bfloat16(),
           "model.norm.weight": ones(), "lm_head.weight": rand(V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out |= {f"{p}.input_layernorm.weight": ones(), f"{p}.post_attention_layernorm.weight": ones()}
        out |= mla(f"{p}.self_attn", cfg, rand, torch.bfloat16)
        if i < cfg["first_k_dense_replace"]:
            out |= mlp(p, H, cfg["intermediate_size"], rand)
    with tempfile.TemporaryDirectory() as tmp:
        moe = write_standard_checkpoint(tmp, cfg, seed=seed, single_file=True)
        out |= load_file(str(moe / "model.safetensors"))
    return out


def write_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)


def write_kimi(out: Path, preset: str, layers: int, vocab: int, seed: int) -> dict:
    """The Kimi-K3 model folder; its config."""
    sys.path.insert(0, str(ROOT))
    from moe_runtime.synthetic import preset_config

    cfg = kimi_config(preset_config(preset, num_hidden_layers=layers), vocab)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(kimi_weights(cfg, seed), str(out / "model.safetensors"))
    write_tokenizer(out, vocab)
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--arch", choices=("qwen3", "deepseek_v3", "kimi_k3"), default="qwen3")
    ap.add_argument("--hidden-size", type=int, default=128, help="qwen3, deepseek_v3 (kimi_k3: the preset's)")
    ap.add_argument("--preset", default="tiny",
                    help="kimi_k3 only: the make_checkpoint.py preset whose MoE config and tensors it has")
    ap.add_argument("--layers", type=int, default=3, help="num_hidden_layers; layer 0 is dense, the rest MoE")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0, help="kimi_k3: also its MoE tensors' seed")
    args = ap.parse_args(argv)
    heads, head_dim = 4, args.hidden_size // 4
    if args.hidden_size % 8 or args.layers < 2 or args.vocab < 8:
        raise SystemExit(f"error: need hidden_size % 8 == 0 (got {args.hidden_size}), layers >= 2 "
                         f"(got {args.layers}) and vocab >= 8 (got {args.vocab})")
    if args.arch == "kimi_k3":
        cfg = write_kimi(args.out, args.preset, args.layers, args.vocab, args.seed)["text_config"]
        mla = cfg["linear_attn_config"]["full_attn_layers"]
        print(f"{args.out}: {KIMI_ALIAS}, hidden {cfg['hidden_size']}, {args.layers} layers (MoE: "
              f"1..{args.layers - 1}; MLA: {mla} 1-based, the rest KDA), vocab {args.vocab}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.arch == "deepseek_v3":
        cfg, write = deepseek_config(args.hidden_size, args.layers, args.vocab), deepseek_weights
    else:
        cfg, write = config(args.hidden_size, args.layers, args.vocab, heads, head_dim), weights
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(write(cfg, args.seed), str(args.out / "model.safetensors"))
    write_tokenizer(args.out, args.vocab)
    print(f"{args.out}: {cfg['architectures'][0]}, hidden {args.hidden_size}, {args.layers} layers "
          f"(MoE: 1..{args.layers - 1}), vocab {args.vocab}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
