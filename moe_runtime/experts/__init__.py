"""Routed-experts backends behind one registry (``base``); one module per backend.

Importing the package registers every backend: ``torch`` (the reference, always there),
``grouped`` (torch's grouped GEMM), ``aiter`` (AMD's fused SiTU MoE, ROCm only; the aiter
package is imported only when that backend is built) and ``vllm`` (vLLM's fused MoE kernels on
CUDA, imported only when that backend is asked for). ``check`` probes a candidate against
the reference before it serves.
"""

from . import aiter_fused, grouped, mxfp4_cpu, torch_loop, vllm_fused  # noqa: F401  (registration)
from .base import (
    AUTO_PREFERENCE,
    DEFAULT_SCRATCH_BYTES,
    REFERENCE_BACKEND,
    ActQuant,
    ExpertsBackend,
    backend_candidates,
    check_scratch_bytes,
    get_backend,
    held_bytes,
    planned_backends,
    planned_extra_bytes,
    prepare_backend,
    register_backend,
    registered_backends,
    resident_extra_bytes,
    select_backend,
    slots_by_expert,
    unavailable_reason,
)
from .torch_loop import TorchExperts

__all__ = [
    "AUTO_PREFERENCE", "DEFAULT_SCRATCH_BYTES", "REFERENCE_BACKEND", "ActQuant", "ExpertsBackend",
    "TorchExperts", "backend_candidates", "check_scratch_bytes", "get_backend", "held_bytes",
    "planned_backends", "planned_extra_bytes", "prepare_backend", "register_backend", "registered_backends",
    "resident_extra_bytes", "select_backend", "slots_by_expert", "unavailable_reason",
]
