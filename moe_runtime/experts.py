"""Routed-expert backends behind a small registry (DESIGN §7: swappable kernel seam).

Legend: T tokens, D latent, E experts (local), K slots per token, F = 2 * I_local (gate
rows stacked over up rows), I_local = intermediate rows this rank holds.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from typing import Protocol

import torch

from .activation import GatedActivation
from .weights import ExpertWeights

ActQuant = Callable[[torch.Tensor], torch.Tensor]
DEFAULT_SCRATCH_BYTES = 256 * 2**20


class ExpertsBackend(Protocol):
    name: str

    def __call__(
        self,
        h_TD: torch.Tensor,
        ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        experts: ExpertWeights,
        act: GatedActivation,
        act_quant: ActQuant | None = None,
    ) -> torch.Tensor:
        """Return the fp32 weighted combine ``L_TD = sum_k w_k * expert_{ids_k}(h)``.

        ``act_quant`` (None: identity) is a quantise-dequantise of an activation tensor in its
        dtype, applied to the experts' input rows and to the gated activation before the down
        GEMM (W4A4 emulation). It must treat rows independently (per-token or per-block
        scales), so quantising ``h`` once equals quantising each expert's gathered rows.
        """
        ...


_REGISTRY: dict[str, Callable[..., ExpertsBackend]] = {}


def register_backend(name: str) -> Callable:
    def wrap(factory: Callable[..., ExpertsBackend]) -> Callable[..., ExpertsBackend]:
        _REGISTRY[name] = factory
        return factory

    return wrap


def unavailable_reason(name: str) -> str | None:
    if name not in _REGISTRY:
        return f"unknown experts backend {name!r}; known: {sorted(_REGISTRY)}"
    if name == "aiter":
        return aiter_unavailable_reason()
    if name == "grouped":
        from .grouped_experts import grouped_unavailable_reason

        return grouped_unavailable_reason()
    return None


def get_backend(name: str, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> ExpertsBackend:
    reason = unavailable_reason(name)
    if reason is not None:
        raise ValueError(reason)
    return _REGISTRY[name](scratch_bytes=scratch_bytes)


def check_scratch_bytes(scratch_bytes: int) -> int:
    """The experts' decode budget per rank, validated (ValueError unless a positive byte count)."""
    if isinstance(scratch_bytes, bool) or not isinstance(scratch_bytes, int) or scratch_bytes < 1:
        raise ValueError(f"experts scratch budget must be a positive byte count, got {scratch_bytes!r}")
    return scratch_bytes


