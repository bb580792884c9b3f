"""Adapter from the experts-backend seam to AMD aiter's fused SiTUv2 MoE (ROCm only).

Registered as ``aiter``; the aiter package itself is imported only when a backend is built, and
only after :func:`aiter_unavailable_reason` found a ROCm device and an
aiter build whose ``fused_moe`` takes the SiTU activation and its two betas (ROCm images that
build aiter from source since its Kimi-K3 support; the PyPI wheel ``amd-aiter`` 0.1.7 has
neither). It never serves unverified: ``backend_check`` compares it with the torch backend on the
first served layer's real experts at load.

What aiter's SiTUv2 fused MoE expects, from its ``aiter/fused_moe.py``, ``aiter/ops/shuffle.py``
and ``op_tests/flydsl_tests/test_flydsl_moe_a16wfp4.py``, and from how vLLM's K3 ROCm path
prepares weights for it (``fused_moe/oracle/mxfp4.py``, ``experts/rocm_aiter_moe.py``):

* SiTUv2 runs only as MXFP4 (``QuantType.per_1x32``) weights: ``w13 [E, 2I, D/2]`` and
  ``w2 [E, D, I/2]`` viewed as ``torch.float4_e2m1fn_x2`` (element 2j in the low nibble, as in
  our ``mxfp4``), E8M0 scales viewed as ``torch.float8_e8m0fnu``. There is no bf16-weight SiTUv2
  path, so dense experts are refused.
* Gate rows stacked over up rows (our layout) is ``GateMode.SEPARATED``; it is what the a16w4
  (bf16 activations) and a4w4 kernels read. Only a8w4 wants gate/up row-interleaved weights.
* Weights are pre-shuffled with ``shuffle_weight_a16w4(w, 16, gate_up=False)`` (which marks them
  ``is_shuffled``; the kernels refuse unshuffled weights) and scales with
  ``shuffle_scale_a16w4(scale [E*rows, cols/32], E, False)``.
* Activation precision is chosen by aiter from ``AITER_SITUV2_A4W4`` / ``AITER_SITUV2_A8W4``
  (unset: a16w4). With ``act_quant`` (our W4A4 emulation) the adapter asks for a4w4, which
  quantises ``h`` and the SiTU output to MXFP4 inside the kernels; the probe then checks that
  aiter's quantiser agrees with ours. On aiter's main branch it does not quite: its MoE
  quantisers round a block's exponent up from an amax mantissa of 1.5, our default (Quark's
  ``even``) from 1.75 (docs/conformance.md, "MXFP4 activations: the scale rule").
* ``beta`` / ``linear_beta`` are the SiTU betas; routing weights fp32, ids int32, hidden bf16.

Memory: the shuffled copies are made once per layer, at load (the runner calls :meth:`prepare`),
and kept **next to** the checkpoint-layout experts for good. Both are planned:
:func:`shuffled_bytes` (registered as this backend's ``extra_bytes``) is the memory planner's
``experts_backend`` part, and :meth:`prepare` refuses a shuffle whose bytes differ from it, so
planned bytes = held bytes. Why not drop the packed copy after shuffling: it is the reference's
input (the load-time probe runs torch on it; ``status()`` and the W4A4 check read it), the
shuffled layout is readable by aiter alone, and a path that frees it could not be run without a
ROCm GPU. The sizes assume aiter's shuffles permute without padding (same element count and
1-byte elements: fp4x2 and E8M0), from its source; not measured on a ROCm GPU.

Torch: the two dtypes above are looked up by name (:data:`REQUIRED_TORCH_DTYPES`); a torch without
them (2.7 has ``float8_e8m0fnu`` but not ``float4_e2m1fn_x2``, which came with 2.8) makes the backend
unavailable with a reason naming the torch version, never an ``AttributeError`` at the first forward.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os

import torch

from ..activation import GatedActivation
from ..weights import ExpertWeights
from .base import DEFAULT_SCRATCH_BYTES, Shapes, register_backend

_A4W4_ENV, _A8W4_ENV = "AITER_SITUV2_A4W4", "AITER_SITUV2_A8W4"
# The torch dtypes the adapter views aiter's operands as, and what each holds. torch 2.8 is the
# first release with both (checked in the type stubs of the PyPI wheels: 2.7.1 lacks the first).
REQUIRED_TORCH_DTYPES = {
    "float4_e2m1fn_x2": "the packed MXFP4 expert weights (two e2m1 values per byte)",
    "float8_e8m0fnu": "the E8M0 block scales",
}


def torch_dtypes_reason() -> str | None:
    """None when this torch has every dtype in :data:`REQUIRED_TORCH_DTYPES`, else what is missing."""
    missing = [n for n in REQUIRED_TORCH_DTYPES if not isinstance(getattr(torch, n, None), torch.dtype)]
    if not missing:
        return None
    what = "; ".join(f"torch.{name} ({REQUIRED_TORCH_DTYPES[name]})" for name in missing)
    return (f"torch {torch.__version__} lacks {what}, which aiter's fused MoE takes: it needs torch >= 2.8 "
            "(a ROCm PyTorch image with torch 2.8 or later; cluster.yaml pins one)")


def aiter_unavailable_reason() -> str | None:
    """None when AMD's aiter offers a fused SiTU MoE here, else why it cannot be used."""
    reason = torch_dtypes_reason()
    if reason is not None:
        return reason
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


