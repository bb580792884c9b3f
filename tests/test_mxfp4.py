"""MXFP4 decode/encode (DESIGN §3) against values worked out by hand."""

from __future__ import annotations

import math
import re

import pytest
import torch

from moe_runtime import mxfp4
from moe_runtime.units import SCALE_RULES

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


@pytest.mark.parametrize(("rule", "amax_div"), [("floor", 16), ("even", 14)])
@pytest.mark.parametrize("spread", [1.0, 1e-3, 1e4])
def test_encode_round_trip_within_documented_bound(spread: float, rule: str, amax_div: int) -> None:
    # encode's docstring: |x - q| <= max(|x| / 4, amax / 16) per element under floor,
    # max(|x| / 4, amax / 14) under even, amax = the block's largest magnitude. Rows of mixed
    # magnitudes exercise many exponents.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * spread
    x = x * torch.exp2(torch.randint(-6, 7, (64, 8, 1), generator=gen).float()).repeat_interleave(32, -1).reshape(64, 256)
    packed, scale = mxfp4.encode(x, rule)
    assert packed.shape == (64, 128) and scale.shape == (64, 8)
    q = mxfp4.decode(packed, scale)
    amax = x.reshape(64, 8, 32).abs().amax(-1, keepdim=True).expand(64, 8, 32).reshape(64, 256)
    bound = torch.maximum(x.abs() / 4, amax / amax_div)
    err = (x - q).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
    # The bound is tight: saturated block maxima (|x| just below 8 * scale -> 6 * scale) use
    # most of the relative term.
    assert (err / bound).max().item() > 0.9
    assert ((q == 0) | (torch.sign(q) == torch.sign(x))).all()  # signs survive


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


# -- the two scale rules against an independent, element-by-element encoder ---------------------


def mx_reference(block: list[float], rule: str = "floor") -> tuple[int, list[float]]:
    """One 32-block in plain Python floats: ``(E8M0 byte, decoded values)``.

    ``floor`` (the OCP MX spec): shared exponent ``X = floor(log2(amax)) - 2``. ``even`` (AMD
    Quark's default, ``quark.torch.quantization.utils.even_round``): ``amax`` first rounded
    to a power of two, up when its mantissa is at least 1.75, then the same. ``floor(log2)``
    is found by stepping powers of two (not log2/frexp), and the 1.75 test compares with
    ``1.75 * 2**e`` (exact in binary); ``X`` is clamped to E8M0's [-127, 127]; each element
    goes to the nearest E2M1 magnitude, ties to the even code, anything above 6 to 6.
    """
    amax = max(abs(v) for v in block)
    if amax == 0:
        return 127, [0.0] * len(block)
    e = 0
    while 2.0**e > amax:
        e -= 1
    while 2.0 ** (e + 1) <= amax:
        e += 1
    if rule == "even" and amax >= 1.75 * 2.0**e:
        e += 1
    X = max(-127, min(127, e - 2))
    scale = 2.0**X
    out = []
    for v in block:
        m = abs(v) / scale
        best = 0
        for code, g in enumerate(mxfp4.FP4_VALUES):
            d, d_best = abs(m - g), abs(m - mxfp4.FP4_VALUES[best])
            if d < d_best or (d == d_best and code % 2 == 0 and best % 2 == 1):
                best = code
        out.append(math.copysign(mxfp4.FP4_VALUES[best] * scale, v))
    return X + 127, out


def _mantissa_block(m: float, e: int = 3) -> list[float]:
    """A block whose maximum is ``m * 2**e`` (``m`` in [1, 2)) among smaller values."""
    return [m * 2.0**e, -0.3 * 2.0**e] + [(k - 15) * 0.06 * 2.0**e for k in range(30)]


_BELOW_2 = 2.0 - 2.0**-23  # the largest fp32 mantissa
_BELOW_175 = 1.75 - 2.0**-23

