"""Read Kimi-K3-format safetensors checkpoints one layer, and one TP shard, at a time.

Only the tensors (and, for split tensors, the slices) a rank needs are read, through
safetensors' lazy slicing; nothing loads a whole file.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from . import mxfp4
from .config import LatentMoEConfig
from .tp.sharding import Split, TPShard
from .units import format_layers
from .weights import ExpertWeights, LayerWeights

PREFIXES = (
    "language_model.layers.{i}.block_sparse_moe.",
    "language_model.model.layers.{i}.block_sparse_moe.",
    "model.layers.{i}.block_sparse_moe.",
)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MXFP4, DENSE = "mxfp4", "dense"  # how a layer's routed experts are stored
EXPERT_FORMATS = (MXFP4, DENSE)


class CheckpointReader:
    """Maps tensor names to files and reads whole tensors or slices of them."""

    def __init__(self, checkpoint: str | Path):
        self.root = Path(checkpoint)
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{index} is not a valid safetensors index: {exc}") from exc
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError(
                    f"{index} is not a valid safetensors index: weight_map must map tensor names to "
                    f"file names, got {str(weight_map)[:80]}"
                )
            self._file_of = {name: self.root / fname for name, fname in weight_map.items()}
        elif (self.root / SINGLE_FILE).is_file():
            path = self.root / SINGLE_FILE
            with safe_open(path, "pt") as f:
                self._file_of = {name: path for name in f.keys()}
        else:
            raise ValueError(f"{self.root} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._handles: dict[Path, object] = {}
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str):
        if name not in self._file_of:
            raise ValueError(f"checkpoint {self.root} has no tensor {name!r}")
        path = self._file_of[name]
        if path not in self._handles:
            if not path.is_file():
                raise ValueError(f"tensor {name!r} is mapped to {path.name}, which does not exist")
            try:
                self._handles[path] = safe_open(path, "pt")
            except Exception as exc:
                raise ValueError(f"cannot open {path}: {exc}") from exc
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Read ``name``, or only ``[start, stop)`` along ``dim`` when ``dim`` is given."""
        view = self._handle(name).get_slice(name)
        if dim is None:
            t = view[:]
        elif dim == 0:
            t = view[start:stop]
        else:
            t = view[:, start:stop]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def layer_prefix(self, layer: int) -> str:
        for pattern in PREFIXES:
            prefix = pattern.format(i=layer)
            if prefix + "gate.weight" in self:
                return prefix
        raise ValueError(
            f"checkpoint {self.root} has no tensors for layer {layer} "
            f"(looked for {' or '.join(p.format(i=layer) + 'gate.weight' for p in PREFIXES)})"
        )


