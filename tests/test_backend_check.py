"""Load-time verification of experts backends: refused when wrong, auto falls back to torch."""

from __future__ import annotations

import logging

import pytest
import torch

from moe_runtime.config import LatentMoEConfig
from moe_runtime.experts import TorchExperts
from moe_runtime.experts import base as experts
from moe_runtime.experts.check import TOLERANCE, probe_backend
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.plan import TailPlan
from moe_runtime.tp.runner import build_rank_runners

LAYER = 1


class GateUpSwapped(TorchExperts):
    """A realistic layout bug: reads w13 as up-over-gate instead of gate-over-up."""

    name = "swapped"

    def __call__(self, h_TD, ids_TK, weights_TK, ex, act, act_quant=None):
        I = ex.intermediate_size

        def flip(t):  # gate rows <-> up rows (of the packed nibbles and their scales alike)
            return None if t is None else torch.cat([t[:, I:], t[:, :I]], 1)

        flipped = type(ex)(flip(ex.w13), ex.w2, flip(ex.w13_scale), ex.w2_scale, dtype=ex.dtype)
        return super().__call__(h_TD, ids_TK, weights_TK, flipped, act, act_quant)


class PerSlotLoop:
    """A correct, independently written backend: one token-slot at a time."""

    name = "loop"

    def __init__(self, scratch_bytes: int = 0):
        pass

    def __call__(self, h_TD, ids_TK, weights_TK, ex, act, act_quant=None):
        I = ex.intermediate_size
        out = torch.zeros(h_TD.shape[0], ex.latent_size)
        for t, (ids, ws) in enumerate(zip(ids_TK.tolist(), weights_TK.tolist(), strict=True)):
            for e, w in zip(ids, ws, strict=True):
                w13, w2 = (m[0] for m in ex.decode(torch.tensor([e])))
                gu = w13 @ h_TD[t]
                out[t] += w * (w2 @ act(gu[:I], gu[I:]).to(h_TD.dtype)).float()
        return out


class Crashes:
    name = "crashes"

    def __init__(self, scratch_bytes: int = 0):
        pass

    def __call__(self, *args, **kwargs):
        raise RuntimeError("no kernel for this device")


@pytest.fixture
def fakes(monkeypatch):
    """Register the fake backends for this test only; ``auto`` prefers them in the given order."""
    for name, factory in {"swapped": GateUpSwapped, "loop": PerSlotLoop, "crashes": Crashes}.items():
        monkeypatch.setitem(experts._REGISTRY, name, experts.BackendEntry(factory))

    def prefer(*names: str) -> None:
        monkeypatch.setattr(experts, "AUTO_PREFERENCE", names)

    return prefer


def build(ckpt, backend: str, dtype=torch.float32):
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    return build_rank_runners(ckpt, cfg, [LAYER, 2], Collectives(), TailPlan.single("replicated", "test"),
                              dtype=dtype, backend=backend)


@pytest.mark.parametrize("mxfp4", [False, True], ids=["dense", "mxfp4"])
def test_wrong_backend_is_refused_and_auto_falls_back_to_torch(make_ckpt, fakes, caplog, mxfp4):
    fakes("swapped")
    with caplog.at_level(logging.INFO, logger="moe_runtime"):
        runners = build(make_ckpt(mxfp4=mxfp4), "auto")
    assert {r.backend_name for r in runners.values()} == {"torch"}
    (check,) = runners[LAYER].backend_checks
    assert check.backend == "swapped" and check.layer == LAYER and not check.passed
    # The gate/up swap is an O(1) error, far past the stated fp32 tolerance.
    assert check.rel_err > 0.1 > TOLERANCE[torch.float32] == check.tolerance
    assert runners[2].backend_checks == [check]  # probed once, on the first served layer
    logged = caplog.text
    assert "'swapped' FAILED" in logged and f"{check.rel_err:.3g}" in logged and "auto skips it" in logged


def test_explicitly_requested_wrong_backend_fails_the_load_with_numbers(tiny_ckpt, fakes):
    with pytest.raises(ValueError, match=r"'swapped' FAILED its 64-token probe on layer 1 .* > tolerance"):
        build(tiny_ckpt, "swapped")


def test_crashing_backend_is_refused_with_its_error(tiny_ckpt, fakes):
    fakes("crashes")
    (check,) = build(tiny_ckpt, "auto")[LAYER].backend_checks
    assert not check.passed and check.rel_err is None and "no kernel for this device" in check.error
    with pytest.raises(ValueError, match="RuntimeError: no kernel for this device"):
        build(tiny_ckpt, "crashes")


def test_backend_that_cannot_even_be_built_is_refused(tiny_ckpt, fakes, monkeypatch):
    def broken_install(scratch_bytes):
        raise ImportError("cannot import name 'shuffle_weight_a16w4'")

    monkeypatch.setitem(experts._REGISTRY, "broken", experts.BackendEntry(broken_install))
    fakes("broken")
    (check,) = build(tiny_ckpt, "auto")[LAYER].backend_checks
    assert not check.passed and "ImportError: cannot import name" in check.error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_correct_backend_is_accepted(tiny_ckpt, fakes, dtype):
    fakes("swapped", "loop")  # auto: the wrong one is skipped, the correct one serves
    runners = build(tiny_ckpt, "auto", dtype)
    assert runners[LAYER].backend_name == "loop"
    swapped, loop = runners[LAYER].backend_checks
    assert not swapped.passed and loop.passed and loop.rel_err <= loop.tolerance == TOLERANCE[dtype]
    assert build(tiny_ckpt, "loop", dtype)[LAYER].backend_checks[0].passed


def test_auto_without_candidates_is_torch_without_probes(tiny_ckpt):
    runner = build(tiny_ckpt, "auto")[LAYER]  # aiter needs a ROCm GPU: never available here
    assert runner.backend_name == "torch" and runner.backend_checks == []


def test_probe_refuses_nan_and_wrong_shapes(tiny_ckpt):
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    ex = build(tiny_ckpt, "torch")[LAYER].w.experts
    act = build(tiny_ckpt, "torch")[LAYER].act

    class Returns:
        name = "returns"

        def __init__(self, value):
            self.value = value

        def __call__(self, h, *args):
            return self.value(h)

    for bad, why in ((lambda h: torch.full((h.shape[0], ex.latent_size), float("nan")), None),
                     (lambda h: torch.zeros(h.shape[0], 3), "returned shape")):
        check = probe_backend("returns", lambda bad=bad: Returns(bad), ex, act, top_k=cfg.num_experts_per_token,
                              layer=LAYER)
        assert not check.passed
        assert (check.error is None) if why is None else why in check.error


def test_a_gpu_serving_with_the_reference_loop_says_so_loudly():
    from moe_runtime.tp.served import slow_backend_warning

    why = "auto: torch (aiter: the aiter package (PyPI amd-aiter) is not installed)"
    warning = slow_backend_warning("torch", torch.device("cuda", 0), why, [])
    assert "torch reference loop" in warning and "aiter: the aiter package" in warning
    assert "several times the forward time" in warning  # the expected cost, not just the fact
    assert slow_backend_warning("torch", torch.device("cpu"), why, []) is None  # CPU: fused path
    assert slow_backend_warning("aiter", torch.device("cuda", 0), why, []) is None
