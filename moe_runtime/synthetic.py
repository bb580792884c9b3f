"""Deterministic Kimi-K3-format checkpoints with random weights, for tests, demos and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from . import mxfp4
from .checkpoint import INDEX_FILE, SINGLE_FILE, torch_dtype
from .config import LatentMoEConfig

_K3_COMMON: dict[str, Any] = {
    "routed_scaling_factor": 1.0,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "use_grouped_topk": False,
    "num_expert_group": 1,
    "topk_group": 1,
    "latent_moe_use_norm": True,
    "rms_norm_eps": 1e-5,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "torch_dtype": "bfloat16",
}

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds to write; sizes divide TP 2/4/8 and MXFP4 blocks at TP 2.
    "tiny": dict(
        _K3_COMMON,
        hidden_size=128,
        routed_expert_hidden_size=64,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=64,
        num_shared_experts=1,
        num_hidden_layers=3,
    ),
    # ~120 MB per MoE layer in bf16: CPU benchmarks with K3's H/D = 2 ratio.
    "small": dict(
        _K3_COMMON,
        hidden_size=2048,
        routed_expert_hidden_size=1024,
        num_experts=32,
        num_experts_per_token=4,
        moe_intermediate_size=512,
        num_shared_experts=2,
        num_hidden_layers=2,
    ),
    "kimi-k3": dict(
        _K3_COMMON,
        hidden_size=7168,
        routed_expert_hidden_size=3584,
        num_experts=896,
        num_experts_per_token=16,
        moe_intermediate_size=3072,
        num_shared_experts=2,
        num_hidden_layers=92,
    ),
}


def preset_config(preset: str, **overrides: Any) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    raw = dict(PRESETS[preset], **overrides)
    LatentMoEConfig.from_dict(raw)  # validate before anything is written
    return raw


def _layer_tensors(
    cfg: LatentMoEConfig, layer: int, prefix: str, dtype: torch.dtype, use_mxfp4: bool, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    H, D, E, I, Is = (
        cfg.hidden_size,
        cfg.routed_expert_hidden_size,
        cfg.num_experts,
        cfg.moe_intermediate_size,
        cfg.shared_intermediate_size,
    )

    def rand(*shape: int, scale: float | None = None) -> torch.Tensor:
        std = scale if scale is not None else shape[-1] ** -0.5  # keeps activations O(1)
        return torch.randn(*shape, generator=gen) * std

    p = prefix.format(i=layer)
    out = {
        p + "gate.weight": rand(E, H).float(),
        p + "gate.e_score_correction_bias": rand(E, scale=0.05).float(),
        p + "routed_expert_down_proj.weight": rand(D, H).to(dtype),
        p + "routed_expert_up_proj.weight": rand(H, D).to(dtype),
    }
    if cfg.latent_moe_use_norm:
        out[p + "routed_expert_norm.weight"] = (1 + rand(D, scale=0.1)).to(dtype)
    for e in range(E):
        for name, shape in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            w = rand(*shape)
            key = f"{p}experts.{e}.{name}."
            if use_mxfp4:
                out[key + "weight_packed"], out[key + "weight_scale"] = mxfp4.encode(w)
            else:
                out[key + "weight"] = w.to(dtype)
    if Is:
        out[p + "shared_experts.gate_proj.weight"] = rand(Is, H).to(dtype)
        out[p + "shared_experts.up_proj.weight"] = rand(Is, H).to(dtype)
        out[p + "shared_experts.down_proj.weight"] = rand(H, Is).to(dtype)
    return out


def write_checkpoint(
    out_dir: str | Path,
    raw_config: dict[str, Any],
    *,
    use_mxfp4: bool = False,
    seed: int = 0,
    single_file: bool = False,
    text_only: bool = False,
    config_only: bool = False,
    progress: bool = False,
) -> Path:
    """Write ``config.json`` and the weights of every MoE layer; return the folder.

    K3 layout (``text_config`` + ``language_model.`` prefix) unless ``text_only``. Weights go
    to one ``model.safetensors`` or one file per layer plus ``model.safetensors.index.json``.
    """
    cfg = LatentMoEConfig.from_dict(raw_config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = dict(raw_config) if text_only else {"model_type": "kimi_k3", "text_config": dict(raw_config)}
    (out / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
    if config_only:
        return out
    prefix = (
        "model.layers.{i}.block_sparse_moe." if text_only else "language_model.layers.{i}.block_sparse_moe."
    )
    dtype = torch_dtype(cfg.torch_dtype)
    layers = cfg.moe_layers
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc="writing MoE layers", unit="layer")
    everything: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    for layer in layers:
        gen = torch.Generator().manual_seed(seed * 100_003 + layer)
        tensors = _layer_tensors(cfg, layer, prefix, dtype, use_mxfp4, gen)
        if single_file:
            everything.update(tensors)
            continue
        fname = f"model-layer-{layer:05d}.safetensors"
        save_file(tensors, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    if single_file:
        save_file(everything, out / SINGLE_FILE, metadata={"format": "pt"})
    else:
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1) + "\n")
    return out
