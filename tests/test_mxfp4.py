"""MXFP4 decode/encode (DESIGN §3) against values worked out by hand."""

from __future__ import annotations

import re

import pytest
import torch

from moe_runtime import mxfp4

# The 16 FP4 E2M1 codes: bits 0-2 index the magnitude, bit 3 is the sign. Code 8 is -0.0,
# which must decode to a zero.
CODE_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _pack(codes: list[list[int]]) -> torch.Tensor:
    """Pack rows of 4-bit codes by hand: element 2j low nibble, element 2j+1 high nibble."""
    rows = []
    for row in codes:
        assert len(row) % 2 == 0
        rows.append([row[2 * j] | (row[2 * j + 1] << 4) for j in range(len(row) // 2)])
    return torch.tensor(rows, dtype=torch.uint8)


def test_every_code_decodes_to_its_value() -> None:
    codes = list(range(16)) * 2  # 32 elements: one block
    packed = _pack([codes])
    scale = torch.tensor([[127]], dtype=torch.uint8)  # 2^(127-127) = 1
    out = mxfp4.decode(packed, scale)
    assert out.dtype == torch.float32 and out.shape == (1, 32)
    assert out[0].tolist() == CODE_VALUES * 2
    # -0.0 compares equal to 0.0: a sign-only zero carries no value.
    assert out[0, 8].item() == 0.0 and out[0, 0].item() == 0.0


def test_low_nibble_is_the_even_element() -> None:
    # Byte 0x21: low nibble 1 -> 0.5 is element 0, high nibble 2 -> 1.0 is element 1.
    # Byte 0xF7: low nibble 7 -> 6.0, high nibble 15 -> -6.0.
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x21
    packed[0, 1] = 0xF7
    out = mxfp4.decode(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert out[0, :4].tolist() == [0.5, 1.0, 6.0, -6.0]
    assert out[0, 4:].abs().sum().item() == 0.0


@pytest.mark.parametrize(
    ("scale", "factor"),
    [(127, 1.0), (128, 2.0), (126, 0.5), (130, 8.0), (120, 2.0**-7), (0, 2.0**-127), (254, 2.0**127)],
)
def test_e8m0_scales(scale: int, factor: float) -> None:
    # Codes 2 (1.0) and 1 (0.5) so that even the 2^127 extreme stays finite in fp32
    # (6 * 2^127 would not: fp32 tops out near 3.4e38).
    codes = [2, 1] * 16
    packed = _pack([codes])
    out = mxfp4.decode(packed, torch.tensor([[scale]], dtype=torch.uint8))
    expected = torch.tensor([[1.0 * factor, 0.5 * factor] * 16], dtype=torch.float32)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_each_block_uses_its_own_scale_and_rows_are_independent() -> None:
    # Two rows of 64 elements (two blocks each); every element is code 3 (1.5).
    packed = _pack([[3] * 64, [3 + 8] * 64])
    scale = torch.tensor([[127, 129], [126, 0]], dtype=torch.uint8)
    out = mxfp4.decode(packed, scale)
    assert out.shape == (2, 64)
    assert set(out[0, :32].tolist()) == {1.5}
    assert set(out[0, 32:].tolist()) == {6.0}  # 1.5 * 2^2
    assert set(out[1, :32].tolist()) == {-0.75}
    assert set(out[1, 32:].tolist()) == {-1.5 * 2.0**-127}


def test_decode_to_bfloat16_is_exact_for_fp4_values() -> None:
    packed = _pack([list(range(16)) * 2])
    out = mxfp4.decode(packed, torch.tensor([[125]], dtype=torch.uint8), torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert out.float()[0].tolist() == [v / 4 for v in CODE_VALUES * 2]


def test_decode_batched_leading_dims() -> None:
    packed = _pack([list(range(16)) * 2] * 3).reshape(3, 1, 16)
    scale = torch.full((3, 1, 1), 127, dtype=torch.uint8)
    assert mxfp4.decode(packed, scale).shape == (3, 1, 32)


@pytest.mark.parametrize(
    ("packed_shape", "scale_shape"),
    [((1, 16), (1, 2)), ((2, 16), (1, 1)), ((1, 32), (1, 1)), ((1, 8), (1, 1))],
)
def test_decode_rejects_mismatched_shapes(packed_shape, scale_shape) -> None:
    packed = torch.zeros(packed_shape, dtype=torch.uint8)
    scale = torch.full(scale_shape, 127, dtype=torch.uint8)
    n = packed_shape[-1] * 2
    with pytest.raises(ValueError, match=re.escape(f"scale shape {tuple(scale_shape)}")) as info:
        mxfp4.decode(packed, scale)
    assert f"{n} / 32 = {n // 32}" in str(info.value)


def test_decode_rejects_non_uint8() -> None:
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4.decode(torch.zeros(1, 16, dtype=torch.int8), torch.zeros(1, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4.decode(torch.zeros(1, 16, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.float32))


def test_encode_rejects_ragged_last_dim() -> None:
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        mxfp4.encode(torch.zeros(2, 48))


def test_encode_zero_block() -> None:
    packed, scale = mxfp4.encode(torch.zeros(1, 32))
    assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8
    assert packed.shape == (1, 16) and scale.shape == (1, 1)
    assert packed.sum().item() == 0 and scale.item() == 127
    assert mxfp4.decode(packed, scale).abs().sum().item() == 0.0


@pytest.mark.parametrize("spread", [1.0, 1e-3, 1e4])
def test_encode_round_trip_within_documented_bound(spread: float) -> None:
    # encode's docstring: |x - q| <= max(|x| / 4, amax / 12) per element, amax = the block's
    # largest magnitude. Rows of mixed magnitudes exercise many exponents.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * spread
    x = x * torch.exp2(torch.randint(-6, 7, (64, 8, 1), generator=gen).float()).repeat_interleave(32, -1).reshape(64, 256)
    packed, scale = mxfp4.encode(x)
    assert packed.shape == (64, 128) and scale.shape == (64, 8)
    q = mxfp4.decode(packed, scale)
    amax = x.reshape(64, 8, 32).abs().amax(-1, keepdim=True).expand(64, 8, 32).reshape(64, 256)
    bound = torch.maximum(x.abs() / 4, amax / 12)
    err = (x - q).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
    # Nothing clips: the block maximum is kept within its own bound too, and signs survive.
    assert ((q == 0) | (torch.sign(q) == torch.sign(x))).all()


def test_encode_is_exact_on_representable_values() -> None:
    # Blocks of FP4 values times one power of two per block, each block holding a +-6 code so
    # that encode must pick exactly that power: decode(encode(x)) == x bit for bit, and the
    # codes come back identical (-0.0 re-encodes as +0.0, code 8 -> code 0).
    gen = torch.Generator().manual_seed(1)
    rows, blocks = 16, 4
    codes = torch.randint(0, 16, (rows, blocks, 32), generator=gen)
    codes[..., 5] = torch.where(torch.rand(rows, blocks, generator=gen) < 0.5, 7, 15)
    codes = codes.reshape(rows, blocks * 32).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.randint(100, 150, (rows, blocks), generator=gen).to(torch.uint8)
    x = mxfp4.decode(packed, scale)
    packed2, scale2 = mxfp4.encode(x)
    torch.testing.assert_close(mxfp4.decode(packed2, scale2), x, rtol=0, atol=0)
    assert torch.equal(scale2, scale)
    canonical = torch.where(codes == 8, torch.zeros_like(codes), codes)
    assert torch.equal(packed2, canonical[:, 0::2] | (canonical[:, 1::2] << 4))


def test_encode_handles_smaller_maxima_exactly() -> None:
    # A block whose largest value is 2 (or 1.5, 3, 0.5) is still representable; encode picks a
    # smaller exponent and the values survive exactly.
    for top in (0.5, 1.5, 2.0, 3.0, 4.0):
        vals = [v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0) if v <= top]
        row = (vals + [-v for v in vals]) * 32
        x = torch.tensor([row[:32]], dtype=torch.float32) * 2.0**-3
        q = mxfp4.decode(*mxfp4.encode(x))
        torch.testing.assert_close(q, x, rtol=0, atol=0)


def test_nan_scale_byte_is_rejected() -> None:
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="255 encodes NaN"):
        mxfp4.decode(packed, torch.full((1, 1), 255, dtype=torch.uint8))
