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

The shuffled copies are made once per layer on first use and kept next to the checkpoint-layout
experts (which the torch reference and ``status()`` still read).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os

import torch

from ..activation import GatedActivation
from ..weights import ExpertWeights
from .base import DEFAULT_SCRATCH_BYTES, register_backend

_A4W4_ENV, _A8W4_ENV = "AITER_SITUV2_A4W4", "AITER_SITUV2_A8W4"


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


@register_backend("aiter", unavailable=aiter_unavailable_reason)
class AiterExperts:
    """The fused kernel reads the resident experts directly: the scratch budget does not apply."""

    name = "aiter"

    def __init__(self, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> None:
        import aiter
        from aiter.fused_moe import fused_moe
        from aiter.ops.shuffle import shuffle_scale_a16w4, shuffle_weight_a16w4

        self._aiter, self._fused_moe = aiter, fused_moe
        self._shuffle_weight, self._shuffle_scale = shuffle_weight_a16w4, shuffle_scale_a16w4
        self._prepared_for: ExpertWeights | None = None
        self._prepared: dict[str, torch.Tensor] = {}

    def _prepare(self, experts: ExpertWeights) -> dict[str, torch.Tensor]:
        if self._prepared_for is not experts:
            E = experts.num_experts

            def weight(packed: torch.Tensor) -> torch.Tensor:
                return self._shuffle_weight(packed.view(torch.float4_e2m1fn_x2), 16, False)

            def scale(s: torch.Tensor) -> torch.Tensor:
                return self._shuffle_scale(s.view(torch.float8_e8m0fnu).reshape(-1, s.shape[-1]), E, False)

            self._prepared = {
                "w1": weight(experts.w13), "w2": weight(experts.w2),
                "w1_scale": scale(experts.w13_scale), "w2_scale": scale(experts.w2_scale),
            }
            self._prepared_for = experts
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
