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


class ExpertsBackend(Protocol):
    name: str

    def __call__(
        self,
        h_TD: torch.Tensor,
        ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        w13_EFD: torch.Tensor,
        w2_EDI: torch.Tensor,
        act: GatedActivation,
    ) -> torch.Tensor:
        """Return the fp32 weighted combine ``L_TD = sum_k w_k * expert_{ids_k}(h)``."""
        ...


_REGISTRY: dict[str, Callable[[], ExpertsBackend]] = {}


def register_backend(name: str) -> Callable:
    def wrap(factory: Callable[[], ExpertsBackend]) -> Callable[[], ExpertsBackend]:
        _REGISTRY[name] = factory
        return factory

    return wrap


def unavailable_reason(name: str) -> str | None:
    if name not in _REGISTRY:
        return f"unknown experts backend {name!r}; known: {sorted(_REGISTRY)}"
    if name == "aiter":
        return aiter_unavailable_reason()
    return None


def get_backend(name: str) -> ExpertsBackend:
    reason = unavailable_reason(name)
    if reason is not None:
        raise ValueError(reason)
    return _REGISTRY[name]()


@register_backend("torch")
class TorchExperts:
    """Sort token-slots by expert and run one GEMM pair per active expert."""

    name = "torch"

    def __call__(self, h_TD, ids_TK, weights_TK, w13_EFD, w2_EDI, act):
        T, K = ids_TK.shape
        out_TD = torch.zeros(T, w2_EDI.shape[1], dtype=torch.float32, device=h_TD.device)
        flat_ids = ids_TK.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=w13_EFD.shape[0]).tolist()
        token_of_slot = order // K
        slot_weight = weights_TK.reshape(-1)[order]
        half = w13_EFD.shape[1] // 2
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of_slot[start : start + count]
            gate_up = h_TD[rows] @ w13_EFD[expert].t()
            a = act(gate_up[:, :half], gate_up[:, half:]).to(h_TD.dtype)
            y = (a @ w2_EDI[expert].t()).float()
            out_TD.index_add_(0, rows, y * slot_weight[start : start + count, None])
            start += count
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
    if not {"beta", "linear_beta"} <= params.keys():
        return "this aiter build's fused_moe takes no SiTU beta / linear_beta"
    return None


def select_backend(requested: str) -> tuple[str, str]:
    """Resolve ``auto`` / a name to a usable backend; return (name, reason)."""
    if requested != "auto":
        reason = unavailable_reason(requested)
        if reason is not None:
            raise ValueError(f"experts backend {requested!r} is unusable: {reason}")
        return requested, f"{requested} requested"
    reason = aiter_unavailable_reason()
    if reason is None:
        return "aiter", "aiter fused SiTU MoE available"
    return "torch", f"torch backend ({reason})"


@register_backend("aiter")
def _aiter_backend() -> ExpertsBackend:
    # get_backend checks availability first; on a machine where the probe passes the
    # kernel adapter is loaded lazily from the ROCm-only module.
    from .aiter_backend import AiterExperts

    return AiterExperts()
