"""The tensors of one MoE layer as a rank holds them (full on a single device)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LayerWeights:
    """Legend: E experts, H hidden, D latent, F = 2 * I_local (gate rows then up rows),
    I_local = I / P, S_local = Is / P, H_up = H, or H / P when ``Wup`` is pre-sharded."""

    gate_EH: torch.Tensor  # fp32
    bias_E: torch.Tensor  # fp32
    down_DH: torch.Tensor
    norm_D: torch.Tensor | None  # fp32; None when latent_moe_use_norm is off
    up_HD: torch.Tensor  # [H_up, D]
    w13_EFD: torch.Tensor
    w2_EDI: torch.Tensor
    shared_gate_SH: torch.Tensor | None
    shared_up_SH: torch.Tensor | None
    shared_down_HS: torch.Tensor | None

    @property
    def dtype(self) -> torch.dtype:
        return self.down_DH.dtype

    @property
    def has_shared(self) -> bool:
        return self.shared_gate_SH is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.tensors().items()}

    def nbytes(self) -> dict[str, int]:
        return {name: t.numel() * t.element_size() for name, t in self.tensors().items()}

    def to(self, device: torch.device | str) -> LayerWeights:
        moved = {name: t.to(device) for name, t in self.tensors().items()}
        return LayerWeights(**{f.name: moved.get(f.name) for f in fields(self)})