def slots_by_expert(
    ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``T * K`` token-slots grouped by expert (stable): each slot's token row, its fp32
    routing weight, and the number of slots per expert ``[E]``."""
    flat_ids = ids_TK.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    return (
        order // ids_TK.shape[1],
        weights_TK.reshape(-1)[order].float(),
        torch.bincount(flat_ids, minlength=num_experts),
    )


@register_backend("torch")
class TorchExperts:
    """Sort token-slots by expert and run one GEMM pair per active expert.

    Packed (MXFP4) experts are decoded only when a batch activates them, a chunk of experts at
    a time, each chunk's decoded weights (and decode temporaries) within ``scratch_bytes``.
    """

    name = "torch"

    def __init__(self, scratch_bytes: int = DEFAULT_SCRATCH_BYTES):
        self.scratch_bytes = check_scratch_bytes(scratch_bytes)

    def __call__(self, h_TD, ids_TK, weights_TK, experts: ExpertWeights, act, act_quant=None):
        out_TD = torch.zeros(ids_TK.shape[0], experts.latent_size, dtype=torch.float32, device=h_TD.device)
        if act_quant is not None:
            h_TD = act_quant(h_TD)
        token_of_slot, slot_weight, counts = slots_by_expert(ids_TK, weights_TK, experts.num_experts)
        starts = (torch.cumsum(counts, 0) - counts).tolist()
        counts = counts.tolist()
        active = [e for e, c in enumerate(counts) if c]
        per_chunk = experts.experts_per_chunk(self.scratch_bytes) if experts.packed else 1
        half = experts.intermediate_size
        for first in range(0, len(active), per_chunk):
            chunk = active[first : first + per_chunk]
            if experts.packed:
                w13_nFD, w2_nDI = experts.decode(torch.tensor(chunk, device=experts.w13.device))
            else:  # dense: use the resident experts in place, no copy
                w13_nFD, w2_nDI = experts.w13, experts.w2
            for i, expert in enumerate(chunk):
                j = i if experts.packed else expert
                start, count = starts[expert], counts[expert]
                rows = token_of_slot[start : start + count]
                gate_up = h_TD[rows] @ w13_nFD[j].t()
                a = act(gate_up[:, :half], gate_up[:, half:]).to(h_TD.dtype)
                if act_quant is not None:
                    a = act_quant(a)
                y = (a @ w2_nDI[j].t()).float()
                out_TD.index_add_(0, rows, y * slot_weight[start : start + count, None])
            del w13_nFD, w2_nDI
        return out_TD


def aiter_unavailable_reason() -> str | None:
    """None when AMD's aiter offers a fused SiTU MoE here, else why it cannot be used."""
    if not (torch.cuda.is_available() and torch.version.hip):
        return "aiter needs a ROCm GPU; this process has none"
    if importlib.util.find_spec("aiter") is None:
        return "the aiter package (PyPI amd-aiter) is not installed"
    try:
        aiter = importlib.import_module("aiter")
        fused_moe = importlib.import_module("aiter.fused_moe").fused_moe
    except Exception as exc:  # a broken ROCm install must not take the torch path down
        return f"import aiter failed: {exc}"
    if not hasattr(getattr(aiter, "ActivationType", None), "Situv2"):
        return "this aiter build has no SiTU (ActivationType.Situv2) fused MoE"
    params = inspect.signature(fused_moe).parameters
    if not {"beta", "linear_beta", "gate_mode"} <= params.keys():
        return "this aiter build's fused_moe takes no SiTU beta / linear_beta / gate_mode"
    return None


# What ``auto`` tries, in order, before torch. Being available is not enough to serve: each
# candidate must also pass its load-time probe against torch (backend_check.verify_backend).
AUTO_PREFERENCE: tuple[str, ...] = ("aiter",)


def backend_candidates(requested: str) -> tuple[list[str], str]:
    """The backends to try for ``requested``, in order, and why: the requested one alone, or for
    ``auto`` every available preference then ``torch`` (which needs no probe)."""
    if requested != "auto":
        reason = unavailable_reason(requested)
        if reason is not None:
            raise ValueError(f"experts backend {requested!r} is unusable: {reason}")
        return [requested], f"{requested} requested"
    skipped = {name: unavailable_reason(name) for name in AUTO_PREFERENCE}
    usable = [name for name, reason in skipped.items() if reason is None]
    why = "; ".join(f"{name}: {reason}" for name, reason in skipped.items() if reason)
    return [*usable, "torch"], f"auto: {' then '.join([*usable, 'torch'])}" + (f" ({why})" if why else "")


def select_backend(requested: str) -> tuple[str, str]:
    """The first backend ``requested`` would try, and why (before any load-time probe)."""
    names, why = backend_candidates(requested)
    return names[0], why


@register_backend("aiter")
def _aiter_backend(scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> ExpertsBackend:
    # get_backend checks availability first; on a machine where the probe passes the
    # kernel adapter is loaded lazily from the ROCm-only module. The fused kernel reads the
    # resident experts directly, so the scratch budget does not apply to it.
    from .aiter_backend import AiterExperts

    return AiterExperts()


@register_backend("grouped")
def _grouped_backend(scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> ExpertsBackend:
    from .grouped_experts import GroupedExperts

    return GroupedExperts(scratch_bytes)