EDGE_BLOCKS = {
    "zeros": [0.0] * 32,
    "negative_zeros": [-0.0] * 32,
    # fp32 subnormals (below 2**-126): the exponent clamps at E8M0's floor 2**-127
    "subnormal": [k * 1e-42 for k in range(-16, 16)],
    "tiny_normal": [2.0**-125 * (1 + k / 40) for k in range(32)],
    "below_floor": [2.0**-127 * v for v in (3.0, -1.0, 0.4, 0.2)] + [0.0] * 28,
    # scale 2**-127 (an fp32 subnormal) under both rules; the elements' own rounding decides
    "subnormal_scale": [1.8 * 2.0**-126, 2.0**-127, -0.6 * 2.0**-126] + [k * 2.0**-131 for k in range(29)],
    # the block maximum at and above 6 * 2**X (X = 0 for amax in [4, 8)): 6 exact, 6.5..7.99
    # saturate to 6 under floor; 7.0 and up round the scale up under even; 5.0 is a tie
    "max": [6.0, 6.5, 7.0, 7.5, 7.99, -7.99, 5.0, -5.0] + [0.1 * k for k in range(24)],
    # near fp32's top: floor saturates to 6 * 2**125; even's scale 2**126 puts the maximum on
    # 4 * 2**126 = 2**128, past fp32 (inf, as Quark's even mode gives from 1.75 * 2**127 on)
    "fp32_max": [3.0e38, -3.4e38, 1e38, 1.0] + [0.0] * 28,
    "negatives": [-(k + 1) * 0.37 for k in range(32)],
    # every E2M1 midpoint with a block maximum of 4 (scale 1): ties to the even code
    "ties": [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.0] * 4,
    "tie_negatives": [-0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -4.0] * 4,
    "one_outlier": [1000.0] + [0.01 * k for k in range(31)],
    # amax mantissas at the rules' edges: 1.5 (where aiter's in-kernel and RCEIL quantisers
    # start rounding up; neither rule here does), just below 1.75, 1.75 (even rounds up), just
    # below 2 (even rounds up, floor saturates)
    "mantissa_1.5": _mantissa_block(1.5),
    "mantissa_below_1.75": _mantissa_block(_BELOW_175),
    "mantissa_1.75": _mantissa_block(1.75),
    "mantissa_below_2": _mantissa_block(_BELOW_2, -9),
    # under even a 1.75 block scales to [3.5, 4): its maximum is the 3.5 tie (-> 4.0)
    "even_tie_at_max": [1.75, -1.75, 0.25, 0.125, 0.375] + [0.0] * 27,
}


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("name", list(EDGE_BLOCKS))
def test_encoder_matches_independent_reference(name: str, rule: str) -> None:
    block = EDGE_BLOCKS[name]
    x = torch.tensor([block], dtype=torch.float32)
    ref_byte, ref = mx_reference(x[0].tolist(), rule)  # on the fp32 values the encoder sees
    # The reference's Python floats rounded to fp32: under even, fp32_max's block maximum
    # becomes 4 * 2**126 = 2**128, which fp32 holds only as inf (mxfp4.encode's docstring).
    ref32 = torch.tensor([ref], dtype=torch.float32)
    packed, scale = mxfp4.encode(x, rule)
    assert scale.item() == ref_byte
    assert torch.equal(mxfp4.decode(packed, scale), ref32)
    fq = mxfp4.quantize_dequantize(x, rule)
    assert fq.dtype == torch.float32 and torch.equal(fq, ref32)


@pytest.mark.parametrize(
    ("m", "floor_byte", "even_byte", "floor_max", "even_max"),
    [
        # amax = m * 2**3; floor: scale 2**1 always; even: 2**2 from m = 1.75 on
        (1.0, 128, 128, 8.0, 8.0),
        (1.5, 128, 128, 12.0, 12.0),
        (_BELOW_175, 128, 128, 12.0, 12.0),  # 6.99.. -> 6 under both
        (1.75, 128, 129, 12.0, 16.0),  # floor clips 14 to 12; even: 3.5 ties to 4 -> 16
        (1.9, 128, 129, 12.0, 16.0),
        (_BELOW_2, 128, 129, 12.0, 16.0),
    ],
)
def test_scale_rule_edges_by_hand(m, floor_byte, even_byte, floor_max, even_max) -> None:
    """The rules' only difference, worked out by hand: a block maximum ``m * 8`` with ``m`` in
    [1.75, 2) gets twice the scale under ``even``, so it rounds to 16 instead of clipping to 12."""
    x = torch.tensor([_mantissa_block(m)], dtype=torch.float32)
    for rule, byte, top in (("floor", floor_byte, floor_max), ("even", even_byte, even_max)):
        assert mxfp4.encode(x, rule)[1].item() == byte, rule
        assert mxfp4.quantize_dequantize(x, rule)[0, 0].item() == top, rule


