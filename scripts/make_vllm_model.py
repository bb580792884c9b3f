"""Write a tiny Qwen3-MoE-shaped model folder that vLLM loads, for the vLLM plugin (docs/vllm.md).

Random weights for everything vLLM keeps (embeddings, attention, the dense first layer, norms,
head), and for the MoE blocks' gate and experts as a real checkpoint has them (the plugin's model
skips those: the tier serves its own); ``config.json`` names the plugin's alias
``LatentMoeQwen3MoeForCausalLM``. A word-level tokenizer of ``--vocab`` words (``w0`` ...)
comes with it, so ``vllm serve`` answers text. Its ``hidden_size`` matches the tier checkpoint
it pairs with (``scripts/make_checkpoint.py --preset tiny``: 128; MoE layers 1 and 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ALIAS = "LatentMoeQwen3MoeForCausalLM"


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


def weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, V, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]

    def rand(*shape: int) -> torch.Tensor:
        # Fan-in scaled, so activations keep their size through the stack and logits are not flat.
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

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
            out |= {f"{p}.mlp.gate_proj.weight": rand(inter, H), f"{p}.mlp.up_proj.weight": rand(inter, H),
                    f"{p}.mlp.down_proj.weight": rand(H, inter)}
        else:  # a real checkpoint's MoE tensors, which the plugin's model must skip on load
            E, Im = cfg["num_experts"], cfg["moe_intermediate_size"]
            out[f"{p}.mlp.gate.weight"] = rand(E, H)
            for e in range(E):
                x = f"{p}.mlp.experts.{e}"
                out |= {f"{x}.gate_proj.weight": rand(Im, H), f"{x}.up_proj.weight": rand(Im, H),
                        f"{x}.down_proj.weight": rand(H, Im)}
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3, help="num_hidden_layers; layer 0 is dense, the rest MoE")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    heads, head_dim = 4, args.hidden_size // 4
    if args.hidden_size % 8 or args.layers < 2 or args.vocab < 8:
        raise SystemExit(f"error: need hidden_size % 8 == 0 (got {args.hidden_size}), layers >= 2 "
                         f"(got {args.layers}) and vocab >= 8 (got {args.vocab})")
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = config(args.hidden_size, args.layers, args.vocab, heads, head_dim)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(weights(cfg, args.seed), str(args.out / "model.safetensors"))
    write_tokenizer(args.out, args.vocab)
    print(f"{args.out}: {ALIAS}, hidden {args.hidden_size}, {args.layers} layers "
          f"(MoE: 1..{args.layers - 1}), vocab {args.vocab}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
