"""GPU-only checks (CUDA, or ROCm through torch.cuda): skipped on CPU machines."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.checkpoint import load_layer_weights
from moe_runtime.collectives import Collectives
from moe_runtime.config import LatentMoEConfig
from moe_runtime.experts import aiter_unavailable_reason
from moe_runtime.layer import moe_forward
from moe_runtime.plan import TailPlan
from moe_runtime.runner import build_rank_runners

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_on_gpu_matches_cpu_reference(tiny_ckpt, dtype):
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    runner = build_rank_runners(tiny_ckpt, cfg, [1], Collectives(device="cuda"),
                                TailPlan.single("replicated", "test"), dtype=dtype, device="cuda")[1]
    x = torch.randn(257, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    ref = moe_forward(x, load_layer_weights(tiny_ckpt, cfg, 1, dtype), cfg)
    got = runner.forward(x.cuda()).cpu()
    # GPU GEMMs block and round differently (TF32 off by default for fp32 matmul in torch,
    # bf16 accumulates in fp32 on both): fp32 within 1e-4, bf16 within a few bf16 ulps.
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.skipif(aiter_unavailable_reason() is not None, reason=f"aiter: {aiter_unavailable_reason()}")
def test_aiter_backend_matches_torch(tiny_ckpt):
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    w = load_layer_weights(tiny_ckpt, cfg, 1, torch.bfloat16).to("cuda")
    x = torch.randn(64, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    # Both run bf16 GEMMs with fp32 SiTU; fused kernels round intermediates differently.
    torch.testing.assert_close(moe_forward(x, w, cfg, "aiter"), moe_forward(x, w, cfg, "torch"), rtol=3e-2, atol=3e-2)
