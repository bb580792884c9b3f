"""MXFP4: FP4 E2M1 values packed two per byte, one E8M0 scale per block of 32 (DESIGN §3).

Layout along the last dimension of a ``[rows, n]`` tensor: ``packed [rows, n/2]`` uint8 with
element ``2j`` in the low nibble and ``2j + 1`` in the high nibble; ``scale [rows, n/32]``
uint8, value ``2 ** (s - 127)``. Nibble bit 3 is the sign, bits 0-2 index ``FP4_VALUES``.
"""

from __future__ import annotations

import torch

from .units import ACTIVATION_SCALE_RULE, WEIGHT_SCALE_RULE, check_scale_rule

BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_EMAX_ELEM = 2  # exponent of E2M1's largest normal, 6 = 1.5 * 2**2 (OCP MX: scale = floor(log2 amax) - emax)

# How a block's shared exponent follows from its largest magnitude ``amax = m * 2**e``
# (``m`` in [1, 2)); the exponent is then clamped to E8M0's [-127, 127]:
# * ``floor``: the OCP MX rule, ``e - 2``: the block maximum scales into [4, 8), and the part
#   above 6 saturates.
# * ``even``: AMD Quark's default ``scale_calculation_mode="even"`` (``even_round``, what vLLM's
#   MXFP4 activation emulation and aiter's Triton quantiser ``_mxfp4_quant_op`` use): ``amax``
#   is first rounded to a power of two, up when ``m >= 1.75`` (add 2**21 to the fp32 bits,
#   drop the mantissa), then ``floor(log2) - 2``: ``e - 1`` when ``m >= 1.75``, else ``e - 2``.
#   Such a block maximum scales into [3.5, 4) instead of [7, 8) and is no longer clipped to 6.
# The names (``SCALE_RULES``, ``WEIGHT_SCALE_RULE``, ``ACTIVATION_SCALE_RULE``) live in ``units``:
# configs check them without torch.
_EVEN_ROUND_UP = 0.875  # frexp mantissa in [0.5, 1): m >= 1.75 is a frexp mantissa >= 0.875


# Decoding materialises an int32 index (2 bytes per output element) and the fp32 values
# (4 bytes per output element) besides the output; the backend sizes its scratch with this.
DECODE_TEMP_BYTES_PER_ELEMENT = 6


def _pair_lut(device: torch.device) -> torch.Tensor:
    """``[256, 2]`` fp32: the (low nibble, high nibble) values of every byte."""
    mags = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    values = torch.cat([mags, -mags])  # codes 8..15 carry the sign bit
    byte = torch.arange(256, device=device)
    return torch.stack([values[byte & 0x0F], values[byte >> 4]], dim=-1)