def test_default_rules() -> None:
    """Activations default to the production rule, checkpoint weights to the OCP rule."""
    x = torch.tensor([_mantissa_block(1.8)])
    assert torch.equal(mxfp4.quantize_dequantize(x), mxfp4.quantize_dequantize(x, "even"))
    assert torch.equal(mxfp4.encode(x)[1], mxfp4.encode(x, "floor")[1])
    with pytest.raises(ValueError, match=r"scale rule 'ceil' is not one of \('even', 'floor'\)"):
        mxfp4.quantize_dequantize(x, "ceil")
    with pytest.raises(ValueError, match="scale rule 'nearest'"):
        mxfp4.encode(x, "nearest")


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_random_blocks_match_independent_reference_in_every_dtype(rule: str) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 96, generator=gen) * torch.logspace(-30, 30, 6).unsqueeze(1)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        fq = mxfp4.quantize_dequantize(xd, rule)
        scale = mxfp4.encode(xd, rule)[1]
        assert fq.dtype == dtype and fq.shape == xd.shape
        for r in range(6):
            for b in range(3):
                block = xd[r, 32 * b : 32 * (b + 1)].float().tolist()
                ref_byte, ref = mx_reference(block, rule)
                assert fq[r, 32 * b : 32 * (b + 1)].float().tolist() == ref, (dtype, r, b)
                assert scale[r, b].item() == ref_byte


def test_rules_differ_exactly_on_blocks_with_amax_mantissa_from_1_75() -> None:
    """On random-normal blocks the two rules disagree on a block iff its amax mantissa is >= 1.75
    (and then the scale byte is one higher under even)."""
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(7))
    blocks = x.reshape(-1, 32)
    frac, _ = torch.frexp(blocks.abs().amax(-1))
    up = frac >= 0.875
    floor_s, even_s = mxfp4.encode(x, "floor")[1].reshape(-1), mxfp4.encode(x, "even")[1].reshape(-1)
    assert torch.equal(even_s.int() - floor_s.int(), up.int())
    differ = (mxfp4.quantize_dequantize(x, "floor") != mxfp4.quantize_dequantize(x, "even")).reshape(-1, 32).any(-1)
    assert torch.equal(differ, up)
    assert 0.1 < up.float().mean().item() < 0.25  # ~17 % of random-normal blocks


@pytest.mark.parametrize("rule", SCALE_RULES)
def test_quantize_dequantize_is_idempotent_and_batched(rule: str) -> None:
    """MXFP4 values re-quantise to themselves under either rule (the deferred routed input
    relies on it), and a leading batch shape is fine."""
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)) * 3
    q = mxfp4.quantize_dequantize(x, rule)
    assert torch.equal(mxfp4.quantize_dequantize(q, rule), q)
    assert torch.equal(q, mxfp4.decode(*mxfp4.encode(x, rule)))
    assert not torch.equal(q, x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected(bad: float) -> None:
    x = torch.ones(2, 64)
    x[1, 40] = bad
    with pytest.raises(ValueError, match="activation quantisation input contains NaN or Inf"):
        mxfp4.quantize_dequantize(x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="MXFP4 encode input contains NaN or Inf"):
        mxfp4.encode(x)


def test_quantize_dequantize_rejects_ragged_last_dim() -> None:
    with pytest.raises(ValueError, match="multiple of 32, got 40"):
        mxfp4.quantize_dequantize(torch.zeros(3, 40))
