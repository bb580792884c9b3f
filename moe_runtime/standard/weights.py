"""One standard MoE layer's tensors, read from the model folder's own safetensors.

Hugging Face names under ``model.layers.{i}.mlp.``: ``gate.weight [E, H]``,
``gate.e_score_correction_bias [E]`` (DeepSeek-V3), ``experts.{e}.{gate,up,down}_proj.weight``
(``[I, H]``, ``[I, H]``, ``[H, I]``), ``shared_experts.{gate,up,down}_proj.weight`` (``[Is, H]``,
``[Is, H]``, ``[H, Is]``, DeepSeek-V3). A TP rank reads only its slices, placed by the latent
layer's sharding table (``tp.sharding``): an expert's gate/up/down projections are its
``w1``/``w3``/``w2``, the shared experts and the router keep their keys there.

Legend: E experts, H hidden, I_local = I / P, S_local = Is / P.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import CheckpointReader, Read, load_threads
from ..tp.sharding import Split, TPShard, check_tp_size
from ..units import DTYPES, PARTS, check_dtype, dtype_name
from ..weights import ExpertWeights
from .config import StandardMoEConfig

PREFIXES = ("model.layers.{i}.mlp.", "language_model.model.layers.{i}.mlp.")
# HF name of an expert's projection -> its key in the sharding table.
EXPERT_KEYS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass
class StandardMoEWeights:
    """One rank's tensors of a standard MoE layer. ``experts`` hold ``w13 [E, 2 I_local, H]``
    (gate rows over up rows) and ``w2 [E, H, I_local]``, the latent layer's layout with its
    latent width D = H. ``bias_E`` is zeros where the family has no correction bias."""

    gate_EH: torch.Tensor  # fp32
    bias_E: torch.Tensor  # fp32
    experts: ExpertWeights
    shared_gate_SH: torch.Tensor | None = None
    shared_up_SH: torch.Tensor | None = None
    shared_down_HS: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.experts.dtype

    @property
    def has_shared(self) -> bool:
        return self.shared_gate_SH is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"gate_EH": self.gate_EH, "bias_E": self.bias_E, "shared_gate_SH": self.shared_gate_SH,
                 "shared_up_SH": self.shared_up_SH, "shared_down_HS": self.shared_down_HS}
        named.update({f"experts.{k}": t for k, t in self.experts.tensors().items()})
        return {k: t for k, t in named.items() if t is not None}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def nbytes_by_part(self) -> dict[str, int]:
        """Resident bytes by part (``units.PARTS``, every key present): dense experts, shared
        experts and the router; no latent projections."""
        def nbytes(*ts: torch.Tensor | None) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        return {**dict.fromkeys(PARTS, 0), "experts_dense": self.experts.nbytes(),
                "shared_experts": nbytes(self.shared_gate_SH, self.shared_up_SH, self.shared_down_HS),
                "router": nbytes(self.gate_EH, self.bias_E)}

    def to(self, device: torch.device | str) -> StandardMoEWeights:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        shared = (move(self.shared_gate_SH), move(self.shared_up_SH), move(self.shared_down_HS))
        return StandardMoEWeights(move(self.gate_EH), move(self.bias_E), self.experts.to(device), *shared)


def layer_prefix(reader: CheckpointReader, layer: int) -> str:
    """The tensor-name prefix of ``layer``'s MoE block (ValueError naming what was looked for)."""
    for pattern in PREFIXES:
        if pattern.format(i=layer) + "gate.weight" in reader:
            return pattern.format(i=layer)
    looked = " or ".join(p.format(i=layer) + "gate.weight" for p in PREFIXES)
    dense = any(p.format(i=layer) + "gate_proj.weight" in reader for p in PREFIXES)
    hint = ": the checkpoint stores that layer as a dense MLP" if dense else ""
    raise ValueError(f"{reader.root} has no MoE router for layer {layer} (looked for {looked}){hint}")


