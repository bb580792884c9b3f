"""Tiny Qwen3-MoE and DeepSeek-V3 model folders with random MoE weights (tests, demos).

A folder holds ``config.json`` and, under Hugging Face names, the MoE-layer tensors only (the
attention and dense layers a full model would carry are not written). From the command line:
``python -m moe_runtime.standard.synthetic --family qwen3_moe --out checkpoints/qwen3-tiny``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import INDEX_FILE, SINGLE_FILE
from ..synthetic import Planned, write_safetensors
from ..units import torch_dtype
from .config import DEEPSEEK_V3, QWEN3_MOE, config_from_dict

PRESETS: dict[str, dict[str, Any]] = {
    QWEN3_MOE: dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                    num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=[0], hidden_act="silu",
                    dtype="float32"),
    # 16 experts in 4 groups of 4, the best 2 groups eligible; 2 shared experts; layer 0 dense.
    DEEPSEEK_V3: dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=64,
                      moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                      n_shared_experts=2, routed_scaling_factor=2.5, n_group=4, topk_group=2,
                      norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
                      num_hidden_layers=3, first_k_dense_replace=1, moe_layer_freq=1, hidden_act="silu",
                      dtype="float32"),
}


def standard_preset(family: str, **overrides: Any) -> dict[str, Any]:
    """A tiny config.json dict of ``family`` (``qwen3_moe`` | ``deepseek_v3``) with overrides."""
    if family not in PRESETS:
        raise ValueError(f"unknown family {family!r}; known: {sorted(PRESETS)}")
    return {**PRESETS[family], **overrides}


def write_standard_checkpoint(
    out_dir: str | Path, raw_config: dict[str, Any], *, seed: int = 0, single_file: bool = False,
    bias_scale: float = 0.1,
) -> Path:
    """Write ``config.json`` and every MoE layer's tensors in the config's ``dtype``: one
    ``model.safetensors``, or one file per layer plus ``model.safetensors.index.json``. Router
    rows and expert matrices are Gaussians scaled by 1/sqrt(fan-in); the correction bias (DeepSeek)
    is Gaussian with std ``bias_scale``, enough to change some choices."""
    cfg = config_from_dict(raw_config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    dtype = torch_dtype(cfg.dtype or "float32")
    H, I, E, Is = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.shared_intermediate_size
    files: dict[str, list[Planned]] = {}
    for layer in cfg.moe_layers:  # tiny folders: each layer's tensors are made up front
        gen = torch.Generator().manual_seed(seed * 100_003 + layer)
        p = f"model.layers.{layer}.mlp."
        shapes = {"gate.weight": (E, H)}
        mlp = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
        shapes.update({f"experts.{e}.{proj}.weight": shape for e in range(E) for proj, shape in mlp.items()})
        if Is:
            shared = {"gate_proj": (Is, H), "up_proj": (Is, H), "down_proj": (H, Is)}
            shapes.update({f"shared_experts.{proj}.weight": shape for proj, shape in shared.items()})
        made = {p + name: (torch.randn(*shape, generator=gen) * shape[1] ** -0.5).to(dtype)
                for name, shape in shapes.items()}
        if cfg.has_correction_bias:  # fp32, as DeepSeek-V3 and Kimi-K2 ship it
            made[p + "gate.e_score_correction_bias"] = torch.randn(E, generator=gen) * bias_scale
        file = SINGLE_FILE if single_file else f"model-layer-{layer:05d}.safetensors"
        files.setdefault(file, []).extend(
            (name, t.dtype, tuple(t.shape), lambda t=t: t) for name, t in made.items())
    for name, items in files.items():
        write_safetensors(out / name, items)
    if not single_file:
        weight_map = {item[0]: name for name, items in files.items() for item in items}
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a tiny random Qwen3-MoE or DeepSeek-V3 model folder.")
    ap.add_argument("--family", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the weights' dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--single-file", action="store_true", help="one model.safetensors, no index")
    args = ap.parse_args(argv)
    raw = standard_preset(args.family, dtype=args.dtype)
    out = write_standard_checkpoint(args.out, raw, seed=args.seed, single_file=args.single_file)
    cfg = config_from_dict(raw)
    print(f"wrote a {args.family} model folder to {out}: hidden_size {cfg.hidden_size}, "
          f"MoE layers {cfg.moe_layers}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