class _LayerLoader:
    """Reads one layer for one rank, checking every tensor's full shape first."""

    def __init__(
        self, reader: CheckpointReader, cfg: LatentMoEConfig, layer: int, shard: TPShard, dtype: torch.dtype
    ):
        cfg.check_moe_layer(layer)
        self.reader, self.cfg, self.shard, self.dtype = reader, cfg, shard, dtype
        self.prefix = reader.layer_prefix(layer)

    def _check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        found = self.reader.shape(name)
        if found != expected:
            raise ValueError(f"tensor {name!r} has shape {found}, expected {expected}")

    def _span(self, key: str, full: tuple[int, ...], name: str) -> tuple[int | None, int, int | None]:
        placement = self.shard.placement(key)
        if placement is Split.REPLICATE:
            return None, 0, None
        dim = 0 if placement is Split.ROWS else 1
        start, stop = self.shard.span(full[dim], f"dim {dim} of {name}")
        return dim, start, stop

    def dense(
        self, suffix: str, full: tuple[int, ...], key: str | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        name = self.prefix + suffix
        self._check_shape(name, full)
        dim, start, stop = self._span(key or suffix, full, name)
        return self.reader.read(name, dim, start, stop).to(dtype or self.dtype)

    def is_packed(self, base: str) -> bool:
        """Whether matrix ``base`` (e.g. ``experts.3.w1``) is stored dense or MXFP4."""
        if self.prefix + base + ".weight" in self.reader:
            return False
        if self.prefix + base + ".weight_packed" in self.reader:
            return True
        raise ValueError(
            f"checkpoint has neither {self.prefix + base + '.weight'!r} "
            f"nor {self.prefix + base + '.weight_packed'!r}"
        )

    def packed(self, base: str, key: str, full: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of an MXFP4 matrix, still packed: ``(nibbles, scales)``."""
        packed_name, scale_name = self.prefix + base + ".weight_packed", self.prefix + base + ".weight_scale"
        rows, cols = full
        if cols % mxfp4.BLOCK:
            raise ValueError(f"{packed_name}: input dim {cols} is not a multiple of {mxfp4.BLOCK}")
        self._check_shape(packed_name, (rows, cols // 2))
        self._check_shape(scale_name, (rows, cols // mxfp4.BLOCK))
        dim, start, stop = self._span(key, full, base)
        if dim == 1:
            width = stop - start
            if width % mxfp4.BLOCK:
                raise ValueError(
                    f"{base} is MXFP4 with {mxfp4.BLOCK}-element blocks along dim 1, but each rank's "
                    f"slice is {cols} / TP {self.shard.world} = {width} columns, not a multiple of "
                    f"{mxfp4.BLOCK}: the slices do not fall on a block boundary"
                )
            packed = self.reader.read(packed_name, 1, start // 2, stop // 2)
            scale = self.reader.read(scale_name, 1, start // mxfp4.BLOCK, stop // mxfp4.BLOCK)
        else:
            packed = self.reader.read(packed_name, dim, start, stop)
            scale = self.reader.read(scale_name, dim, start, stop)
        return packed, scale

    def matrix(self, base: str, key: str, full: tuple[int, int]) -> torch.Tensor:
        """This rank's slice of a dense or MXFP4 matrix in the compute dtype (MXFP4 decoded)."""
        if not self.is_packed(base):
            return self.dense(base + ".weight", full, key=key)
        return mxfp4.decode(*self.packed(base, key, full), self.dtype)


def _load_experts(ld: _LayerLoader, progress: bool | None) -> ExpertWeights:
    """Every routed expert into tensors allocated once up front (no list-then-stack copy):
    MXFP4 experts stay packed, dense ones are converted to the compute dtype."""
    cfg, world = ld.cfg, ld.shard.world
    E, D, I = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    I_local = I // world
    packed = ld.is_packed("experts.0.w1")
    if packed:
        w13 = torch.empty(E, 2 * I_local, D // 2, dtype=torch.uint8)
        w2 = torch.empty(E, D, I_local // 2, dtype=torch.uint8)
        w13_s = torch.empty(E, 2 * I_local, D // mxfp4.BLOCK, dtype=torch.uint8)
        w2_s = torch.empty(E, D, I_local // mxfp4.BLOCK, dtype=torch.uint8)
    else:
        w13, w2 = torch.empty(E, 2 * I_local, D, dtype=ld.dtype), torch.empty(E, D, I_local, dtype=ld.dtype)
        w13_s = w2_s = None
    if progress is None:
        progress = sys.stderr.isatty()
    for e in tqdm(range(E), desc="loading experts", unit="expert", file=sys.stderr, disable=not progress):
        for which, full, dst, dst_scale, rows in (
            ("w1", (I, D), w13, w13_s, slice(0, I_local)),
            ("w3", (I, D), w13, w13_s, slice(I_local, 2 * I_local)),
            ("w2", (D, I), w2, w2_s, slice(None)),
        ):
            base = f"experts.{e}.{which}"
            if ld.is_packed(base) != packed:
                raise ValueError(
                    f"{ld.prefix}{base} is {'dense' if packed else 'MXFP4'} but experts.0.w1 is "
                    f"{'MXFP4' if packed else 'dense'}: a layer's routed experts must share one format"
                )
            if packed:
                nibbles, scales = ld.packed(base, which, full)
                dst[e, rows].copy_(nibbles)
                dst_scale[e, rows].copy_(scales)
            else:
                dst[e, rows].copy_(ld.dense(base + ".weight", full, key=which, dtype=None))
    return ExpertWeights(w13, w2, w13_s, w2_s, dtype=ld.dtype)


def load_layer_weights(
    checkpoint: str | Path | CheckpointReader,
    cfg: LatentMoEConfig,
    layer: int,
    dtype: torch.dtype = torch.float32,
    shard: TPShard | None = None,
    progress: bool | None = False,
) -> LayerWeights:
    """Load one MoE layer's tensors (this rank's slices only) in ``dtype``; MXFP4 routed
    experts stay packed. ``progress``: a bar over experts on stderr (None: when it is a TTY)."""
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    ld = _LayerLoader(reader, cfg, layer, shard or TPShard(), dtype)
    H, D, E = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts
    Is = cfg.shared_intermediate_size
    experts = _load_experts(ld, progress)
    shared = (None, None, None)
    if cfg.num_shared_experts:
        shared = (
            ld.matrix("shared_experts.gate_proj", "shared_experts.gate_proj.weight", (Is, H)),
            ld.matrix("shared_experts.up_proj", "shared_experts.up_proj.weight", (Is, H)),
            ld.matrix("shared_experts.down_proj", "shared_experts.down_proj.weight", (H, Is)),
        )
    return LayerWeights(
        gate_EH=ld.dense("gate.weight", (E, H), dtype=torch.float32),
        bias_E=ld.dense("gate.e_score_correction_bias", (E,), dtype=torch.float32),
        down_DH=ld.dense("routed_expert_down_proj.weight", (D, H)),
        norm_D=(
            ld.dense("routed_expert_norm.weight", (D,), dtype=torch.float32)
            if cfg.latent_moe_use_norm
            else None
        ),
        up_HD=ld.dense("routed_expert_up_proj.weight", (H, D)),
        experts=experts,
        shared_gate_SH=shared[0],
        shared_up_SH=shared[1],
        shared_down_HS=shared[2],
    )


# -- which format a checkpoint's experts are in -----------------------------------------------


def checkpoint_has_weights(checkpoint: str | Path) -> bool:
    root = Path(checkpoint)
    return (root / INDEX_FILE).is_file() or (root / SINGLE_FILE).is_file()


def checkpoint_expert_formats(checkpoint: Any, cfg: LatentMoEConfig, layers: Iterable[int]) -> dict[int, str]:
    """Per layer, ``"mxfp4"`` when expert 0's gate projection is stored as ``weight_packed`` +
    ``weight_scale`` (uint8), ``"dense"`` when it is a plain ``weight``; reads names only.

    ``checkpoint``: a folder or a ``CheckpointReader``.
    """
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    formats = {}
    for layer in layers:
        base = reader.layer_prefix(layer) + "experts.0.w1."
        if base + "weight_packed" in reader and base + "weight_scale" in reader:
            formats[layer] = MXFP4
        elif base + "weight" in reader:
            formats[layer] = DENSE
        else:
            raise ValueError(
                f"checkpoint {reader.root} stores layer {layer}'s experts neither dense "
                f"({base}weight) nor MXFP4 ({base}weight_packed + weight_scale)"
            )
    return formats


def resolve_expert_formats(
    cfg: LatentMoEConfig,
    layers: Sequence[int],
    checkpoint: str | Path | None = None,
    experts_format: str | None = None,
) -> dict[int, str] | None:
    """The experts format of every layer: read from the checkpoint's tensor names when it holds
    weights (an explicit ``experts_format`` must then agree), else ``experts_format`` (a
    config-only checkpoint); None when neither says."""
    if experts_format is not None and experts_format not in EXPERT_FORMATS:
        raise ValueError(f"experts_format {experts_format!r} is not one of {EXPERT_FORMATS}")
    if checkpoint is not None and checkpoint_has_weights(checkpoint):
        found = checkpoint_expert_formats(checkpoint, cfg, layers)
        wrong = sorted(layer for layer, f in found.items() if experts_format not in (None, f))
        if wrong:
            raise ValueError(
                f"experts_format is {experts_format!r} but the checkpoint stores layers "
                f"{format_layers(wrong)} as {found[wrong[0]]!r}"
            )
        return found
    if experts_format is None:
        return None
    return dict.fromkeys(layers, experts_format)
