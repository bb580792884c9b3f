"""The tensors of one MoE layer as a rank holds them (full on a single device)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from . import mxfp4


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def expert_shapes(
    num_experts: int, intermediate: int, latent: int, packed: bool
) -> dict[str, tuple[int, ...]]:
    """The shapes of one rank's routed-expert tensors (``ExpertWeights.shapes()``), from the
    sizes alone: E experts, ``intermediate`` = I_local rows, ``latent`` = D. Packed: uint8
    nibbles + E8M0 scales; dense: ``w13`` and ``w2`` in the compute dtype."""
    E, F, D, I = num_experts, 2 * intermediate, latent, intermediate
    if not packed:
        return {"w13": (E, F, D), "w2": (E, D, I)}
    return {
        "w13": (E, F, D // 2),
        "w2": (E, D, I // 2),
        "w13_scale": (E, F, D // mxfp4.BLOCK),
        "w2_scale": (E, D, I // mxfp4.BLOCK),
    }


@dataclass
class ExpertWeights:
    """Routed experts of one layer as one rank holds them: dense in the compute dtype, or
    MXFP4 exactly as the checkpoint stores them (uint8 nibbles + E8M0 scales).

    Legend: E experts, F = 2 * I (gate rows then up rows), D latent, I = I_local.
    Dense: ``w13 [E, F, D]``, ``w2 [E, D, I]`` in ``dtype``. Packed: ``w13 uint8 [E, F, D/2]``,
    ``w2 uint8 [E, D, I/2]``, ``w13_scale uint8 [E, F, D/32]``, ``w2_scale uint8 [E, D, I/32]``.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if (self.w13_scale is None) != (self.w2_scale is None):
            raise ValueError("packed experts need both w13_scale and w2_scale (dense experts neither)")
        if self.w13.dim() != 3 or self.w2.dim() != 3:
            raise ValueError(
                f"expert weights must be 3-D [E, rows, cols], got w13 {list(self.w13.shape)} "
                f"and w2 {list(self.w2.shape)}"
            )
        E, F, D, I = self.num_experts, self.w13.shape[1], self.latent_size, self.intermediate_size
        if F % 2:
            raise ValueError(f"w13 stacks gate over up rows, so its rows must be even, got {F}")
        if self.packed:
            expected = {
                "w13": (self.w13, (E, F, D // 2)),
                "w2": (self.w2, (E, D, I // 2)),
                "w13_scale": (self.w13_scale, (E, F, D // mxfp4.BLOCK)),
                "w2_scale": (self.w2_scale, (E, D, I // mxfp4.BLOCK)),
            }
            for name, (t, _) in expected.items():
                if t.dtype != torch.uint8:
                    raise ValueError(f"packed experts' {name} must be uint8, got {t.dtype}")
            for name in ("w13_scale", "w2_scale"):  # once here, so forwards decode without the scan
                mxfp4.check_scales_finite(getattr(self, name), f"MXFP4 experts' {name}")
        else:
            expected = {"w13": (self.w13, (E, F, D)), "w2": (self.w2, (E, D, I))}
            for name, (t, _) in expected.items():
                if t.dtype != self.dtype:
                    raise ValueError(f"dense experts' {name} is {t.dtype}, expected the compute {self.dtype}")
        for name, (t, shape) in expected.items():
            if tuple(t.shape) != shape:
                raise ValueError(f"experts' {name} has shape {tuple(t.shape)}, expected {shape}")

    @property
    def packed(self) -> bool:
        return self.w13_scale is not None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def latent_size(self) -> int:
        """D: the width of the latent the experts read and write."""
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        """I_local: the intermediate rows of each expert this rank holds."""
        return self.w13.shape[1] // 2

    def decode(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [n, F, D], w2 [n, D, I])`` of experts ``ids`` in ``dtype``: MXFP4-decoded
        when packed, a gather (copy) when dense."""
        if not self.packed:
            return self.w13[ids], self.w2[ids]
        return (
            mxfp4.decode(self.w13[ids], self.w13_scale[ids], self.dtype, check_scales=False),
            mxfp4.decode(self.w2[ids], self.w2_scale[ids], self.dtype, check_scales=False),
        )

    def experts_per_chunk(self, scratch_bytes: int) -> int:
        """How many packed experts one decode chunk holds within ``scratch_bytes`` (at least 1)."""
        return max(1, scratch_bytes // self.decoded_bytes_per_expert())

    def decoded_bytes_per_expert(self) -> int:
        """Scratch one decoded expert takes: its two matrices in ``dtype``, plus (packed) the
        fp32 temporaries of decoding the larger one."""
        F, D, I = 2 * self.intermediate_size, self.latent_size, self.intermediate_size
        size = torch.empty((), dtype=self.dtype).element_size()
        out = (F * D + D * I) * size
        return out + (mxfp4.DECODE_TEMP_BYTES_PER_ELEMENT * F * D if self.packed else 0)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape per tensor name (what experts backends size their own copies from)."""
        return {name: tuple(t.shape) for name, t in self.tensors().items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"w13": self.w13, "w2": self.w2, "w13_scale": self.w13_scale, "w2_scale": self.w2_scale}
        return {name: t for name, t in named.items() if t is not None}

    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors().values())

    def to(self, device: torch.device | str) -> ExpertWeights:
        moved = {name: t.to(device) for name, t in self.tensors().items()}
        return ExpertWeights(**moved, dtype=self.dtype)


@dataclass
class LayerWeights:
    """Legend: E experts, H hidden, D latent, S_local = Is / P, H_up = H, or H / P when
    ``Wup`` is pre-sharded."""

    gate_EH: torch.Tensor  # fp32
    bias_E: torch.Tensor  # fp32
    down_DH: torch.Tensor
    norm_D: torch.Tensor | None  # fp32; None when latent_moe_use_norm is off
    up_HD: torch.Tensor  # [H_up, D]
    experts: ExpertWeights
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
        """Every tensor by field name; the experts' as ``experts.w13`` etc."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ExpertWeights):
                out.update({f"experts.{k}": t for k, t in value.tensors().items()})
            elif value is not None:
                out[f.name] = value
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.tensors().items()}

    def nbytes_by_part(self) -> dict[str, int]:
        """Resident bytes by part (``units.PARTS``; every key present, 0 when absent). The loaded
        weights hold no backend copies (``experts_backend`` 0): the runner adds its backend's."""
        experts = self.experts.nbytes()
        shared = (self.shared_gate_SH, self.shared_up_SH, self.shared_down_HS)
        return {
            "experts_packed": experts if self.experts.packed else 0,
            "experts_dense": 0 if self.experts.packed else experts,
            "experts_backend": 0,
            "shared_experts": sum(map(_nbytes, shared)),
            "latent_projections": _nbytes(self.down_DH) + _nbytes(self.norm_D),
            "up_projection": _nbytes(self.up_HD),
            "router": _nbytes(self.gate_EH) + _nbytes(self.bias_E),
        }

    def nbytes(self) -> int:
        return sum(self.nbytes_by_part().values())

    def to(self, device: torch.device | str) -> LayerWeights:
        def move(value):
            return None if value is None else value.to(device)

        return LayerWeights(**{f.name: move(getattr(self, f.name)) for f in fields(self)})
