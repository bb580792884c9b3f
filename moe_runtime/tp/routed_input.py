"""Token-sharded routed input (the reference runner's deferred routed-input projection).

For batches of at least ``min_sharded_tokens`` tokens each rank down-projects only its
``T/P`` token rows and all-gathers them, so every rank holds the full ``h [T, D]`` for its
experts at ``1/P`` of the down-projection FLOPs. What crosses the wire (``quant``):

* ``none``: the latent in the deployment dtype. Exact within GEMM reordering (each row's dot
  products are the same sums), so a request's output does not depend on its batch.
* ``mxfp4``: only with W4A4 experts (``experts_activation_quant: mxfp4``), which quantise
  ``h`` to MXFP4 anyway. The quantisation moves to the local token shard, as in the reference
  runner, and the experts do not quantise ``h`` again: the output is the one of the same
  experts without the token sharding (MXFP4 blocks lie along ``D``, within one token, and
  both use the deployment's ``mxfp4_scale_rule``).
* ``fp8-approx``, ``mxfp4-approx``: a lossy quantisation in front of experts that do not
  quantise their input. **Approximations**: a batch at or above ``min_sharded_tokens`` then
  gets other numbers than a smaller one, so a request's output depends on the batch it
  shares. Opt-in only, never chosen by ``auto``; their measured error is in
  docs/benchmarks/numerics.md. Per element ``x`` of the latent:

  * ``fp8-approx`` (e4m3, one fp32 scale per token, ``scale = amax_row / 448``): 3 mantissa
    bits and round-to-nearest give ``|x - q| <= |x| * 2**-4 + scale * 2**-10`` (the second
    term covers e4m3 subnormals, spaced ``2**-9 * scale``).
  * ``mxfp4-approx`` (MXFP4 with the deployment's ``mxfp4_scale_rule``, see
    ``mxfp4.encode``): ``|x - q| <= max(|x|/4, amax/14)`` (``amax/16`` under ``floor``) with
    ``amax`` the largest magnitude in the element's 32-block.

``auto`` is ``mxfp4`` with W4A4 experts, else ``none``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import mxfp4
from ..units import ACTIVATION_SCALE_RULE

QUANT_MODES = ("none", "mxfp4", "fp8-approx", "mxfp4-approx")
REQUESTABLE_QUANT_MODES = ("auto", *QUANT_MODES)
ACTIVATION_QUANT_MODES = ("none", "mxfp4")  # experts_activation_quant
FP8_MAX = 448.0


@dataclass(frozen=True)
class RoutedInputConfig:
    """``enabled``: token-shard the down-projection for ``T >= min_sharded_tokens``."""

    enabled: bool = False
    quant: str = "auto"
    min_sharded_tokens: int = 256

    def __post_init__(self) -> None:
        if self.quant not in REQUESTABLE_QUANT_MODES:
            raise ValueError(
                f"routed-input quantisation {self.quant!r} is not one of {REQUESTABLE_QUANT_MODES}"
            )
        if self.min_sharded_tokens < 1:
            raise ValueError(f"min_sharded_tokens must be >= 1, got {self.min_sharded_tokens}")
        if self.quant not in ("none", "auto") and not self.enabled:
            raise ValueError(f"routed-input quantisation {self.quant!r} needs the token-sharded routed input")

    def resolve(self, experts_activation_quant: str, latent_size: int) -> RoutedInputConfig:
        """The concrete mode for experts that quantise their activations as given."""
        if experts_activation_quant not in ACTIVATION_QUANT_MODES:
            raise ValueError(
                f"experts activation quantisation {experts_activation_quant!r} is not one of "
                f"{ACTIVATION_QUANT_MODES}"
            )
        w4a4 = experts_activation_quant == "mxfp4"
        quant = self.quant
        if quant == "auto":
            quant = "mxfp4" if self.enabled and w4a4 else "none"
        if quant == "mxfp4" and not w4a4:
            raise ValueError(
                "routed-input quantisation 'mxfp4' moves the experts' own MXFP4 activation "
                "quantisation, so it needs experts_activation_quant 'mxfp4'; in front of "
                "unquantised experts it would change results with the batch size: ask for "
                "'mxfp4-approx' to accept that"
            )
        if quant == "mxfp4-approx" and w4a4:
            raise ValueError("with MXFP4-activation experts use routed-input quantisation 'mxfp4' (exact)")
        if quant in ("mxfp4", "mxfp4-approx") and latent_size % mxfp4.BLOCK:
            raise ValueError(
                f"MXFP4 routed input needs the latent size to be a multiple of {mxfp4.BLOCK}: "
                f"{latent_size} % {mxfp4.BLOCK} = {latent_size % mxfp4.BLOCK}"
            )
        return replace(self, quant=quant)


def fp8_quantize(h_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3: ``(codes uint8 [T, D], scales fp32 [T, 1])``."""
    h = h_TD.float()
    scale = (h.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (h / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.view(torch.float8_e4m3fn).float() * scale).to(dtype)


def quantize(
    h_TD: torch.Tensor, mode: str, scale_rule: str = ACTIVATION_SCALE_RULE
) -> list[torch.Tensor]:
    """The tensors to all-gather for ``mode``: values, then scales (uint8/fp32 rows). MXFP4
    modes pick each block's exponent by ``scale_rule`` (``units.SCALE_RULES``)."""
    if mode == "fp8-approx":
        return list(fp8_quantize(h_TD))
    if mode in ("mxfp4", "mxfp4-approx"):
        return list(mxfp4.encode(h_TD, scale_rule))
    return [h_TD]


def dequantize(parts: list[torch.Tensor], mode: str, dtype: torch.dtype) -> torch.Tensor:
    if mode == "fp8-approx":
        return fp8_dequantize(parts[0], parts[1], dtype)
    if mode in ("mxfp4", "mxfp4-approx"):
        return mxfp4.decode(parts[0], parts[1], dtype)
    return parts[0]
