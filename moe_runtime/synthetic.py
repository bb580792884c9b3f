"""Deterministic Kimi-K3-format checkpoints with random weights, for tests, demos and benchmarks.

Tensors are generated one at a time and streamed into safetensors files (written here, not
through ``save_file``, which needs every tensor of a file in memory), so even a real-size layer
(~16 GB) is written in a few hundred MB of memory.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from . import mxfp4
from .checkpoint import INDEX_FILE, SINGLE_FILE
from .config import LatentMoEConfig
from .units import SAFETENSORS_CODES, dtype_name, torch_dtype

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
    # ~20 MB per MoE layer as MXFP4 (~75 MB bf16): packed-vs-decoded tests at TP 1 and 2 with
    # real-looking ratios (H/D = 2, 8 of 64 experts); sizes divide TP 2 and MXFP4 blocks at TP 2.
    "medium": dict(
        _K3_COMMON,
        hidden_size=1024,
        routed_expert_hidden_size=512,
        num_experts=64,
        num_experts_per_token=8,
        moe_intermediate_size=384,
        num_shared_experts=2,
        num_hidden_layers=2,
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
    # The real model: 93 layers (layer 0 dense, 92 MoE), grouped top-k with one group.
    "kimi-k3": dict(
        _K3_COMMON,
        use_grouped_topk=True,
        hidden_size=7168,
        routed_expert_hidden_size=3584,
        num_experts=896,
        num_experts_per_token=16,
        moe_intermediate_size=3072,
        num_shared_experts=2,
        num_hidden_layers=93,
    ),
}


def preset_config(preset: str, **overrides: Any) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    raw = dict(PRESETS[preset], **overrides)
    LatentMoEConfig.from_dict(raw)  # validate before anything is written
    return raw


# A tensor to write: its name, dtype, shape, and how to make it (called once, in file order).
Planned = tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]


def random_mxfp4(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes and E8M0 scales whose values have std ~ cols**-0.5 (fan-in init).

    Used at real size instead of randn + encode (~10x faster). Uniform codes have
    E[v^2] = 68.5 / 8; each block's exponent is e0 or e0 + 1, the latter with the probability
    that makes E[v^2 * 4**e] = 1 / cols exactly.
    """
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
    var_code = 68.5 / 8
    target = 1.0 / (cols * var_code)  # wanted E[4**e]
    e0 = int(torch.floor(torch.log2(torch.tensor(target)) / 2))
    p_up = (target / 4.0**e0 - 1) / 3
    up = torch.rand(rows, cols // mxfp4.BLOCK, generator=gen) < p_up
    scale = (up.to(torch.uint8) + (127 + e0)).to(torch.uint8)
    return packed, scale


def _layer_plan(
    cfg: LatentMoEConfig,
    layer: int,
    prefix: str,
    dtype: torch.dtype,
    use_mxfp4: bool,
    gen: torch.Generator,
    random_codes: bool = False,
    shared_mxfp4: bool = False,
) -> Iterator[Planned]:
    """The layer's tensors in generation order (the order fixes the random stream)."""
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

    def dense(name: str, shape: tuple[int, ...], out: torch.dtype, **kw: Any) -> Planned:
        return name, out, shape, lambda: rand(*shape, **kw).to(out)

    def matrix(name: str, shape: tuple[int, int], packed: bool) -> Iterator[Planned]:
        if not packed:
            yield dense(name + "weight", shape, dtype)
            return
        rows, cols = shape
        pair: dict[str, torch.Tensor] = {}

        def make(part: str) -> torch.Tensor:
            if not pair:  # the scale is written right after its nibbles
                w = random_mxfp4(rows, cols, gen) if random_codes else mxfp4.encode(rand(rows, cols))
                pair.update(zip(("packed", "scale"), w, strict=True))
            return pair.pop(part)

        yield name + "weight_packed", torch.uint8, (rows, cols // 2), lambda: make("packed")
        yield name + "weight_scale", torch.uint8, (rows, cols // mxfp4.BLOCK), lambda: make("scale")

    p = prefix.format(i=layer)
    yield dense(p + "gate.weight", (E, H), torch.float32)
    yield dense(p + "gate.e_score_correction_bias", (E,), torch.float32, scale=0.05)
    yield dense(p + "routed_expert_down_proj.weight", (D, H), dtype)
    yield dense(p + "routed_expert_up_proj.weight", (H, D), dtype)
    if cfg.latent_moe_use_norm:
        name = p + "routed_expert_norm.weight"
        yield name, dtype, (D,), lambda: (1 + rand(D, scale=0.1)).to(dtype)
    for e in range(E):
        for which, shape in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            yield from matrix(f"{p}experts.{e}.{which}.", shape, use_mxfp4)
    if Is:
        for which, shape in (("gate_proj", (Is, H)), ("up_proj", (Is, H)), ("down_proj", (H, Is))):
            yield from matrix(f"{p}shared_experts.{which}.", shape, shared_mxfp4)


def _nbytes(item: Planned) -> int:
    _, dtype, shape, _ = item
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def write_safetensors(path: Path, items: list[Planned], bar: tqdm | None = None) -> None:
    """Stream ``items`` into one safetensors file: header first, then each tensor as made."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in items:
        name, dtype, shape, _ = item
        size = _nbytes(item)
        span = [offset, offset + size]
        header[name] = {"dtype": SAFETENSORS_CODES[dtype_name(dtype)], "shape": list(shape),
                        "data_offsets": span}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for item in items:
            name, dtype, shape, make = item
            t = make().contiguous()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"{name}: made {t.dtype} {tuple(t.shape)}, planned {dtype} {shape}")
            f.write(t.view(torch.uint8).numpy().data)
            if bar is not None:
                bar.update(_nbytes(item))


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
    moe_layers: int | None = None,
    shard_bytes: int | None = None,
    random_codes: bool = False,
    shared_mxfp4: bool = False,
    prefix: str | None = None,
) -> Path:
    """Write ``config.json`` and the weights of the MoE layers; return the folder.

    K3 layout (``text_config`` + ``language_model.`` prefix) unless ``text_only``; ``prefix``
    overrides the tensor prefix (``{i}`` is the layer). ``moe_layers``: only the first N MoE
    layers (the config still describes the whole model). Weights go to one
    ``model.safetensors``, or to shard files plus ``model.safetensors.index.json``: one per layer,
    or files of about ``shard_bytes`` each when given. ``random_codes``: MXFP4 experts as random
    codes with fan-in scales (real-size speed) instead of encoded Gaussians.
    """
    cfg = LatentMoEConfig.from_dict(raw_config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = dict(raw_config) if text_only else {"model_type": "kimi_k3", "text_config": dict(raw_config)}
    (out / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
    if config_only:
        return out
    if prefix is None:
        prefix = "model.layers.{i}." if text_only else "language_model.layers.{i}."
        prefix += "block_sparse_moe."
    dtype = torch_dtype(cfg.torch_dtype)
    if moe_layers is not None and moe_layers < 1:
        raise ValueError(f"moe_layers must be >= 1, got {moe_layers}")
    layers = cfg.moe_layers if moe_layers is None else cfg.moe_layers[:moe_layers]
    per_layer_files = not single_file and shard_bytes is None
    # Files as lists of planned tensors; nothing is generated until a file is written.
    files: list[list[Planned]] = [[]]
    file_bytes = 0
    for layer in layers:
        if per_layer_files and files[-1]:
            files.append([])
        gen = torch.Generator().manual_seed(seed * 100_003 + layer)
        for item in _layer_plan(cfg, layer, prefix, dtype, use_mxfp4, gen, random_codes, shared_mxfp4):
            size = _nbytes(item)
            if shard_bytes is not None and files[-1] and file_bytes + size > shard_bytes:
                files.append([])
                file_bytes = 0
            files[-1].append(item)
            file_bytes += size
    if single_file:
        names = [SINGLE_FILE]
    elif per_layer_files:
        names = [f"model-layer-{layer:05d}.safetensors" for layer in layers]
    else:
        names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    total = sum(_nbytes(item) for items in files for item in items)
    with tqdm(total=total, desc="writing weights", unit="B", unit_scale=True, file=sys.stderr,
              disable=not progress) as bar:
        for name, items in zip(names, files, strict=True):
            write_safetensors(out / name, items, bar)
    if not single_file:
        weight_map = {item[0]: name for name, items in zip(names, files, strict=True) for item in items}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    return out
