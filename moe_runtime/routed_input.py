"""Token-sharded routed input (the reference runner's deferred routed-input projection).

For batches of at least ``min_sharded_tokens`` tokens each rank down-projects only its
``T/P`` token rows, optionally quantises the latent, all-gathers values and scales, and
dequantises, so every rank holds the full ``h [T, D]`` for its experts at ``1/P`` of the
down-projection FLOPs.

Error bounds (per element ``x`` of the latent, before dequantisation):

* ``none``: exact within GEMM reordering (each row's dot products are the same sums).
* ``fp8`` (e4m3, one fp32 scale per token, ``scale = amax_row / 448``): 3 mantissa bits and
  round-to-nearest give ``|x - q| <= |x| * 2**-4 + scale * 2**-10`` (the second term covers
  e4m3 subnormals, spaced ``2**-9 * scale``).
* ``mxfp4`` (E2M1 values, one E8M0 scale per 32 elements): ``|x - q| <= max(|x|/4, amax/12)``
  with ``amax`` the largest magnitude in the element's block (see ``mxfp4.encode``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import mxfp4

QUANT_MODES = ("none", "fp8", "mxfp4")
FP8_MAX = 448.0


@dataclass(frozen=True)
class RoutedInputConfig:
    """``enabled``: token-shard the down-projection for ``T >= min_sharded_tokens``."""

    enabled: bool = False
    quant: str = "none"
    min_sharded_tokens: int = 256

    def __post_init__(self) -> None:
        if self.quant not in QUANT_MODES:
            raise ValueError(f"routed-input quantisation {self.quant!r} is not one of {QUANT_MODES}")
        if self.min_sharded_tokens < 1:
            raise ValueError(f"min_sharded_tokens must be >= 1, got {self.min_sharded_tokens}")
        if self.quant != "none" and not self.enabled:
            raise ValueError(f"routed-input quantisation {self.quant!r} needs the token-sharded routed input")

    def check_latent(self, latent_size: int) -> None:
        if self.quant == "mxfp4" and latent_size % mxfp4.BLOCK:
            raise ValueError(
                f"MXFP4 routed input needs the latent size to be a multiple of {mxfp4.BLOCK}: "
                f"{latent_size} % {mxfp4.BLOCK} = {latent_size % mxfp4.BLOCK}"
            )


def fp8_quantize(h_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3: ``(codes uint8 [T, D], scales fp32 [T, 1])``."""
    h = h_TD.float()
    scale = (h.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (h / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.view(torch.float8_e4m3fn).float() * scale).to(dtype)


def quantize(h_TD: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """The tensors to all-gather for ``mode``: values, then scales (uint8/fp32 rows)."""
    if mode == "fp8":
        return list(fp8_quantize(h_TD))
    if mode == "mxfp4":
        return list(mxfp4.encode(h_TD))
    return [h_TD]


def dequantize(parts: list[torch.Tensor], mode: str, dtype: torch.dtype) -> torch.Tensor:
    if mode == "fp8":
        return fp8_dequantize(parts[0], parts[1], dtype)
    if mode == "mxfp4":
        return mxfp4.decode(parts[0], parts[1], dtype)
    return parts[0]


def wire_bytes(num_tokens: int, latent_size: int, mode: str, dtype: torch.dtype) -> int:
    """Bytes one rank contributes to the all-gather for ``num_tokens`` rows."""
    if mode == "fp8":
        return num_tokens * (latent_size + 4)
    if mode == "mxfp4":
        return num_tokens * (latent_size // 2 + latent_size // mxfp4.BLOCK)
    return num_tokens * latent_size * torch.finfo(dtype).bits // 8
