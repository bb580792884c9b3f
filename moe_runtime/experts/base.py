"""The routed-experts seam (DESIGN §5.6): the backend protocol and a registry keyed by name.

Each backend module registers a factory and an availability hook; the registry never names a
backend itself, and no backend imports another. ``auto`` tries ``AUTO_PREFERENCE`` in order,
then ``torch`` (the reference, always available).

Legend: T tokens, D latent, E experts (local), K slots per token, F = 2 * I_local (gate
rows stacked over up rows), I_local = intermediate rows this rank holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from ..activation import GatedActivation
from ..units import DEFAULT_SCRATCH_BYTES, REFERENCE_BACKEND
from ..weights import ExpertWeights

ActQuant = Callable[[torch.Tensor], torch.Tensor]


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


def always_available() -> str | None:
    return None


Shapes = Mapping[str, tuple[int, ...]]  # ExpertWeights.shapes(): tensor name -> shape
COMPUTE_KINDS = ("cpu", "gpu")


def no_extra_bytes(shapes: Shapes) -> int:
    return 0


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: ``factory(scratch_bytes=...)`` builds it; ``unavailable()`` says why
    it cannot run in this process (None: it can); ``extra_bytes(shapes)`` is what it keeps per
    layer beside the checkpoint-layout experts of those shapes (its own layout; a pure function
    of shapes, so the memory planner asks it before any weight exists, and the backend holds
    exactly that); ``compute`` the kinds of device it can ever run on (the planner plans ``auto``
    for every candidate that may be picked where the ranks compute)."""

    factory: Callable[..., ExpertsBackend]
    unavailable: Callable[[], str | None] = always_available
    extra_bytes: Callable[[Shapes], int] = no_extra_bytes
    compute: tuple[str, ...] = COMPUTE_KINDS


_REGISTRY: dict[str, BackendEntry] = {}
# What ``auto`` tries, in order, before torch. Being available is not enough to serve: each
# candidate must also pass its load-time probe against torch (experts.check.verify_backend).
AUTO_PREFERENCE: tuple[str, ...] = ("aiter",)


def register_backend(
    name: str,
    unavailable: Callable[[], str | None] = always_available,
    extra_bytes: Callable[[Shapes], int] = no_extra_bytes,
    compute: tuple[str, ...] = COMPUTE_KINDS,
) -> Callable:
    """Decorator: register ``factory`` under ``name`` with its availability hook, the bytes it
    keeps beside the experts, and the devices it can run on."""
    unknown = set(compute) - set(COMPUTE_KINDS)
    if not compute or unknown:
        raise ValueError(
            f"backend {name!r}: compute must be a non-empty subset of {COMPUTE_KINDS}, got {compute}"
        )

    def wrap(factory: Callable[..., ExpertsBackend]) -> Callable[..., ExpertsBackend]:
        _REGISTRY[name] = BackendEntry(factory, unavailable, extra_bytes, tuple(compute))
        return factory

    return wrap


def registered_backends() -> list[str]:
    return sorted(_REGISTRY)


def unavailable_reason(name: str) -> str | None:
    """None when backend ``name`` can run here, else why not (unknown names included)."""
    if name not in _REGISTRY:
        return f"unknown experts backend {name!r}; known: {registered_backends()}"
    return _REGISTRY[name].unavailable()


def resident_extra_bytes(name: str, shapes: Shapes) -> int:
    """Bytes backend ``name`` keeps per layer beside checkpoint-layout experts of ``shapes``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown experts backend {name!r}; known: {registered_backends()}")
    return _REGISTRY[name].extra_bytes(shapes)


def planned_backends(requested: str, compute: str) -> list[str]:
    """The backends a rank computing on ``compute`` ("cpu" | "gpu") may serve with when
    ``requested``: the requested one, or for ``auto`` every preference that can run on that
    device, then torch. Decided where the plan is made (a CPU head plans for ROCm workers), so
    availability in this process is not asked: a candidate that may win on the ranks is planned."""
    if compute not in COMPUTE_KINDS:
        raise ValueError(f"compute must be one of {COMPUTE_KINDS}, got {compute!r}")
    if requested != "auto":
        if requested not in _REGISTRY:
            raise ValueError(f"unknown experts backend {requested!r}; known: {registered_backends()}")
        return [requested]
    return [n for n in AUTO_PREFERENCE if n in _REGISTRY and compute in _REGISTRY[n].compute] + [
        REFERENCE_BACKEND
    ]


def planned_extra_bytes(requested: str, compute: str, shapes: Shapes) -> tuple[str, int]:
    """The backend among :func:`planned_backends` that keeps the most beside the experts, and
    those bytes (the planner counts the worst case; on a tie, the later one: torch)."""
    best = max(reversed(planned_backends(requested, compute)), key=lambda n: resident_extra_bytes(n, shapes))
    return best, resident_extra_bytes(best, shapes)


def held_bytes(backend: ExpertsBackend) -> int:
    """Bytes a built backend holds now beside the experts (``held_bytes()``; none by default)."""
    held = getattr(backend, "held_bytes", None)
    return 0 if held is None else int(held())


def prepare_backend(backend: ExpertsBackend, experts: ExpertWeights) -> None:
    """Let a backend make its own copies of a layer's experts now (at load), not on first use."""
    prepare = getattr(backend, "prepare", None)
    if prepare is not None:
        prepare(experts)


def get_backend(name: str, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> ExpertsBackend:
    reason = unavailable_reason(name)
    if reason is not None:
        raise ValueError(reason)
    return _REGISTRY[name].factory(scratch_bytes=scratch_bytes)


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
    order = [*usable, REFERENCE_BACKEND]
    return order, f"auto: {' then '.join(order)}" + (f" ({why})" if why else "")


def select_backend(requested: str) -> tuple[str, str]:
    """The first backend ``requested`` would try, and why (before any load-time probe)."""
    names, why = backend_candidates(requested)
    return names[0], why
