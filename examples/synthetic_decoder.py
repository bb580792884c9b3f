"""The non-MoE half of a small K3-like decoder: config fields, tensor names and random weights.

The attention-FFN disaggregation demo (``examples/afd.py``) runs these tensors on the
client and calls the MoE tier for every MoE layer. Names follow the Hugging Face layout of the
checkpoint's MoE blocks: K3 layout (``language_model.`` prefix, config under ``text_config``)
or text-only (``model.`` prefix, ``lm_head.weight`` at top level):

* ``{root}embed_tokens.weight`` ``[V, H]``; ``{root}norm.weight`` ``[H]``; LM head ``[V, H]``
* per layer ``{root}layers.{i}.``: ``input_layernorm.weight`` and ``post_attention_layernorm.weight``
  ``[H]``; ``self_attn.{q,k,v,o}_proj.weight`` (``[heads*hd, H]``, ``[kv*hd, H]`` twice,
  ``[H, heads*hd]``): a plain GQA stand-in for K3's own KDA/MLA attention
* per dense layer (``i < first_k_dense_replace`` or off ``moe_layer_freq``):
  ``mlp.{gate,up}_proj.weight`` ``[Id, H]``, ``mlp.down_proj.weight`` ``[H, Id]`` (``Id = intermediate_size``)

The extra tensors go to their own file, ``model-decoder.safetensors``, listed in
``model.safetensors.index.json`` (created from ``model.safetensors`` when the checkpoint was a
single file), so the MoE side's loaders never see a change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_runtime.checkpoint import INDEX_FILE, SINGLE_FILE
from moe_runtime.config import LatentMoEConfig
from moe_runtime.units import torch_dtype

DECODER_FILE = "model-decoder.safetensors"
DECODER_FIELDS = ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                  "intermediate_size")


def decoder_defaults(hidden_size: int) -> dict[str, Any]:
    """Decoder fields for a model of width ``hidden_size`` (tiny: 4 heads of 32, small: 16 of 128)."""
    head_dim = 32 if hidden_size <= 512 else 128
    heads = max(1, hidden_size // head_dim)
    return {
        "vocab_size": 512 if hidden_size <= 512 else 8192,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4 if heads >= 8 else heads // 2),
        "head_dim": head_dim,
        "rope_theta": 10000.0,
        "intermediate_size": 2 * hidden_size,
    }


@dataclass(frozen=True)
class DecoderLayout:
    """Where the decoder's tensors live in a checkpoint (K3 or text-only layout)."""

    k3: bool = True

    @property
    def root(self) -> str:
        return "language_model." if self.k3 else "model."

    @property
    def embed(self) -> str:
        return self.root + "embed_tokens.weight"

    @property
    def final_norm(self) -> str:
        return self.root + "norm.weight"

    @property
    def lm_head(self) -> str:
        return "language_model.lm_head.weight" if self.k3 else "lm_head.weight"

    def layer(self, i: int, name: str) -> str:
        return f"{self.root}layers.{i}.{name}.weight"


ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def check_decoder_fields(text: dict[str, Any]) -> None:
    """``ValueError`` naming what is missing or inconsistent among the decoder fields."""
    missing = [f for f in DECODER_FIELDS if f not in text]
    if missing:
        raise ValueError(f"config.json lacks decoder field(s) {missing}; write them with "
                         "scripts/make_checkpoint.py --decoder")
    for f in DECODER_FIELDS:
        kind = int | float if f == "rope_theta" else int
        if not isinstance(text[f], kind) or isinstance(text[f], bool) or text[f] <= 0:
            what = "number" if f == "rope_theta" else "integer"
            raise ValueError(f"decoder field {f} must be a positive {what}, got {text[f]!r}")
    heads, kv, hd = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    if heads % kv:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv} "
                         f"({heads} % {kv} = {heads % kv}): GQA shares each KV head by a whole group")
    if hd % 2:
        raise ValueError(f"head_dim {hd} must be even for RoPE (pairs of dimensions rotate together)")


def decoder_tensors(
    cfg: LatentMoEConfig, fields: dict[str, Any], layout: DecoderLayout, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Random decoder weights, scaled so activations stay O(1) through the residual stream."""
    gen = torch.Generator().manual_seed(seed * 100_003 + 99_991)
    H, V, Id = cfg.hidden_size, fields["vocab_size"], fields["intermediate_size"]
    q_out = fields["num_attention_heads"] * fields["head_dim"]
    kv_out = fields["num_key_value_heads"] * fields["head_dim"]

    def rand(*shape: int, scale: float | None = None) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * (scale or shape[-1] ** -0.5)).to(dtype)

    def norm() -> torch.Tensor:
        return (1 + torch.randn(H, generator=gen) * 0.1).to(dtype)

    out = {layout.embed: rand(V, H, scale=1.0), layout.final_norm: norm(), layout.lm_head: rand(V, H)}
    for i in range(cfg.num_hidden_layers):
        for name in NORMS:
            out[layout.layer(i, name)] = norm()
        for name, shape in zip(ATTENTION, ((q_out, H), (kv_out, H), (kv_out, H), (H, q_out)), strict=True):
            out[layout.layer(i, name)] = rand(*shape)
        if not cfg.is_moe_layer(i):
            for name, shape in zip(DENSE_MLP, ((Id, H), (Id, H), (H, Id)), strict=True):
                out[layout.layer(i, name)] = rand(*shape)
    return out


def write_decoder(checkpoint: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Add the decoder fields to ``config.json`` and the decoder tensors to the checkpoint.

    ``overrides`` replace :func:`decoder_defaults` (fields already in ``config.json`` win over
    the defaults too). Returns the written safetensors file.
    """
    root = Path(checkpoint)
    config_path = root / "config.json"
    doc = json.loads(config_path.read_text())
    cfg = LatentMoEConfig.from_dict(doc)
    k3 = isinstance(doc.get("text_config"), dict)
    text = doc["text_config"] if k3 else doc
    fields = {**decoder_defaults(cfg.hidden_size), **{f: text[f] for f in DECODER_FIELDS if f in text},
              **overrides}
    check_decoder_fields(fields)
    text.update(fields)
    index_path = root / INDEX_FILE
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    elif (root / SINGLE_FILE).is_file():
        with safe_open(root / SINGLE_FILE, "pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), SINGLE_FILE)}
    else:
        raise ValueError(f"{root} holds neither {SINGLE_FILE} nor {INDEX_FILE}: write the MoE layers first")
    tensors = decoder_tensors(cfg, fields, DecoderLayout(k3), torch_dtype(cfg.torch_dtype), seed)
    save_file(tensors, root / DECODER_FILE, metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, DECODER_FILE))
    index_path.write_text(json.dumps(index, indent=1) + "\n")
    config_path.write_text(json.dumps(doc, indent=2) + "\n")
    return root / DECODER_FILE
