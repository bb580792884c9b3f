"""GPU-only checks (CUDA, or ROCm through torch.cuda): skipped on CPU machines.

``scripts/gpu_check.sh`` runs these together with the GPU timings.
"""

from __future__ import annotations

import pytest
import torch

from moe_runtime import mxfp4
from moe_runtime.activation import GatedActivation
from moe_runtime.checkpoint import load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.experts import get_backend
from moe_runtime.experts.aiter_fused import aiter_unavailable_reason
from moe_runtime.experts.check import probe_backend
from moe_runtime.layer import moe_forward
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.plan import TailPlan
from moe_runtime.tp.runner import build_rank_runners
from moe_runtime.weights import ExpertWeights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]
SITU = GatedActivation(4.0, 25.0)


def k3_like_experts(dtype: torch.dtype, packed: bool, E: int = 64, D: int = 512, I: int = 256) -> ExpertWeights:
    """Random experts with K3's layout and MXFP4 values, at sizes aiter's a16w4 shuffle accepts
    (D and I multiples of 128), on the GPU."""
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, D, generator=gen) * D**-0.5
    w2 = torch.randn(E, D, I, generator=gen) * I**-0.5
    (p13, s13), (p2, s2) = mxfp4.encode(w13), mxfp4.encode(w2)
    ex = (ExpertWeights(p13, p2, s13, s2, dtype=dtype) if packed
          else ExpertWeights(mxfp4.decode(p13, s13, dtype), mxfp4.decode(p2, s2, dtype), dtype=dtype))
    return ex.to("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "grouped"])
def test_runner_on_gpu_matches_cpu_reference(tiny_ckpt, dtype, backend):
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    runner = build_rank_runners(tiny_ckpt, cfg, [1], Collectives(device="cuda"),
                                TailPlan.single("replicated", "test"), dtype=dtype, device="cuda",
                                backend=backend)[1]
    assert runner.backend_name == backend
    x = torch.randn(257, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    ref = moe_forward(x, load_layer_weights(tiny_ckpt, cfg, 1, dtype), cfg)
    got = runner.forward(x.cuda()).cpu()
    # GPU GEMMs block and round differently (TF32 off by default for fp32 matmul in torch,
    # bf16 accumulates in fp32 on both): fp32 within 1e-4, bf16 within a few bf16 ulps.
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "mxfp4"])
def test_grouped_backend_passes_its_probe_on_gpu(dtype, packed):
    """The load-time probe (backend_check tolerances) at K3-like sizes, 64 experts, top-16."""
    ex = k3_like_experts(dtype, packed)
    check = probe_backend("grouped", lambda: get_backend("grouped"), ex, SITU, top_k=16, layer=0)
    assert check.passed, check.describe()


@pytest.mark.skipif(aiter_unavailable_reason() is not None, reason=f"aiter: {aiter_unavailable_reason()}")
@pytest.mark.parametrize("act_quant", [None, "mxfp4"], ids=["a16w4", "a4w4"])
def test_aiter_backend_passes_its_probe(act_quant):
    """The adapter's weight preparation (shuffle, gate mode, dtypes) against the torch backend."""
    quant = None
    if act_quant == "mxfp4":
        def quant(t: torch.Tensor) -> torch.Tensor:
            packed, scale = mxfp4.encode(t)
            return mxfp4.decode(packed, scale, t.dtype)
    ex = k3_like_experts(torch.bfloat16, packed=True)
    check = probe_backend("aiter", lambda: get_backend("aiter"), ex, SITU, top_k=16, layer=0, act_quant=quant)
    assert check.passed, check.describe()


class _Doubling:
    """Rank 0's stand-in forward for the channel check: ``2 x + layer``, on the rows' device."""

    def check(self, layer, x, logits, max_tokens, what):
        return layer, x, logits

    def run(self, layer, x, logits):
        from deployments.common.wire import DeviceRows, WireTensor

        out = x.to_torch(writable=False) * 2 + layer
        return (DeviceRows(out, x.dtype) if isinstance(x, DeviceRows) else WireTensor.from_torch(out)), "replicated"

    def forward_limit(self) -> int:
        return 1 << 20  # the host merges ready layers within it: no limit that matters here

    def counted(self, *args):
        pass


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL channel joins two GPUs (NCCL refuses two "
                    "ranks on one device)")
def test_nccl_channel_carries_a_peers_rows_gpu_to_gpu():
    """Rank 0 on cuda:0 offers NCCL channels; a peer on cuda:1 sends its rows and gets its slice
    over its channel, a second peer sends bytes, one forward over both (tests/test_session_plane.py
    runs the same path over gloo on CPUs)."""
    from concurrent.futures import ThreadPoolExecutor

    from deployments.common.wire import DeviceRows, WireTensor
    from deployments.dataplane import frames
    from deployments.dataplane.host import GroupHost
    from deployments.dataplane.peer import GroupEndpoint, SessionTicket

    H = 64
    host = GroupHost("127.0.0.1", frames.new_secret(), 1, _Doubling(), 60.0, H, "float32", "gpu",
                     channel_device="cuda:0")
    try:
        assert host.channel_backend == "nccl"
        number, secret = host.open(2, 8, "nccl")
        g = GroupEndpoint("d", "r", "l", *host.address, secret, number, (1,), H, "float32", 60.0, 8,
                          host.store_port, host.channel_backend)
        ticket = SessionTicket("nccl", 2, (g,))
        on_gpu = torch.randn(5, H, device="cuda:1")
        on_cpu = torch.randn(3, H)
        with ThreadPoolExecutor(2) as pool:  # NCCL's first send and receive meet from two threads
            gpu_peer = pool.submit(ticket.join, 0, None, "cuda:1").result(timeout=60)
            cpu_peer = ticket.join(1)
            got = pool.submit(gpu_peer.forward, DeviceRows(on_gpu, "float32"), 1)
            plain, _ = cpu_peer.forward(WireTensor.from_torch(on_cpu), 1)
            out, _ = got.result(timeout=60)
        assert isinstance(out, DeviceRows) and out.tensor.device == torch.device("cuda:1")
        assert torch.equal(out.tensor, on_gpu * 2 + 1)
        assert torch.equal(plain.to_torch(), on_cpu * 2 + 1)
        gpu_peer.close()
        cpu_peer.close()
    finally:
        host.stop()
