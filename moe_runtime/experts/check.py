"""Verify a non-``torch`` experts backend against the ``torch`` backend before it serves.

At load, on the real routed experts of the first served layer, a small random probe batch runs
through the candidate and through ``torch`` (the reference: the same math as
``layer.moe_forward``). The candidate serves only if

    max |L_candidate - L_torch| / max |L_torch|  <=  tolerance

with ``L`` the fp32 routed output ``[T, D]``. Otherwise it is refused with these numbers (in the
log and in the runner's ``backend_check``, which the workers report in ``status()``): ``auto``
moves on to its next candidate and finally to ``torch``; an explicitly requested backend fails
the load with a ``ValueError``.

Tolerances: a correct kernel differs from ``torch`` only by rounding. In fp32 that is summation
order, ~1e-6 of max|L|; 1e-4 leaves room for TF32-free GPU GEMM blocking. In bf16/fp16 both sides
round the GEMM outputs and the gated activation to 8 (11) significant bits, ~2**-9 relative
each, and a fused kernel may round at other points; aiter's own SiTU MoE tests accept ~1 %, so
2e-2 of max|L|. A wrong weight layout, gate/up order or activation is off by O(1) of max|L|.
With activation fake-quant (W4A4) a kernel's quantiser may round a tied element the other way,
one FP4 step, which can move a slot's output by a few %: 5e-2.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..activation import GatedActivation
from ..units import dtype_name
from ..weights import ExpertWeights
from .base import REFERENCE_BACKEND, ActQuant, ExpertsBackend, get_backend

logger = logging.getLogger("moe_runtime")

PROBE_TOKENS = 64
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
TOLERANCE_WITH_ACT_QUANT = 5e-2


@dataclass(frozen=True)
class BackendCheck:
    """The outcome of one probe (JSON-able through ``to_dict``)."""

    backend: str
    layer: int
    passed: bool
    rel_err: float | None  # max|diff| / max|ref|; None when the candidate raised
    max_abs_err: float | None
    ref_max_abs: float
    tolerance: float
    tokens: int
    dtype: str
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        probe = f"{self.tokens}-token probe on layer {self.layer} ({self.dtype})"
        if self.error is not None:
            return f"experts backend {self.backend!r} failed its {probe}: {self.error}"
        verdict = "<=" if self.passed else ">"
        return (
            f"experts backend {self.backend!r} {'passed' if self.passed else 'FAILED'} its {probe}: "
            f"max|diff| {self.max_abs_err:.3g} / max|torch| {self.ref_max_abs:.3g} = {self.rel_err:.3g} "
            f"{verdict} tolerance {self.tolerance:g}"
        )


def probe_batch(
    experts: ExpertWeights, top_k: int, tokens: int = PROBE_TOKENS, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h [T, D], ids [T, K], weights [T, K])`` on the experts' device: unit-normal latents,
    K distinct experts per token spread over all of them, positive weights summing to 1."""
    gen = torch.Generator().manual_seed(seed)
    E, D = experts.num_experts, experts.latent_size
    K = min(top_k, E)
    h = torch.randn(tokens, D, generator=gen).to(experts.dtype)
    ids = torch.rand(tokens, E, generator=gen).topk(K, dim=1).indices
    weights = torch.rand(tokens, K, generator=gen) + 0.1
    weights = weights / weights.sum(1, keepdim=True)
    device = experts.w13.device
    return h.to(device), ids.to(device), weights.to(device)


def probe_backend(
    name: str,
    make_candidate: Callable[[], ExpertsBackend],
    experts: ExpertWeights,
    act: GatedActivation,
    *,
    top_k: int,
    layer: int,
    act_quant: ActQuant | None = None,
    tokens: int = PROBE_TOKENS,
    tolerance: float | None = None,
    reference: ExpertsBackend | None = None,
) -> BackendCheck:
    """Build the candidate and run the probe batch through it and the torch backend; compare."""
    if tolerance is None:
        tolerance = TOLERANCE_WITH_ACT_QUANT if act_quant is not None else TOLERANCE.get(experts.dtype, 2e-2)
    reference = reference or get_backend(REFERENCE_BACKEND)
    h, ids, weights = probe_batch(experts, top_k, tokens)
    with torch.inference_mode():
        ref = reference(h, ids, weights, experts, act, act_quant).float()
        ref_max = ref.abs().max().item()
        common = dict(backend=name, layer=layer, ref_max_abs=ref_max, tolerance=tolerance,
                      tokens=tokens, dtype=dtype_name(experts.dtype))
        try:
            got = make_candidate()(h, ids, weights, experts, act, act_quant)
        except Exception as exc:  # a kernel that cannot load or run here is refused, not fatal
            return BackendCheck(passed=False, rel_err=None, max_abs_err=None,
                                error=f"{type(exc).__name__}: {exc}", **common)
        if tuple(got.shape) != tuple(ref.shape):
            error = f"returned shape {list(got.shape)}, expected {list(ref.shape)}"
            return BackendCheck(passed=False, rel_err=None, max_abs_err=None, error=error, **common)
        diff = (got.float() - ref).abs().max().item()
    rel = diff / ref_max if ref_max > 0 else diff
    passed = rel <= tolerance  # NaN compares False: a NaN output is refused
    return BackendCheck(passed=passed, rel_err=rel, max_abs_err=diff, **common)


def verify_backend(
    candidates: list[str],
    requested: str,
    experts: ExpertWeights,
    act: GatedActivation,
    *,
    top_k: int,
    layer: int,
    scratch_bytes: int,
    act_quant: ActQuant | None = None,
) -> tuple[str, list[BackendCheck]]:
    """The first of ``candidates`` that passes its probe (``torch`` needs none), and every probe run.

    ``requested`` is what the deployment asked for: for ``auto`` a refused candidate is skipped;
    for an explicit name it is a ``ValueError`` carrying the numbers.
    """
    checks: list[BackendCheck] = []
    for name in candidates:
        if name == REFERENCE_BACKEND:
            return name, checks
        check = probe_backend(name, functools.partial(get_backend, name, scratch_bytes), experts, act,
                              top_k=top_k, layer=layer, act_quant=act_quant)
        checks.append(check)
        if check.passed:
            logger.info(check.describe())
            return name, checks
        if requested != "auto":
            raise ValueError(f"{check.describe()}; refusing to serve with it")
        logger.warning(f"{check.describe()}; auto skips it")
    raise ValueError(f"no experts backend passed its probe: {[c.describe() for c in checks]}")
