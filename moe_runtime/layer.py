"""The latent-MoE layer on one device (DESIGN §2): the truth every TP variant is tested against.

The stages are separate functions so the TP runner composes the same math around its
collectives instead of re-deriving it. Legend: T tokens, H hidden, D latent, E experts,
K experts per token, S shared intermediate (local).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .activation import GatedActivation
from .config import LatentMoEConfig
from .experts import ActQuant, ExpertsBackend, get_backend
from .experts.mxfp4_cpu import dense_linear  # x @ W^T; bf16 on CPU: the fp32-accumulating kernel
from .inputs import logits_shape_problem, not_finite, not_floating, rows_problem
from .router import route
from .units import dtype_name
from .weights import LayerWeights


def check_hidden(x_TH: object, hidden_size: int, dtype: torch.dtype, max_tokens: int | None = None,
                 allow_empty: bool = False, what: str = "hidden_states") -> None:
    """Raise ValueError naming what is wrong with ``[T, H]`` rows of a layer's input (``T == 0``
    only with ``allow_empty``: a cohort worker with nothing to send)."""
    if not isinstance(x_TH, torch.Tensor):
        raise ValueError(f"{what} must be a tensor, got {type(x_TH).__name__}")
    problem = rows_problem(x_TH.shape, dtype_name(x_TH.dtype), dtype_name(dtype), hidden_size, max_tokens,
                           allow_empty, what)
    if problem is not None:
        raise ValueError(problem)
    if not torch.isfinite(x_TH).all():
        raise ValueError(not_finite(what))


class LayerSizes(Protocol):
    """What the input check reads from a layer's config (the latent and the standard ones)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_experts(self) -> int: ...


def check_input(
    x_TH: object,
    cfg: LayerSizes,
    dtype: torch.dtype,
    router_logits_TE: object = None,
    max_tokens: int | None = None,
) -> None:
    """Raise ValueError naming what is wrong with a layer input."""
    check_hidden(x_TH, cfg.hidden_size, dtype, max_tokens)
    T, E = x_TH.shape[0], cfg.num_experts
    if router_logits_TE is not None:
        if not isinstance(router_logits_TE, torch.Tensor):
            raise ValueError(f"router_logits must be a tensor, got {type(router_logits_TE).__name__}")
        problem = logits_shape_problem(router_logits_TE.shape, T, E)
        if problem is not None:
            raise ValueError(problem)
        if not router_logits_TE.is_floating_point():
            raise ValueError(not_floating("router_logits", str(router_logits_TE.dtype)))
        if not torch.isfinite(router_logits_TE).all():
            raise ValueError(not_finite("router_logits"))


def down_project(x_TH: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """Routed input transform: ``h = x · Wdown^T``."""
    return dense_linear(x_TH, w.down_DH)


def routed_experts(
    x_TH: torch.Tensor,
    h_TD: torch.Tensor,
    w: LayerWeights,
    cfg: LatentMoEConfig,
    backend: ExpertsBackend,
    act: GatedActivation,
    router_logits_TE: torch.Tensor | None = None,
    act_quant: ActQuant | None = None,
) -> torch.Tensor:
    """Steps 1, 3 and 4: route on ``x``, run experts on the latent ``h``; fp32 ``L_TD``
    (a partial sum when the expert weights are TP shards)."""
    ids_TK, weights_TK = route(x_TH, w.gate_EH, w.bias_E, cfg, router_logits_TE)
    return backend(h_TD, ids_TK, weights_TK, w.experts, act, act_quant)


def latent_norm(L_TD: torch.Tensor, w: LayerWeights, eps: float) -> torch.Tensor:
    """RMSNorm of the fully summed latent in fp32 (identity when the norm is off)."""
    L = L_TD.float()
    if w.norm_D is None:
        return L
    return L * torch.rsqrt(L.pow(2).mean(-1, keepdim=True) + eps) * w.norm_D


def gated_mlp(x_TH: torch.Tensor, gate_SH: torch.Tensor, up_SH: torch.Tensor, down_HS: torch.Tensor,
              act: GatedActivation) -> torch.Tensor:
    """``act(x·Wg^T, x·Wu^T) · Wd^T`` in the input dtype (a partial sum when the weights are
    intermediate-dimension TP shards): the shared experts of every MoE layer of the package."""
    a = act(dense_linear(x_TH, gate_SH), dense_linear(x_TH, up_SH)).to(x_TH.dtype)
    return dense_linear(a, down_HS)


def shared_experts(x_TH: torch.Tensor, w: LayerWeights, act: GatedActivation) -> torch.Tensor | None:
    """``S = act(x·Wsg^T, x·Wsu^T) · Wsd^T`` in the input dtype (partial under TP)."""
    if not w.has_shared:
        return None
    return gated_mlp(x_TH, w.shared_gate_SH, w.shared_up_SH, w.shared_down_HS, act)


def moe_forward(
    x_TH: torch.Tensor,
    w: LayerWeights,
    cfg: LatentMoEConfig,
    backend: str | ExpertsBackend = "torch",
    router_logits_TE: torch.Tensor | None = None,
    act_quant: ActQuant | None = None,
) -> torch.Tensor:
    """``out = R + S`` for one MoE layer on one device; ``[T, H]`` in the input dtype."""
    be = get_backend(backend) if isinstance(backend, str) else backend
    act = GatedActivation.from_config(cfg)
    h_TD = down_project(x_TH, w)
    L_TD = routed_experts(x_TH, h_TD, w, cfg, be, act, router_logits_TE, act_quant)
    R_TH = dense_linear(latent_norm(L_TD, w, cfg.rms_norm_eps).to(x_TH.dtype), w.up_HD)
    S_TH = shared_experts(x_TH, w, act)
    return R_TH if S_TH is None else R_TH + S_TH
