"""Memory planner (DESIGN §8): what one rank of a TP group holds, and how a model's MoE layers
split over TP groups of a device. Pure arithmetic (no Ray, no weights read); a checkpoint is only
asked which format its routed experts are stored in.

Bytes per rank per MoE layer, by part (the keys of ``LayerWeights.nbytes_by_part()``), with
``b`` the compute dtype's bytes, ``I_l = I / P`` and ``S_l = I * num_shared_experts / P``:

    experts_packed      MXFP4 routed experts: E x [2 I_l x (D/2 + D/32)  +  D x (I_l/2 + I_l/32)]
                        (w1|w3 rows split, w2 columns split; uint8 nibbles + one E8M0 byte per 32)
    experts_dense       dense routed experts: E x 3 x I_l x D x b
    experts_backend     what the experts backend keeps beside them in its own layout, asked of the
                        backend from the shapes (``experts.resident_extra_bytes``): torch and
                        grouped 0; aiter its shuffled copies of MXFP4 experts, as many bytes as
                        experts_packed. ``auto`` plans the largest of the backends it may pick
                        where the ranks compute (``experts.planned_extra_bytes``): on GPUs, aiter's
    shared_experts      3 x S_l x H x b (MXFP4 shared experts are decoded to b at load)
    latent_projections  Wdown D x H x b + RMSNorm gamma D x 4 (fp32; absent without the norm)
    up_projection       Wup H x D x b, or (H/P) x D x b when pre-sharded
    router              gate E x H x 4 + e_score_correction_bias E x 4 (fp32)

Per rank the planner adds a workspace allowance: the experts' decode scratch budget (default
256 MiB) plus activations for the largest forward, ``tokens x activation_bytes_per_token`` (see
:func:`activation_bytes_per_token` for the per-token formula). The fused MXFP4 CPU path
(``experts_path="fused"``, the torch backend's CPU default for packed experts) decodes in
registers: no scratch, but fp32 copies of each expert's rows (``FUSED_BYTES_PER_TOKEN``).

Where the bytes live (``moe_runtime.checkpoint``): the routed experts, column-split tensors
(``shared_experts.down_proj`` at TP > 1) and every tensor converted from the file's dtype are
anonymous memory; the other dense tensors (row-split or replicated and stored in the compute dtype:
in a bf16 deployment of a bf16 checkpoint the router, Wdown, Wup and the shared gate/up rows) are
zero-copy views of a private mapping of the checkpoint, their page-cache pages mapped at load
(RSS "file", not "anon"; ranks of one node mapping one file share them). Each part counts its
bytes once per rank either way: a mapped page a forward reads is as resident as an anonymous one,
and on a CPU node the replicated ones are then over-counted by (ranks - 1) x their bytes, a bound
kept on purpose (~0.1 GB per extra rank at K3 size). The load leaves no other page of the file
mapped (experts and column slices are read with ``pread``, not through the mapping).

Units: GB is 10**9 bytes (``moe_runtime.units``). Budgets are in ``budget``, time in ``cost``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import LatentMoEConfig
from ..tp.sharding import check_tp_size
from ..units import (
    DEFAULT_SCRATCH_BYTES,
    EXPERT_FORMATS,
    MXFP4,
    PARTS,
    REFERENCE_BACKEND,
    dtype_bytes,
    format_layers,
    gb,
)
from .budget import Budget

MXFP4_BLOCK = 32


# -- bytes per rank per layer ----------------------------------------------------------------


def backend_copies(backend: str, compute: str, E: int, I_l: int, D: int, packed: bool) -> tuple[str, int]:
    """``experts.planned_extra_bytes`` for experts of these shapes. The backends' registry loads
    torch, so it is imported here, where a plan is made: a process that only reads a plan (a
    group replica, from its decision) never loads torch."""
    from ..experts import planned_extra_bytes
    from ..weights import expert_shapes

    return planned_extra_bytes(backend, compute, expert_shapes(E, I_l, D, packed))


def layer_bytes(
    cfg: LatentMoEConfig,
    experts_format: str,
    dtype: str,
    tp_size: int = 1,
    preshard_up_proj: bool = False,
    backend: str = REFERENCE_BACKEND,
    compute: str = "gpu",
) -> dict[str, int]:
    """Bytes one rank of a TP ``tp_size`` group holds for one MoE layer, by part (all of ``PARTS``),
    serving with experts ``backend`` (``auto``: the worst case where the ranks ``compute``)."""
    if experts_format not in EXPERT_FORMATS:
        raise ValueError(f"experts format {experts_format!r} is not one of {EXPERT_FORMATS}")
    H, D, E, I = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    Is = cfg.shared_intermediate_size
    check_tp_size(tp_size, I, Is, H if preshard_up_proj else None)
    b = dtype_bytes(dtype)
    I_l, S_l = I // tp_size, Is // tp_size
    parts = dict.fromkeys(PARTS, 0)
    if experts_format == MXFP4:
        if D % MXFP4_BLOCK or I_l % MXFP4_BLOCK:
            raise ValueError(
                f"MXFP4 experts need the latent size D = {D} and each rank's intermediate slice "
                f"I / TP = {I} / {tp_size} = {I_l} to be multiples of the {MXFP4_BLOCK}-element block"
            )
        w13 = 2 * I_l * (D // 2 + D // MXFP4_BLOCK)
        w2 = D * (I_l // 2 + I_l // MXFP4_BLOCK)
        parts["experts_packed"] = E * (w13 + w2)
    else:
        parts["experts_dense"] = E * 3 * I_l * D * b
    parts["experts_backend"] = backend_copies(backend, compute, E, I_l, D, experts_format == MXFP4)[1]
    parts["shared_experts"] = 3 * S_l * H * b
    parts["latent_projections"] = D * H * b + (D * 4 if cfg.latent_moe_use_norm else 0)
    parts["up_projection"] = (H // tp_size if preshard_up_proj else H) * D * b
    parts["router"] = E * H * 4 + E * 4
    return parts


EXPERTS_PATHS = ("decode", "fused")


def fused_bytes_per_token(cfg: LatentMoEConfig, tp_size: int = 1) -> int:
    """What the fused MXFP4 CPU path adds per token of an expert's rows, all fp32: the input rows
    and their nibble-ordered copy (2 x 4 D), gate|up (4 x 2 I_l), the activation and its
    nibble-ordered copy (2 x 4 I_l), the output rows and their rounded-back copy (2 x 4 D)."""
    D, I_l = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size // tp_size
    return 16 * D + 16 * I_l


def activation_bytes_per_token(cfg: LatentMoEConfig, dtype: str, tp_size: int = 1) -> int:
    """Estimated bytes alive at once per token of a forward on one rank (the torch path's
    token-sized tensors, fp32 where the code may widen). scripts/bench/memory.py measures it:
    with the decode scratch it bounded every measured forward peak; alone it did not with few
    tokens, where decoded expert chunks and weight-sized temporaries (not per token) dominate:

        H x (4b + 4)          input, routed output, shared output, layer output (b) + fp32 partial sum
        + 12 E                router logits, scores, biased scores (fp32)
        + 28 K                top-k ids (int64), weights (fp32), slot order and slot->token (int64)
        + D x (b + 8)         latent h (b) + fp32 partial sum and its normed copy
        + D x (b + 8) + I_l x (3b + 12)
                              one expert's working set when every token picks it: gathered rows,
                              gate|up (b), fp32 gate, up, activation, its b copy, fp32 rows and
                              their weighted copy
        + S_l x (3b + 12)     shared experts' gate|up (b), fp32 activation, its b copy
    """
    H, D, E, K = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts, cfg.num_experts_per_token
    b = dtype_bytes(dtype)
    I_l, S_l = cfg.moe_intermediate_size // tp_size, cfg.shared_intermediate_size // tp_size
    return (
        H * (4 * b + 4) + 12 * E + 28 * K + 2 * D * (b + 8) + I_l * (3 * b + 12) + S_l * (3 * b + 12)
    )


# -- the plan of one TP group ------------------------------------------------------------------


@dataclass(frozen=True)
class Workspace:
    """Per-rank allowance beyond the weights: decode scratch + activations of the largest forward."""

    scratch_bytes: int
    tokens: int
    activation_bytes_per_token: int

    @property
    def activation_bytes(self) -> int:
        return self.tokens * self.activation_bytes_per_token

    @property
    def total(self) -> int:
        return self.scratch_bytes + self.activation_bytes

    def describe(self) -> str:
        return (
            f"workspace {gb(self.total)} (scratch {gb(self.scratch_bytes)} + {self.tokens} tokens x "
            f"{self.activation_bytes_per_token} B activations)"
        )


@dataclass(frozen=True)
class MemoryPlan:
    """What one rank of a TP group holds for a set of layers, against a budget (if any)."""

    tp_size: int
    dtype: str
    preshard_up_proj: bool
    per_layer: Mapping[int, Mapping[str, int]]
    formats: Mapping[int, str]
    workspace: Workspace
    budget: Budget | None = None
    experts_backend: str = REFERENCE_BACKEND  # whose copies ``experts_backend`` counts (auto: worst case)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.per_layer))

    @property
    def by_part(self) -> dict[str, int]:
        return {p: sum(parts[p] for parts in self.per_layer.values()) for p in PARTS}

    @property
    def weights_bytes(self) -> int:
        return sum(self.by_part.values())

    @property
    def read_bytes(self) -> int:
        """Bytes per rank read from the checkpoint: the weights less the backend's own copies."""
        return self.weights_bytes - self.by_part["experts_backend"]

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.workspace.total

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.budget is None else self.budget.bytes_per_rank - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.budget is None or self.headroom_bytes >= 0

    def arithmetic(self) -> str:
        layers = self.layers
        per = self.weights_bytes // len(layers)
        formats = "/".join(sorted(set(self.formats.values())))
        copies = self.by_part["experts_backend"]
        backend = f"{self.experts_backend} backend" + (f" + {gb(copies)} of its own copies" if copies else "")
        text = (
            f"{len(layers)} layer(s) ({format_layers(layers)}) x ~{gb(per)} per rank "
            f"({formats} experts, {backend}, "
            f"{self.dtype}, TP {self.tp_size}) = {gb(self.weights_bytes)} + {self.workspace.describe()} "
            f"= {gb(self.total_bytes)} per rank"
        )
        if self.budget is not None:
            text += f"; budget {self.budget.source}; headroom {gb(self.headroom_bytes)}"
        return text

    def check(self, what: str = "deployment") -> None:
        """ValueError with the arithmetic when the layers do not fit the budget."""
        if self.fits:
            return
        per_layer = self.weights_bytes / len(self.layers)
        room = (self.budget.bytes_per_rank - self.workspace.total) // per_layer
        raise ValueError(
            f"{what} does not fit: {self.arithmetic()}. At most {max(0, int(room))} such layer(s) fit "
            "per TP group: serve fewer layers per deployment (split the range), raise tp_size, keep "
            "experts MXFP4, or raise device_memory_gb / memory_fraction if the device really has more"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able record (``status()``, ``--explain``)."""
        return {
            "tp_size": self.tp_size,
            "dtype": self.dtype,
            "preshard_up_proj": self.preshard_up_proj,
            "layers": format_layers(self.layers),
            "experts_formats": sorted(set(self.formats.values())),
            "experts_backend": self.experts_backend,
            "bytes_per_rank_by_part": self.by_part,
            "weights_bytes_per_rank": self.weights_bytes,
            "workspace": {
                "scratch_bytes": self.workspace.scratch_bytes,
                "tokens": self.workspace.tokens,
                "activation_bytes_per_token": self.workspace.activation_bytes_per_token,
                "activation_bytes": self.workspace.activation_bytes,
            },
            "total_bytes_per_rank": self.total_bytes,
            "budget": None if self.budget is None else self.budget.to_dict(),
            "headroom_bytes_per_rank": self.headroom_bytes,
            "fits": self.fits,
        }


def plan_memory(
    cfg: LatentMoEConfig,
    formats: Mapping[int, str],
    dtype: str,
    tp_size: int = 1,
    preshard_up_proj: bool = False,
    max_tokens: int = 2048,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    budget: Budget | None = None,
    *,
    experts_path: str = "decode",
    backend: str = REFERENCE_BACKEND,
    compute: str = "gpu",
) -> MemoryPlan:
    """The plan of one TP group serving ``formats``' layers (layer -> experts format).

    ``max_tokens``: tokens of the largest forward a rank runs (activations are sized for it).
    ``experts_path``: how packed experts run (``decode``: in ``scratch_bytes``; ``fused``: the
    CPU kernel, no scratch, ``fused_bytes_per_token`` more per token). Dense experts need no scratch
    either way, but the default keeps the allowance (as before).
    ``backend``: the experts backend requested (``auto``: the worst case of those it may pick
    on ``compute``, "cpu" or "gpu"), whose own copies are counted.
    """
    if experts_path not in EXPERTS_PATHS:
        raise ValueError(f"experts_path must be one of {EXPERTS_PATHS}, got {experts_path!r}")
    if not formats:
        raise ValueError("no layers to plan")
    for layer in formats:
        cfg.check_moe_layer(layer)
    per_layer = {
        layer: layer_bytes(cfg, fmt, dtype, tp_size, preshard_up_proj, backend, compute)
        for layer, fmt in formats.items()
    }
    per_token = activation_bytes_per_token(cfg, dtype, tp_size)
    if experts_path == "fused":
        scratch_bytes, per_token = 0, per_token + fused_bytes_per_token(cfg, tp_size)
    E, I_l, D = cfg.num_experts, cfg.moe_intermediate_size // tp_size, cfg.routed_expert_hidden_size
    per_format = {f: backend_copies(backend, compute, E, I_l, D, f == MXFP4) for f in set(formats.values())}
    planned = max(per_format.values(), key=lambda named: named[1])[0]
    workspace = Workspace(scratch_bytes, max_tokens, per_token)
    return MemoryPlan(tp_size, dtype, preshard_up_proj, per_layer, dict(formats), workspace, budget, planned)


def plan_checkpoint(
    checkpoint: str | Path,
    cfg: LatentMoEConfig,
    layers: Sequence[int] | None = None,
    dtype: str = "bfloat16",
    tp_size: int = 1,
    preshard_up_proj: bool = False,
    experts_format: str | None = None,
    **kwargs: Any,
) -> MemoryPlan:
    """:func:`plan_memory` for a checkpoint folder (experts format read from its tensor names;
    a config-only folder needs ``experts_format``). ``kwargs``: those of :func:`plan_memory`."""
    from ..checkpoint import resolve_expert_formats  # torch: see backend_copies

    layers = list(cfg.moe_layers if layers is None else layers)
    formats = resolve_expert_formats(cfg, layers, checkpoint, experts_format)
    if formats is None:
        raise ValueError(
            f"checkpoint {checkpoint} holds no weights (config only): give experts_format "
            f"({' or '.join(EXPERT_FORMATS)}) to plan its memory"
        )
    return plan_memory(cfg, formats, dtype, tp_size, preshard_up_proj, **kwargs)


# -- splitting a model's MoE layers over TP groups ---------------------------------------------


@dataclass(frozen=True)
class LayerSplit:
    """Contiguous layer groups, one TP group (deployment) each, and each group's plan."""

    plans: tuple[MemoryPlan, ...]

    @property
    def groups(self) -> list[tuple[int, ...]]:
        return [p.layers for p in self.plans]

    @property
    def ranges(self) -> list[str]:
        return [format_layers(g) for g in self.groups]

    def describe(self) -> str:
        first = self.plans[0]
        n = sum(len(g) for g in self.groups)
        sizes = sorted({len(g) for g in self.groups})
        head = f"{n} MoE layers, TP {first.tp_size}, {first.dtype}"
        if first.budget is not None:
            head += f", {first.budget.source}"
        least = min(p.headroom_bytes for p in self.plans) if first.budget is not None else None
        room = "" if least is None else f" with at least {gb(least)} headroom per rank"
        if len(self.plans) == 1:
            return f"{head}: 1 group holds all of them{room}"
        size = "/".join(str(s) for s in sizes)
        return f"{head}: {len(self.plans)} groups of {size} layers ({', '.join(self.ranges)}){room}"


def propose_split(
    cfg: LatentMoEConfig,
    formats: Mapping[int, str],
    dtype: str,
    tp_size: int,
    budget: Budget,
    preshard_up_proj: bool = False,
    max_tokens: int = 2048,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    backend: str = REFERENCE_BACKEND,
    compute: str = "gpu",
) -> LayerSplit:
    """The fewest contiguous groups of ``formats``' layers (in layer order) that each fit one TP
    group of ``tp_size`` ranks within ``budget``, sized as evenly as possible."""
    layers = sorted(formats)

    def plan(group: Sequence[int]) -> MemoryPlan:
        return plan_memory(
            cfg, {x: formats[x] for x in group}, dtype, tp_size, preshard_up_proj, max_tokens, scratch_bytes,
            budget, backend=backend, compute=compute,
        )

    single = plan(layers[:1])
    if not single.fits:
        single.check(f"one layer at TP {tp_size}")
    # Greedy packing gives the fewest groups; then even sizes with that count, if they fit.
    greedy: list[list[int]] = [[]]
    for layer in layers:
        if greedy[-1] and not plan([*greedy[-1], layer]).fits:
            greedy.append([])
        greedy[-1].append(layer)
    n = len(greedy)
    size, extra = divmod(len(layers), n)
    even, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        even.append(layers[start:stop])
        start = stop
    plans = [plan(g) for g in even]
    if not all(p.fits for p in plans):
        plans = [plan(g) for g in greedy]
    return LayerSplit(tuple(plans))


