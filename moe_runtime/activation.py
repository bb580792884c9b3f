"""The gated activation shared by routed and shared experts (DESIGN §2 step 3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import LatentMoEConfig


@dataclass(frozen=True)
class GatedActivation:
    """SiTU when ``beta`` is set, else SiLU(g) * u. Always evaluated in fp32.

    ``from_config`` sets the betas only for ``hidden_act == "situ"``: a ``silu`` model that
    carries beta fields runs plain SiLU, as vLLM does."""

    beta: float | None = None
    beta_lin: float | None = None

    @classmethod
    def from_config(cls, cfg: LatentMoEConfig) -> GatedActivation:
        if cfg.uses_situ:
            return cls(cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        return cls()

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Return the fp32 activation of ``gate`` and ``up`` (same shapes)."""
        g, u = gate.float(), up.float()
        if self.beta is None:
            return F.silu(g) * u
        capped = self.beta * torch.tanh(g / self.beta)
        if self.beta_lin is not None:
            u = self.beta_lin * torch.tanh(u / self.beta_lin)
        return capped * torch.sigmoid(g) * u