def decode(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, check_scales: bool = True
) -> torch.Tensor:
    """Return the ``[..., n]`` tensor that ``packed [..., n/2]`` / ``scale [..., n/32]`` encode.

    Values are formed in fp32 (exact: an FP4 value times a power of two) and then cast.
    ``check_scales=False`` skips the NaN-scale scan (a device sync) for scales already checked
    (``ExpertWeights`` checks them once, at load).
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scale.dtype}")
    n = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * BLOCK != n:
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not match packed shape "
            f"{tuple(packed.shape)}: expected last dim {n} / {BLOCK} = {n // BLOCK}"
        )
    if check_scales:
        check_scales_finite(scale)
    # embedding is a row gather ~3x faster than advanced indexing on CPU: [..., n/2, 2] holds
    # element 2j then 2j + 1 of every byte
    values = torch.nn.functional.embedding(packed.int(), _pair_lut(packed.device))
    blocks = values.view(*packed.shape[:-1], n // BLOCK, BLOCK)
    blocks.mul_(torch.exp2(scale.float() - 127.0).unsqueeze(-1))
    return blocks.view(*packed.shape[:-1], n).to(dtype)


def check_scales_finite(scale: torch.Tensor, what: str = "MXFP4 scale") -> None:
    if scale.numel() and int(scale.max()) == 255:
        raise ValueError(f"{what} byte 255 encodes NaN in E8M0; the checkpoint's scales are corrupt")


def _check_blocks(x: torch.Tensor, what: str) -> None:
    n = x.shape[-1]
    if n % BLOCK:
        raise ValueError(f"{what} needs the last dimension to be a multiple of {BLOCK}, got {n}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{what} input contains NaN or Inf; MXFP4 has no encoding for them")


def shared_exponent(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """Each block's shared exponent (float, in E8M0's [-127, 127]) from its largest magnitude
    ``amax`` (>= 0, finite) by ``rule`` (see ``units.SCALE_RULES``); 0 (scale 1) for all-zero blocks."""
    check_scale_rule(rule)
    # frexp: amax = f * 2**k with f in [0.5, 1), so floor(log2(amax)) = k - 1 exactly (also
    # for fp32 subnormals, where a float log2 could round up across a power of two).
    frac, k = torch.frexp(amax)
    log2_floor = k - 1
    if rule == "even":  # amax rounded to a power of two first, up from a mantissa of 1.75
        log2_floor = log2_floor + (frac >= _EVEN_ROUND_UP).to(log2_floor.dtype)
    exp = (log2_floor - _EMAX_ELEM).clamp(-127, 127).float()
    return torch.where(amax > 0, exp, torch.zeros_like(exp))  # all-zero block: scale 1


def _quantize_blocks(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MX quantisation of ``x [..., n]`` with the shared exponent by ``rule``: ``(magnitude
    codes, negative, exponent)``, the codes and signs as ``[..., n/32, 32]`` and the exponent
    as ``[..., n/32, 1]`` float."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    exp = shared_exponent(blocks.abs().amax(-1, keepdim=True), rule)
    scaled = (blocks / torch.exp2(exp)).abs()  # < 8 (floor) or < 7 (even)
    code = torch.bucketize(scaled, _MIDPOINTS.to(x.device))  # ties go to the lower value ...
    tie = (code < len(FP4_VALUES) - 1) & (scaled == _MIDPOINTS.to(x.device)[code.clamp_max(6)])
    code = code + (tie & (code % 2 == 1)).long()  # ... unless that one is odd: ties to even
    return code, blocks < 0, exp  # codes above 6.0's midpoint (5.0) saturate to 6.0


def encode(x: torch.Tensor, scale_rule: str = WEIGHT_SCALE_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., n]`` (n a multiple of 32, finite) to ``(packed, scale)``.

    Each block's scale is ``2**X`` with ``X`` by ``scale_rule`` (``shared_exponent``; weights
    use the OCP rule ``floor(log2(amax)) - 2``, activations Quark's ``even``); every element
    is rounded to the nearest E2M1 value (ties to even) and magnitudes above 6 saturate to 6.
    Per element, ``amax`` being its block's largest magnitude:
    ``|x - q| <= max(|x| / 4, amax / 16)`` under ``floor``, ``max(|x| / 4, amax / 14)`` under
    ``even``. The relative term is reached by saturation (``floor``: ``|x|`` just below
    ``8 * scale`` becomes ``6 * scale``) and by rounding above 1 (half a spacing, at most a
    quarter of the value); the absolute term is half the 0.5 spacing below 1, ``scale / 4``,
    with ``amax >= 4 * scale`` (``floor``) or ``>= 3.5 * scale`` (``even``, whose rounded-up
    blocks have their maximum in [3.5, 4) and never saturate). Blocks with ``amax < 2**-125``
    hit the E8M0 floor ``2**-127``: their absolute term is ``2**-129`` instead. At the top of
    fp32, ``even`` rounds an ``amax >= 1.875 * 2**127`` to ``4 * 2**126 = 2**128``, which
    fp32 (and bf16) can only hold as inf; ``floor`` saturates to ``6 * 2**125``.
    """
    check_scale_rule(scale_rule)
    _check_blocks(x, "MXFP4 encode")
    code, negative, exp = _quantize_blocks(x, scale_rule)
    nibble = (code + 8 * negative).to(torch.uint8).reshape(x.shape)
    packed = nibble[..., 0::2] | (nibble[..., 1::2] << 4)
    scale = (exp.squeeze(-1) + 127).to(torch.uint8)
    return packed, scale


def quantize_dequantize(x: torch.Tensor, scale_rule: str = ACTIVATION_SCALE_RULE) -> torch.Tensor:
    """MXFP4 fake-quant of an activation ``x [..., n]`` along its last dimension (blocks of
    32), returned in ``x``'s dtype: ``decode(*encode(x, scale_rule))`` without packing (the
    W4A4 emulation of the experts' activation quantisation; same rules and bounds as
    ``encode``). The default is the production rule ``even`` (docs/conformance.md)."""
    check_scale_rule(scale_rule)
    _check_blocks(x, "MXFP4 activation quantisation")
    code, negative, exp = _quantize_blocks(x, scale_rule)
    mags = torch.tensor(FP4_VALUES, dtype=torch.float32, device=x.device)[code]
    q = torch.where(negative, -mags, mags) * torch.exp2(exp)
    return q.reshape(x.shape).to(x.dtype)
