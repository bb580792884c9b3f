"""Adapter from the experts-backend seam to AMD aiter's fused MoE with SiTU (ROCm only).

Imported lazily, and only after ``experts.aiter_unavailable_reason()`` found a ROCm device
and an aiter build whose ``fused_moe`` takes the SiTU activation and its two betas. It has
not been run on an MI300X by this project yet: the GPU-marked test
``tests/test_gpu.py::test_aiter_backend_matches_torch`` is the check to run there.
"""

from __future__ import annotations

import torch

from .activation import GatedActivation
from .weights import ExpertWeights


class AiterExperts:
    name = "aiter"

    def __init__(self) -> None:
        import aiter
        from aiter.fused_moe import fused_moe

        self._aiter, self._fused_moe = aiter, fused_moe

    def __call__(
        self, h_TD, ids_TK, weights_TK, experts: ExpertWeights, act: GatedActivation, act_quant=None
    ):
        if act.beta is None:
            raise ValueError("the aiter backend runs SiTU experts only; this model uses plain SiLU")
        if experts.packed:
            raise ValueError(
                "this aiter adapter runs dense experts only; the layer holds MXFP4-packed experts "
                "(use the torch backend, which decodes the active experts per batch)"
            )
        if act_quant is not None:
            raise ValueError("this aiter adapter has no activation fake-quant hook; use the torch backend")
        out_TD = self._fused_moe(
            hidden_states=h_TD,
            w1=experts.w13,  # gate rows stacked over up rows ("separated" gate mode)
            w2=experts.w2,
            topk_weight=weights_TK.float(),
            topk_ids=ids_TK.to(torch.int32),
            activation=self._aiter.ActivationType.Situv2,
            quant_type=self._aiter.QuantType.No,
            doweight_stage1=False,
            beta=act.beta,
            linear_beta=act.beta_lin,
        )
        return out_TD.float()
