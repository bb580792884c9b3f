"""Conformance with vLLM's own numerics on CPU: SiTU and the MXFP4 decode.

Opt-in lane (``scripts/test.sh --vllm``, docs/conformance.md): skipped where vLLM does not import.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM conformance lane: run scripts/test.sh --vllm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.activation import SituAndMul  # noqa: E402
from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import _dequant_mxfp4_experts  # noqa: E402
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes  # noqa: E402

from moe_runtime import mxfp4  # noqa: E402
from moe_runtime.activation import GatedActivation  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta,linear_beta", [(4.0, 25.0), (4.0, None), (1.0, 1.0), (0.5, 3.0)])
def test_situ_matches_vllm_situ_and_mul_native(dtype, beta, linear_beta):
    gen = torch.Generator().manual_seed(0)
    # Wide inputs so both tanh caps saturate on some elements and stay linear on others.
    gate = (torch.randn(64, 96, generator=gen) * 20).to(dtype)
    up = (torch.randn(64, 96, generator=gen) * 40).to(dtype)
    with set_current_vllm_config(VllmConfig()):
        theirs = SituAndMul(beta, linear_beta).forward_native(torch.cat([gate, up], dim=-1))
    ours = GatedActivation(beta, linear_beta)(gate, up)
    # Both evaluate in fp32 with the same operations in the same order, then vLLM casts to the
    # input dtype: the results must agree bit for bit after the same cast.
    assert theirs.dtype == dtype
    assert torch.equal(ours.to(dtype), theirs)


def test_mxfp4_decode_matches_vllm_moe_dequant_on_every_code_and_scale():
    """Every byte value (both nibbles) against every finite E8M0 scale byte (0..254; 255 is NaN,
    which our decoder rejects), through vLLM's expert-weight dequantiser (bf16 out)."""
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    scales = torch.arange(255, dtype=torch.uint8)
    # Row (s, c) holds bytes 16c..16c+15 (32 values, one MXFP4 block) under scale byte s; one
    # expert, as vLLM's helper takes [E, N, K/2] and [E, N, K/32].
    packed = codes.repeat(scales.numel(), 1).unsqueeze(0)
    scale = scales.repeat_interleave(16).reshape(1, -1, 1)
    theirs = _dequant_mxfp4_experts(packed, scale)
    ours = mxfp4.decode(packed, scale, torch.bfloat16)
    assert theirs.dtype == ours.dtype == torch.bfloat16
    # Exact: both decode to fp32 value * 2**(s-127) and round once to bf16 (inf beyond its range).
    assert torch.equal(ours, theirs)


def test_fp4_code_table_matches_vllm():
    byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    theirs = break_fp4_bytes(byte, torch.float32)
    ours = mxfp4.decode(byte, torch.full((16, 1), 127, dtype=torch.uint8))  # scale 2**0
    assert torch.equal(ours, theirs)
