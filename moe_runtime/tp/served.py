"""What a rank's runner reports, whichever layer it runs: the latent ``tp.runner.LatentMoERunner``
and the standard ``standard.layer.StandardMoERunner`` alike.

The serving worker (``deployments.serve.worker``) reads the same records from either: the experts
backend and how it runs the experts, the load-time probes of a non-torch backend and a GPU's
slow-path warning, the load time and bytes read, the bytes held by part, and the tail of the last
forward (``forward(x, router_logits)`` and ``last_tail``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..activation import GatedActivation
from ..experts import REFERENCE_BACKEND, ActQuant, get_backend, held_bytes, prepare_backend
from ..experts.check import BackendCheck, verify_backend
from ..logs import log_once
from ..weights import ExpertWeights


class ServedRunner:
    """The records a served runner keeps; ``w`` is its weights (``nbytes_by_part()``)."""

    w: Any

    def init_backend(self, backend: str, scratch_bytes: int, experts: ExpertWeights) -> None:
        """Build the experts backend (its own copies made now, as the planner counts them) and
        reset the records; the builder fills in the load and probe records."""
        self.backend_name = backend
        self.backend = get_backend(backend, scratch_bytes)
        prepare_backend(self.backend, experts)
        self.backend_checks: list[BackendCheck] = []  # the load-time probes (the builder's)
        self.backend_warning: str | None = None  # set when a GPU runs the slow reference loop
        # how the backend runs these experts (torch: fused MXFP4 on CPU, decode, dense) and why
        path = getattr(self.backend, "path", None)
        self.experts_path, self.experts_path_reason = path(experts) if path else (backend, "")
        self.load_s, self.load_bytes_read = 0.0, 0
        self.last_tail: str | None = None

    def resident_bytes(self) -> int:
        return sum(self.resident_bytes_by_part().values())

    def resident_bytes_by_part(self) -> dict[str, int]:
        """The weights by part plus what the experts backend keeps beside them (``experts_backend``)."""
        return {**self.w.nbytes_by_part(), "experts_backend": held_bytes(self.backend)}


def slow_backend_warning(
    backend_name: str, device: torch.device, why: str, checks: list[BackendCheck]
) -> str | None:
    """On a GPU, the reference ``torch`` backend is the slow per-expert loop (two GEMM launches per
    active expert, packed experts decoded into scratch first): say so loudly, with the reason."""
    if device.type != "cuda" or backend_name != REFERENCE_BACKEND:
        return None
    refused = "".join(f"; {c.describe()}" for c in checks)
    return (
        f"experts backend on GPU is the torch reference loop ({why}{refused}): expect several times "
        "the forward time of a fused MoE kernel (2 GEMM launches per active expert per layer, packed "
        "experts decoded to the compute dtype first); install a SiTU-capable aiter (ROCm) or request "
        "backend=grouped to change it"
    )


def choose_backend(
    candidates: list[str], requested: str, why: str, experts: ExpertWeights, act: GatedActivation, *,
    top_k: int, layer: int, scratch_bytes: int, device: torch.device | str, rank: int, label: str,
    act_quant: ActQuant | None = None,
) -> tuple[str, list[BackendCheck], str | None]:
    """The experts backend the runners use, probed on the first served layer's real ``experts``
    (``experts.check.verify_backend``): its name, the probes, and a GPU's slow-path warning.
    Rank 0 logs ``label`` with the choice once."""
    name, checks = verify_backend(candidates, requested, experts, act, top_k=top_k, layer=layer,
                                  scratch_bytes=scratch_bytes, act_quant=act_quant)
    if rank == 0:
        probes = "".join(f"; {c.describe()}" for c in checks)
        log_once(f"{label}{name} ({why}{probes})")
    warning = slow_backend_warning(name, torch.device(device), why, checks)
    if warning is not None:
        log_once(warning, level=logging.WARNING)
    return name, checks, warning