def shuffled_bytes(shapes: Shapes) -> int:
    """Bytes of the shuffled copies aiter keeps for MXFP4 experts of ``shapes``: one 1-byte
    element (fp4x2 nibble pair, or E8M0 scale) per packed element; dense experts, which aiter's
    SiTUv2 cannot run, get none."""
    if "w13_scale" not in shapes:
        return 0
    return sum(math.prod(shapes[name]) for name in ("w13", "w2", "w13_scale", "w2_scale"))


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@register_backend("aiter", unavailable=aiter_unavailable_reason, extra_bytes=shuffled_bytes, compute=("gpu",))
class AiterExperts:
    """The fused kernel reads the resident experts directly: the scratch budget does not apply."""

    name = "aiter"

    def __init__(self, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> None:
        reason = torch_dtypes_reason()
        if reason is not None:
            raise ValueError(reason)
        self._fp4_dtype, self._e8m0_dtype = (getattr(torch, name) for name in REQUIRED_TORCH_DTYPES)
        import aiter
        from aiter.fused_moe import fused_moe
        from aiter.ops.shuffle import shuffle_scale_a16w4, shuffle_weight_a16w4

        self._aiter, self._fused_moe = aiter, fused_moe
        self._shuffle_weight, self._shuffle_scale = shuffle_weight_a16w4, shuffle_scale_a16w4
        self._prepared_for: ExpertWeights | None = None
        self._prepared: dict[str, torch.Tensor] = {}

    def held_bytes(self) -> int:
        """Bytes of the shuffled copies this backend holds now."""
        return _nbytes(self._prepared)

    def prepare(self, experts: ExpertWeights) -> None:
        """Shuffle ``experts`` for the fused kernel now (the runner calls it at load)."""
        if experts.packed:
            self._prepare(experts)

    def _prepare(self, experts: ExpertWeights) -> dict[str, torch.Tensor]:
        if self._prepared_for is not experts:
            E = experts.num_experts

            def weight(packed: torch.Tensor) -> torch.Tensor:
                return self._shuffle_weight(packed.view(self._fp4_dtype), 16, False)

            def scale(s: torch.Tensor) -> torch.Tensor:
                return self._shuffle_scale(s.view(self._e8m0_dtype).reshape(-1, s.shape[-1]), E, False)

            self._prepared, self._prepared_for = {}, None  # the previous layer's copies go first
            prepared = {
                "w1": weight(experts.w13), "w2": weight(experts.w2),
                "w1_scale": scale(experts.w13_scale), "w2_scale": scale(experts.w2_scale),
            }
            held, planned = _nbytes(prepared), shuffled_bytes(experts.shapes())
            if held != planned:
                raise ValueError(
                    f"aiter's shuffled experts take {held} B but the memory planner counts {planned} B "
                    f"for shapes {experts.shapes()}: the plan would be wrong"
                )
            self._prepared, self._prepared_for = prepared, experts
        return self._prepared

    def __call__(
        self, h_TD, ids_TK, weights_TK, experts: ExpertWeights, act: GatedActivation, act_quant=None
    ) -> torch.Tensor:
        if act.beta is None:
            raise ValueError("the aiter backend runs SiTU experts only; this model uses plain SiLU")
        if not experts.packed:
            raise ValueError(
                "aiter's SiTUv2 fused MoE runs MXFP4 (per_1x32) expert weights only; this layer's "
                "experts are dense (load them packed, or use the torch or grouped backend)"
            )
        if h_TD.dtype != torch.bfloat16:
            raise ValueError(f"aiter's SiTUv2 fused MoE takes bf16 activations, got {h_TD.dtype}")
        # aiter reads these per call; exactly one (or none, for a16w4) may be set.
        os.environ.pop(_A8W4_ENV, None)
        if act_quant is not None:
            os.environ[_A4W4_ENV] = "1"
        else:
            os.environ.pop(_A4W4_ENV, None)
        out_TD = self._fused_moe(
            h_TD,
            topk_weight=weights_TK.float(),
            topk_ids=ids_TK.to(torch.int32),
            activation=self._aiter.ActivationType.Situv2,
            quant_type=self._aiter.QuantType.per_1x32,
            doweight_stage1=False,
            gate_mode="separated",
            beta=act.beta,
            linear_beta=act.beta_lin,
            **self._prepare(experts),
        )
        return out_TD.float()