class _Loader:
    """Checks every name, shape and stored dtype of one layer up front, then reads this rank's
    slices in ``dtype`` (the router in fp32)."""

    def __init__(self, reader: CheckpointReader, cfg: StandardMoEConfig, layer: int, shard: TPShard,
                 dtype: torch.dtype):
        cfg.check_moe_layer(layer)
        check_dtype(dtype_name(dtype))
        check_tp_size(shard.world, cfg.moe_intermediate_size, cfg.shared_intermediate_size)
        self.reader, self.cfg, self.shard, self.dtype = reader, cfg, shard, dtype
        self.prefix = layer_prefix(reader, layer)
        H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        Is = cfg.shared_intermediate_size
        # suffix -> (full shape, sharding-table key)
        self.expected: dict[str, tuple[tuple[int, ...], str]] = {"gate.weight": ((E, H), "gate.weight")}
        if cfg.has_correction_bias:
            self.expected["gate.e_score_correction_bias"] = ((E,), "gate.e_score_correction_bias")
        for e in range(E):
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                self.expected[f"experts.{e}.{proj}.weight"] = (shape, EXPERT_KEYS[proj])
        if Is:
            for proj, shape in (("gate_proj", (Is, H)), ("up_proj", (Is, H)), ("down_proj", (H, Is))):
                key = f"shared_experts.{proj}.weight"
                self.expected[key] = (shape, key)
        self._check_all()

    def _check_all(self) -> None:
        cfg = self.cfg
        names = [self.prefix + suffix for suffix in self.expected]
        missing = [n for n in names if n not in self.reader]
        if missing:
            base = missing[0].removesuffix("weight")
            quantised = base + "weight_packed" in self.reader or base + "qweight" in self.reader
            why = "; it stores them quantised, which this layer does not read" if quantised else ""
            raise ValueError(f"{self.reader.root} lacks {len(missing)} tensor(s) of a {cfg.family} MoE "
                             f"layer, e.g. {', '.join(missing[:3])}{why}")
        for suffix, (shape, _) in self.expected.items():
            name = self.prefix + suffix
            found = self.reader.shape(name)
            if found != shape:
                raise ValueError(f"tensor {name!r} has shape {found}, expected {shape} (hidden_size "
                                 f"{cfg.hidden_size}, moe_intermediate_size {cfg.moe_intermediate_size}, "
                                 f"{cfg.num_experts} experts, shared width {cfg.shared_intermediate_size})")
            stored = dtype_name(self.reader.dtype(name))
            if stored not in DTYPES:
                raise ValueError(f"tensor {name!r} is stored as {stored}; this layer reads weights stored as "
                                 f"one of {list(DTYPES)} (dequantise the checkpoint first)")

    def read(self, suffix: str) -> Read:
        """``(name, dim, start, stop)``: this rank's slice of ``suffix``."""
        shape, key = self.expected[suffix]
        name = self.prefix + suffix
        placement = self.shard.placement(key)
        if placement is Split.REPLICATE:
            return name, None, 0, None
        dim = 0 if placement is Split.ROWS else 1
        return name, dim, *self.shard.span(shape[dim], f"dim {dim} of {name}")

    def dense(self, suffix: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This rank's slice in ``dtype`` (default: the compute dtype): a zero-copy view of the
        file where it is one byte range already in that dtype, else a copy."""
        dtype = dtype or self.dtype
        what = self.read(suffix)
        if self.reader.dtype(what[0]) == dtype:
            view = self.reader.view(*what)
            if view is not None:
                return view
        return self.reader.read(*what).to(dtype)

    def experts(self, threads: int) -> ExpertWeights:
        """Every routed expert straight into stacked tensors allocated once (``read_many``)."""
        E, H = self.cfg.num_experts, self.cfg.hidden_size
        I_local = self.cfg.moe_intermediate_size // self.shard.world
        w13 = torch.empty(E, 2 * I_local, H, dtype=self.dtype)
        w2 = torch.empty(E, H, I_local, dtype=self.dtype)
        reads: list[tuple[torch.Tensor, Read]] = []
        for e in range(E):
            reads += [(w13[e, :I_local], self.read(f"experts.{e}.gate_proj.weight")),
                      (w13[e, I_local:], self.read(f"experts.{e}.up_proj.weight")),
                      (w2[e], self.read(f"experts.{e}.down_proj.weight"))]
        self.reader.read_many(reads, threads)
        return ExpertWeights(w13, w2, dtype=self.dtype)


def load_standard_layer(
    checkpoint: str | Path | CheckpointReader,
    cfg: StandardMoEConfig,
    layer: int,
    dtype: torch.dtype = torch.float32,
    shard: TPShard | None = None,
    threads: int | None = None,
) -> StandardMoEWeights:
    """This rank's tensors of MoE layer ``layer``: experts and shared experts in ``dtype``, the
    router (and its correction bias) in fp32. ValueError naming the tensor for a missing,
    misshaped or quantised one, and the arithmetic for a TP size that does not divide I or Is."""
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    ld = _Loader(reader, cfg, layer, shard or TPShard(), dtype)
    bias = (ld.dense("gate.e_score_correction_bias", torch.float32) if cfg.has_correction_bias
            else torch.zeros(cfg.num_experts))
    shared: tuple[torch.Tensor | None, ...] = (None, None, None)
    if cfg.shared_intermediate_size:
        shared = tuple(ld.dense(f"shared_experts.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj"))
    return StandardMoEWeights(
        gate_EH=ld.dense("gate.weight", torch.float32),
        bias_E=bias,
        experts=ld.experts(threads or load_threads()),
        shared_gate_SH=shared[0],
        shared_up_SH=shared[1],
        shared_down_HS=shared[2],
    )
