"""MXFP4: FP4 E2M1 values packed two per byte, one E8M0 scale per block of 32 (DESIGN §3).

Layout along the last dimension of a ``[rows, n]`` tensor: ``packed [rows, n/2]`` uint8 with
element ``2j`` in the low nibble and ``2j + 1`` in the high nibble; ``scale [rows, n/32]``
uint8, value ``2 ** (s - 127)``. Nibble bit 3 is the sign, bits 0-2 index ``FP4_VALUES``.
"""

from __future__ import annotations

import torch

BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


# Decoding materialises an int32 index (2 bytes per output element) and the fp32 values
# (4 bytes per output element) besides the output; the backend sizes its scratch with this.
DECODE_TEMP_BYTES_PER_ELEMENT = 6


def _pair_lut(device: torch.device) -> torch.Tensor:
    """``[256, 2]`` fp32: the (low nibble, high nibble) values of every byte."""
    mags = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    values = torch.cat([mags, -mags])  # codes 8..15 carry the sign bit
    byte = torch.arange(256, device=device)
    return torch.stack([values[byte & 0x0F], values[byte >> 4]], dim=-1)


def decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Return the ``[..., n]`` tensor that ``packed [..., n/2]`` / ``scale [..., n/32]`` encode.

    Values are formed in fp32 (exact: an FP4 value times a power of two) and then cast.
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scale.dtype}")
    n = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * BLOCK != n:
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not match packed shape "
            f"{tuple(packed.shape)}: expected last dim {n} / {BLOCK} = {n // BLOCK}"
        )
    if scale.numel() and int(scale.max()) == 255:
        raise ValueError("MXFP4 scale byte 255 encodes NaN in E8M0; the checkpoint's scales are corrupt")
    # embedding is a row gather ~3x faster than advanced indexing on CPU: [..., n/2, 2] holds
    # element 2j then 2j + 1 of every byte
    values = torch.nn.functional.embedding(packed.int(), _pair_lut(packed.device))
    blocks = values.view(*packed.shape[:-1], n // BLOCK, BLOCK)
    blocks.mul_(torch.exp2(scale.float() - 127.0).unsqueeze(-1))
    return blocks.view(*packed.shape[:-1], n).to(dtype)


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., n]`` (n a multiple of 32) to ``(packed, scale)``.

    Each block's exponent is the smallest with ``amax / 2**e <= 6``, so nothing clips, and
    every element is rounded to the nearest FP4 value: ``|x - q| <= max(|x|/4, amax/12)``
    per element, ``amax`` being its block's largest magnitude.
    """
    n = x.shape[-1]
    if n % BLOCK:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of {BLOCK}, got {n}")
    blocks = x.float().reshape(*x.shape[:-1], n // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp))
    scaled = blocks / torch.exp2(exp)
    mag_code = torch.bucketize(scaled.abs(), _MIDPOINTS.to(x.device))
    code = (mag_code + 8 * (scaled < 0)).to(torch.uint8).reshape(*x.shape[:-1], n)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    scale = (exp.squeeze(-1) + 127).to(torch.uint8)
    return packed, scale
