"""Router: scores, biased top-k selection, unbiased weights (DESIGN §2 step 1).

Legend: T tokens, H hidden, E experts, K experts per token, G expert groups.
"""

from __future__ import annotations

from typing import Protocol

import torch


class RouterConfig(Protocol):
    """What routing reads from a config: ``LatentMoEConfig`` is one, and the standard layers'
    configs (``moe_runtime.standard``) hand theirs over as a ``RouterSpec``."""

    @property
    def moe_router_activation_func(self) -> str: ...  # "sigmoid" | "softmax"
    @property
    def num_experts_per_token(self) -> int: ...
    @property
    def moe_renormalize(self) -> bool: ...
    @property
    def routed_scaling_factor(self) -> float: ...
    @property
    def grouped(self) -> bool: ...  # grouped top-k in force (groups > 1)
    @property
    def num_expert_group(self) -> int: ...
    @property
    def topk_group(self) -> int: ...


def _stable_topk_ids(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    # A stable descending sort keeps the lower index first among equal scores, which is
    # the tie rule of DESIGN §2; torch.topk gives no such guarantee.
    return torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[:, :k]


def _group_mask(select_TE: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """Boolean [T, E] mask of the experts inside each token's top ``topk_group`` groups.

    A group's score is the sum of its two best selection scores (one if the group has a
    single expert), the convention of bias-corrected grouped routers.
    """
    T, E = select_TE.shape
    G = cfg.num_expert_group
    per_group = select_TE.view(T, G, E // G)
    best = torch.sort(per_group, dim=-1, descending=True).values[..., : min(2, E // G)]
    group_ids_TG = _stable_topk_ids(best.sum(-1), cfg.topk_group)
    keep_TG = torch.zeros(T, G, dtype=torch.bool, device=select_TE.device)
    keep_TG.scatter_(1, group_ids_TG, True)
    return keep_TG.repeat_interleave(E // G, dim=1)


def route(
    x_TH: torch.Tensor,
    gate_EH: torch.Tensor,
    bias_E: torch.Tensor,
    cfg: RouterConfig,
    router_logits_TE: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(ids_TK int64, weights_TK float32)``.

    Scores are computed in fp32. The bias only picks the experts; the weights are the
    unbiased scores at the picked ids, renormalised when ``moe_renormalize``, then scaled
    by ``routed_scaling_factor``.
    """
    if router_logits_TE is None:
        logits_TE = x_TH.float() @ gate_EH.float().t()
    else:
        logits_TE = router_logits_TE.float()
    if cfg.moe_router_activation_func == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
    select_TE = scores_TE + bias_E.float()
    if cfg.grouped:
        select_TE = select_TE.masked_fill(~_group_mask(select_TE, cfg), float("-inf"))
    ids_TK = _stable_topk_ids(select_TE, cfg.num_experts_per_token)
    weights_TK = scores_TE.gather(1, ids_TK)
    if cfg.moe_renormalize:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return ids_TK, weights_TK * cfg.routed_scaling_factor
