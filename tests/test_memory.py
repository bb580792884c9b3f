"""Memory planner (moe_runtime.memory): hand-computed Kimi-K3 numbers, real loads, the layer
split, build-time refusal, startup bounds, the warm-up bound and the shipped K3 config.

Every expected byte count below is written out by hand from the K3 shapes (H 7168, D 3584,
E 896, K 16, I 3072, 2 shared experts: Is 6144), never by calling the planner's helpers.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from deployments.app import app_options, decide_app
from deployments.config.resolve import default_max_body_bytes, resolve_deployment
from deployments.config.spec import DeploymentSpec
from deployments.control.cluster_view import ClusterView
from deployments.control.decide import decide, tail_decision
from moe_runtime.checkpoint import checkpoint_expert_formats, load_layer_weights, resolve_expert_formats
from moe_runtime.config import LatentMoEConfig
from moe_runtime.planning import memory
from moe_runtime.planning.budget import Budget, cpu_budget, gpu_budget, node_memory_bytes
from moe_runtime.planning.cost import STARTUP_FLOOR_S, forward_cost_s
from moe_runtime.synthetic import preset_config, write_checkpoint
from moe_runtime.tp.sharding import TPShard
from moe_runtime.units import format_layers

MI300X = "AMD-Instinct-MI300X-OAM"
K3_RAW = preset_config("kimi-k3", num_hidden_layers=93)  # layer 0 dense, layers 1..92 MoE
K3 = LatentMoEConfig.from_dict(K3_RAW)

# Per rank per MoE layer, compute dtype bfloat16 (2 B), by TP size P.
# Routed experts: 896 experts x 3 matrices (w1, w3: [3072/P, 3584]; w2: [3584, 3072/P]).
#   MXFP4: half a byte per element + one E8M0 byte per 32 elements = 0.5 + 1/32 = 17/32 B.
#   dense: 2 B per element.
K3_EXPERT_ELEMENTS = {1: 896 * 3 * 3072 * 3584, 2: 896 * 3 * 1536 * 3584, 8: 896 * 3 * 384 * 3584}
K3_HAND = {
    # P: (experts_packed, experts_dense, shared_experts)
    1: (15_722_348_544, 59_190_018_048, 3 * 6144 * 7168 * 2),
    2: (7_861_174_272, 29_595_009_024, 3 * 3072 * 7168 * 2),
    8: (1_965_293_568, 7_398_752_256, 3 * 768 * 7168 * 2),
}
K3_LATENT = 3584 * 7168 * 2 + 3584 * 4  # Wdown bf16 + RMSNorm gamma fp32 = 51_394_560
K3_UP_FULL = 7168 * 3584 * 2  # 51_380_224
K3_ROUTER = 896 * 7168 * 4 + 896 * 4  # gate fp32 + bias fp32 = 25_693_696


@pytest.mark.parametrize("P", [1, 2, 8])
@pytest.mark.parametrize("fmt", ["mxfp4", "dense"])
@pytest.mark.parametrize("preshard", [False, True])
def test_k3_layer_bytes_by_part_match_hand_arithmetic(P, fmt, preshard):
    packed, dense, shared = K3_HAND[P]
    # The hand numbers themselves: 17/32 B (MXFP4) and 2 B (bf16) per expert element.
    assert packed == K3_EXPERT_ELEMENTS[P] * 17 // 32 and dense == K3_EXPERT_ELEMENTS[P] * 2
    assert K3_LATENT == 51_394_560 and K3_UP_FULL == 51_380_224 and K3_ROUTER == 25_693_696
    expected = {
        "experts_packed": packed if fmt == "mxfp4" else 0,
        "experts_dense": dense if fmt == "dense" else 0,
        "experts_backend": 0,  # torch keeps no copies of its own
        "shared_experts": shared,
        "latent_projections": K3_LATENT,
        "up_projection": 7168 // P * 3584 * 2 if preshard else K3_UP_FULL,
        "router": K3_ROUTER,
    }
    assert memory.layer_bytes(K3, fmt, "bfloat16", P, preshard) == expected
    # aiter keeps a shuffled copy of MXFP4 experts (one byte per packed byte) and none of dense
    # ones (it cannot run them); auto plans it where it may be picked (GPUs), never on CPUs.
    aiter = {**expected, "experts_backend": packed if fmt == "mxfp4" else 0}
    assert memory.layer_bytes(K3, fmt, "bfloat16", P, preshard, backend="aiter") == aiter
    assert memory.layer_bytes(K3, fmt, "bfloat16", P, preshard, backend="auto", compute="gpu") == aiter
    assert memory.layer_bytes(K3, fmt, "bfloat16", P, preshard, backend="auto", compute="cpu") == expected
    assert memory.layer_bytes(K3, fmt, "bfloat16", P, preshard, backend="grouped") == expected


def test_k3_totals_and_float32():
    # DESIGN §8: 15.7 GB packed / 59 GB bf16 per layer at TP 1; ~2.1 GB per GPU at TP 8 packed.
    tp8 = memory.layer_bytes(K3, "mxfp4", "bfloat16", 8)
    assert sum(tp8.values()) == 1_965_293_568 + 33_030_144 + 51_394_560 + 51_380_224 + 25_693_696
    # float32 compute: dense experts, shared experts and the projections double; MXFP4 bytes and
    # the (always fp32) router do not.
    f32 = memory.layer_bytes(K3, "mxfp4", "float32", 8)
    assert f32["experts_packed"] == 1_965_293_568 and f32["router"] == K3_ROUTER
    assert f32["shared_experts"] == 3 * 768 * 7168 * 4
    assert f32["latent_projections"] == 3584 * 7168 * 4 + 3584 * 4


def test_activation_and_workspace_formula_by_hand():
    # TP 8, bf16 (b = 2): I_l = 384, S_l = 768.
    per_token = (7168 * (4 * 2 + 4) + 12 * 896 + 28 * 16 + 2 * 3584 * (2 + 8) + 384 * (3 * 2 + 12)
                 + 768 * (3 * 2 + 12))
    assert per_token == 189_632
    assert memory.activation_bytes_per_token(K3, "bfloat16", 8) == per_token
    plan = memory.plan_memory(K3, {1: "mxfp4"}, "bfloat16", 8, max_tokens=4096)
    assert plan.workspace.total == 256 * 2**20 + 4096 * 189_632
    assert plan.total_bytes == 2_126_792_192 + 256 * 2**20 + 4096 * 189_632
    # the fused MXFP4 CPU path holds no decode scratch, and fp32 copies of each expert's rows:
    # 16 D + 16 I_l = 16 * 3584 + 16 * 384 per token
    fused = memory.plan_memory(K3, {1: "mxfp4"}, "bfloat16", 8, max_tokens=4096, experts_path="fused")
    assert fused.workspace.scratch_bytes == 0
    assert fused.workspace.total == 4096 * (189_632 + 16 * 3584 + 16 * 384)
    with pytest.raises(ValueError, match="experts_path must be one of"):
        memory.plan_memory(K3, {1: "mxfp4"}, "bfloat16", 8, experts_path="fast")


def test_budgets():
    assert gpu_budget().bytes_per_rank == 172_800_000_000  # MI300X 192 GB x 0.9
    cpu = cpu_budget(2, 0.9, node_bytes=24_000_000_000)
    assert cpu.bytes_per_rank == 10_800_000_000 and "/ 2 rank(s)" in cpu.source
    assert node_memory_bytes() > 0
    with pytest.raises(ValueError, match=r"memory_fraction must be in \(0, 1\]"):
        gpu_budget(192, 1.5)


def test_k3_split_over_mi300x_tp8_groups():
    # 92 layers x 2_126_792_192 B = 195.7 GB per rank > 172.8 GB: one TP-8 group cannot hold
    # them even packed; two groups of 46 (97.8 GB + workspace each) can.
    assert 92 * 2_126_792_192 == 195_664_881_664 > 172_800_000_000
    formats = dict.fromkeys(range(1, 93), "mxfp4")
    split = memory.propose_split(K3, formats, "bfloat16", 8, gpu_budget(), max_tokens=16384)
    assert split.ranges == ["1-46", "47-92"]
    head = 172_800_000_000 - (46 * 2_126_792_192 + 256 * 2**20 + 16384 * 189_632)
    assert [p.headroom_bytes for p in split.plans] == [head, head]
    assert split.describe().startswith("92 MoE layers, TP 8, bfloat16, GPU: 192 GB x 0.9")
    assert "2 groups of 46 layers (1-46, 47-92)" in split.describe()
    # Served by aiter (what backend: auto may pick on MI300X), each layer also holds the shuffled
    # copy of its experts: 2_126_792_192 + 1_965_293_568 = 4_092_085_760 B, so at most
    # (172.8e9 - 268_435_456 - 16384 x 189_632) // 4_092_085_760 = 41 layers per group: 3 groups.
    assert (172_800_000_000 - 268_435_456 - 16384 * 189_632) // 4_092_085_760 == 41
    for backend in ("aiter", "auto"):
        split = memory.propose_split(K3, formats, "bfloat16", 8, gpu_budget(), max_tokens=16384, backend=backend)
        assert split.ranges == ["1-31", "32-62", "63-92"]
        assert [p.experts_backend for p in split.plans] == ["aiter"] * 3
        heads = [172_800_000_000 - (n * 4_092_085_760 + 256 * 2**20 + 16384 * 189_632) for n in (31, 31, 30)]
        assert [p.headroom_bytes for p in split.plans] == heads
        assert split.plans[0].by_part["experts_backend"] == 31 * 1_965_293_568
        assert "aiter backend + 60.92 GB of its own copies" in split.plans[0].arithmetic()
    # On CPUs auto can only pick torch: nothing extra, the two groups again.
    cpu = memory.propose_split(K3, formats, "bfloat16", 8, gpu_budget(), max_tokens=16384, backend="auto",
                               compute="cpu")
    assert cpu.ranges == ["1-46", "47-92"] and cpu.plans[0].experts_backend == "torch"
    # Decoded to bf16 (7_560_250_880 B per layer) the same stack needs 5 groups of 18-19 layers:
    # 22 layers would be 166.3 GB of weights + 3.4 GB workspace; the balanced split uses 5.
    dense = memory.propose_split(K3, dict.fromkeys(range(1, 93), "dense"), "bfloat16", 8,
                                 gpu_budget(), max_tokens=16384)
    assert len(dense.groups) == 5 and sorted({len(g) for g in dense.groups}) == [18, 19]
    assert all(p.fits for p in dense.plans)
    # A small budget that fits one layer per group gives single-layer ranges.
    tight = Budget(3 * 10**9, "test")
    assert memory.propose_split(K3, {1: "mxfp4", 2: "mxfp4"}, "bfloat16", 8, tight, max_tokens=1).ranges \
        == ["1", "2"]


def test_refusal_carries_the_arithmetic():
    plan = memory.plan_memory(K3, dict.fromkeys(range(1, 93), "mxfp4"), "bfloat16", 8, max_tokens=8192,
                              budget=gpu_budget())
    assert not plan.fits
    # Room for layers: (172.8e9 - 268_435_456 - 8192 x 189_632) // 2_126_792_192 = 80.
    assert (172_800_000_000 - 268_435_456 - 8192 * 189_632) // 2_126_792_192 == 80
    with pytest.raises(ValueError, match=r"92 layer\(s\) \(1-92\) x ~2.13 GB.*= 195.66 GB.*At most 80"):
        plan.check()
    with pytest.raises(ValueError, match="one layer at TP 8 does not fit"):
        memory.propose_split(K3, {1: "mxfp4"}, "bfloat16", 8, Budget(10**9, "test"))


def test_mxfp4_slices_must_fall_on_blocks():
    tiny = LatentMoEConfig.from_dict(preset_config("tiny"))  # I = 64: TP 4 gives 16-column slices
    with pytest.raises(ValueError, match=r"I / TP = 64 / 4 = 16 .* multiples of the 32-element block"):
        memory.layer_bytes(tiny, "mxfp4", "float32", 4)
    assert memory.layer_bytes(tiny, "dense", "float32", 4)["experts_dense"] == 8 * 3 * 16 * 64 * 4


def test_formats_are_read_from_tensor_names(make_ckpt, tmp_path):
    cfg = LatentMoEConfig.from_dict(preset_config("tiny"))
    assert checkpoint_expert_formats(make_ckpt(mxfp4=True), cfg, [1, 2]) == {1: "mxfp4", 2: "mxfp4"}
    assert checkpoint_expert_formats(make_ckpt(), cfg, [1]) == {1: "dense"}
    assert resolve_expert_formats(cfg, [1], make_ckpt(), "dense") == {1: "dense"}
    with pytest.raises(ValueError, match="experts_format is 'mxfp4' but the checkpoint stores layers 1"):
        resolve_expert_formats(cfg, [1], make_ckpt(), "mxfp4")
    config_only = write_checkpoint(tmp_path / "cfg", preset_config("tiny"), config_only=True)
    assert resolve_expert_formats(cfg, [1, 2], config_only) is None
    assert resolve_expert_formats(cfg, [1, 2], config_only, "mxfp4") == {1: "mxfp4", 2: "mxfp4"}
    with pytest.raises(ValueError, match="give experts_format"):
        memory.plan_checkpoint(config_only, cfg)


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize(("preset", "mxfp4"), [("tiny", False), ("tiny", True), ("medium", True)])
def test_real_load_holds_exactly_the_planned_bytes(make_ckpt, preset, P, mxfp4):
    """A real load's ``LayerWeights.nbytes_by_part()`` equals the planner per part on every
    rank: MXFP4 experts stay packed in memory, as the planner (reading tensor names) assumes."""
    ckpt = make_ckpt(preset, mxfp4=mxfp4)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    for preshard in (False, True):
        plan = memory.plan_checkpoint(ckpt, cfg, [1], "bfloat16", P, preshard)
        assert plan.formats == {1: "mxfp4" if mxfp4 else "dense"}
        for rank in range(P):
            w = load_layer_weights(ckpt, cfg, 1, torch.bfloat16, TPShard(rank, P, preshard))
            assert w.experts.packed == mxfp4
            assert w.nbytes_by_part() == plan.by_part, (rank, preshard)


def _stand_in_aiter(monkeypatch, pad: int = 0) -> None:
    """A fake ``aiter`` package exposing what ``AiterExperts`` imports. Its shuffles permute
    (as aiter's do: same shape, dtype and element count); ``pad`` extra elements per weight
    stand for a shuffle that would not, to show that the accounting check catches it."""
    import sys
    import types

    def permute(t: torch.Tensor) -> torch.Tensor:
        flat = t.view(torch.uint8).flip(-1).contiguous()
        if pad:
            flat = torch.cat([flat.reshape(-1), torch.zeros(pad, dtype=torch.uint8)])
        return flat.view(t.dtype)

    aiter = types.ModuleType("aiter")
    aiter.ActivationType = types.SimpleNamespace(Situv2="situv2")
    aiter.QuantType = types.SimpleNamespace(per_1x32="per_1x32")
    fused = types.ModuleType("aiter.fused_moe")
    fused.fused_moe = lambda *a, beta=None, linear_beta=None, gate_mode=None, **k: None
    ops, shuffle = types.ModuleType("aiter.ops"), types.ModuleType("aiter.ops.shuffle")
    shuffle.shuffle_weight_a16w4 = lambda w, block, gate_up: permute(w)
    shuffle.shuffle_scale_a16w4 = lambda s, experts, gate_up: permute(s)
    for name, module in {"aiter": aiter, "aiter.fused_moe": fused, "aiter.ops": ops,
                         "aiter.ops.shuffle": shuffle}.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_backend_extra_bytes_are_asked_of_the_backend_by_shapes():
    from moe_runtime.experts import planned_backends, planned_extra_bytes, resident_extra_bytes
    from moe_runtime.weights import expert_shapes

    k3_tp8 = expert_shapes(896, 384, 3584, packed=True)
    assert k3_tp8 == {"w13": (896, 768, 1792), "w2": (896, 3584, 192), "w13_scale": (896, 768, 112),
                      "w2_scale": (896, 3584, 12)}
    # aiter's shuffled copy: one byte per packed element, 896 x (768 x (1792 + 112) + 3584 x (192 + 12)).
    assert resident_extra_bytes("aiter", k3_tp8) == 896 * (768 * 1904 + 3584 * 204) == 1_965_293_568
    assert resident_extra_bytes("aiter", expert_shapes(896, 384, 3584, packed=False)) == 0
    assert resident_extra_bytes("torch", k3_tp8) == resident_extra_bytes("grouped", k3_tp8) == 0
    assert planned_backends("auto", "gpu") == ["aiter", "torch"] and planned_backends("auto", "cpu") == ["torch"]
    assert planned_extra_bytes("auto", "gpu", k3_tp8) == ("aiter", 1_965_293_568)
    assert planned_extra_bytes("auto", "gpu", expert_shapes(896, 384, 3584, False)) == ("torch", 0)
    with pytest.raises(ValueError, match="unknown experts backend 'nope'"):
        planned_backends("nope", "gpu")
    with pytest.raises(ValueError, match="compute must be one of .* got 'tpu'"):
        planned_backends("auto", "tpu")


@pytest.mark.parametrize("P", [1, 2])
def test_aiter_load_holds_exactly_the_planned_bytes(make_ckpt, monkeypatch, P):
    """As for torch above, with the aiter backend (a stand-in for its shuffles, no ROCm here): the
    runner's resident bytes by part, shuffled copies included, equal the planner's."""
    from moe_runtime.experts import base
    from moe_runtime.experts.aiter_fused import AiterExperts
    from moe_runtime.tp.collectives import Collectives
    from moe_runtime.tp.plan import TailPlan
    from moe_runtime.tp.runner import LatentMoERunner

    _stand_in_aiter(monkeypatch)
    entry = base._REGISTRY["aiter"]
    monkeypatch.setitem(base._REGISTRY, "aiter", base.BackendEntry(
        entry.factory, base.always_available, entry.extra_bytes, entry.compute))
    ckpt = make_ckpt("tiny", mxfp4=True)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    plan = memory.plan_checkpoint(ckpt, cfg, [1], "bfloat16", P, backend="aiter")
    assert plan.by_part["experts_backend"] == plan.by_part["experts_packed"] > 0
    for rank in range(P):
        w = load_layer_weights(ckpt, cfg, 1, torch.bfloat16, TPShard(rank, P))
        if P == 1:  # one rank: a whole runner (single device), which prepares its backend at load
            runner = LatentMoERunner(cfg, w, Collectives(), TailPlan.single("replicated", "test"),
                                     TPShard(0, 1), "aiter")
            assert runner.resident_bytes_by_part() == plan.by_part
            assert runner.resident_bytes() == plan.weights_bytes
        else:
            experts = AiterExperts()
            experts.prepare(w.experts)
            assert {**w.nbytes_by_part(), "experts_backend": experts.held_bytes()} == plan.by_part, rank
    # A shuffle that padded would make the plan wrong: refused when the copies are made (the
    # load-time probe runs this first, so auto falls back to torch with the reason).
    _stand_in_aiter(monkeypatch, pad=32)
    with pytest.raises(ValueError, match=r"aiter's shuffled experts take \d+ B but the memory planner counts"):
        AiterExperts().prepare(load_layer_weights(ckpt, cfg, 1, torch.bfloat16, TPShard(0, 1)).experts)


# -- deployments: build-time refusal, status fields, startup bound, warm-up bound -------------------


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    """The real K3 config.json (93 layers), no weights."""
    return write_checkpoint(tmp_path_factory.mktemp("k3mem"), K3_RAW, config_only=True)


def test_deployment_that_does_not_fit_is_refused_at_build(k3_dir, tiny_ckpt):
    base = {"checkpoint": str(k3_dir), "tp_size": 8, "dtype": "bfloat16", "accelerator_type": MI300X,
            "experts_format": "mxfp4", "max_tokens_per_request": 8192}
    with pytest.raises(ValueError, match=r"deployment 'moe' does not fit: 92 layer\(s\).*At most 80"):
        app_options(base)
    # Dense (decoded) experts: 23 layers x 7_560_250_880 B = 173.9 GB > 172.8 GB; 22 would fit:
    # (172.8e9 - 268_435_456 - 8192 x 189_632) // 7_560_250_880 = 22.
    assert (172_800_000_000 - 268_435_456 - 8192 * 189_632) // 7_560_250_880 == 22
    with pytest.raises(ValueError, match=r"23 layer\(s\) \(1-23\).*dense.*At most 22"):
        app_options({**base, "experts_format": "dense", "layers": "1-23"})
    # ... a bigger device, or the packed format, fits.
    _, _, decisions = decide_app({**base, "experts_format": "dense", "layers": "1-23",
                                  "device_memory_gb": 256})
    assert decisions[0].memory.fits
    # Format unknown (config only, auto): not checked, and said so.
    _, _, (d,) = decide_app({**base, "experts_format": "auto", "layers": "1-2"})
    assert d.memory is None and "memory not checked" in d.memory_note
    # A real checkpoint: the format is read from it; a tiny GPU refuses the workspace alone.
    with pytest.raises(ValueError, match=r"budget GPU: 0.1 GB x 0.9 = 90.00 MB per rank"):
        app_options({"checkpoint": str(tiny_ckpt), "accelerator_type": MI300X, "device_memory_gb": 0.1})


def test_status_record_and_cpu_budget(tiny_ckpt):
    cpu_only = ClusterView("a CPU-only test cluster", ({"CPU": 2.0},))
    _, resolved, (d,) = decide_app({"checkpoint": str(tiny_ckpt), "tp_size": 2}, cpu_only)
    record = d.to_dict()
    assert record["memory"]["bytes_per_rank_by_part"] == d.memory.by_part
    assert record["memory"]["fits"] and record["memory"]["headroom_bytes_per_rank"] > 0
    # No GPU in the cluster: the CPU budget, the node's memory over the 2 ranks.
    assert d.memory.budget.source.startswith("CPU: node memory") and d.memory_note.startswith("cpu budget")
    # Logical GPUs (no accelerator_type: a CPU machine): GPU bundles, but the ranks compute on the
    # CPU, so the memory is checked against the node's memory too -- one decision for both.
    logical = ClusterView("a CPU machine with logical GPUs", ({"CPU": 4.0, "GPU": 2.0},))
    _, _, (g,) = decide_app({"checkpoint": str(tiny_ckpt), "tp_size": 2}, logical)
    assert g.options["placement_group_bundles"][1] == {"GPU": 1}
    assert g.memory.budget.source.startswith("CPU: node memory") and g.to_dict()["compute"] == "cpu"
    # Small checkpoint: the startup bound is the floor, and the spec the replicas get carries it.
    assert d.startup_timeout_s == STARTUP_FLOOR_S == resolved[0].spec.startup_timeout_s


def test_startup_timeout_is_derived_from_the_planned_bytes(k3_dir):
    args = {"checkpoint": str(k3_dir), "tp_size": 8, "dtype": "bfloat16", "accelerator_type": MI300X,
            "experts_format": "mxfp4", "layers": "1-46"}
    _, resolved, (d,) = decide_app(args)
    # 8 ranks x 46 x 2_126_792_192 B read at 0.25 GB/s = 3130.6 s.
    assert d.startup_timeout_s == 3131 == resolved[0].spec.startup_timeout_s
    _, resolved, (d,) = decide_app({**args, "startup_timeout_s": 1200})
    assert d.startup_timeout_s == 1200  # an explicit value wins


def test_warmup_measurement_stays_within_its_limit():
    spec = DeploymentSpec(tp_size=2, dtype="bfloat16")  # auto, tokens [1, 16, 128, 1024], 3 reps
    plan = memory.plan_memory(K3, {1: "mxfp4"}, "bfloat16", 2, max_tokens=8192)
    cpu_cost = partial(forward_cost_s, plan, K3, device="cpu")
    calls = 4 * 4  # (3 reps + 1 warm-up) x 4 legal tails
    # Estimates (s) at T = 1, 16, 128: cumulative 16 x (1.50 + 17.68) = 307 s fits 450 s; + 128 does not.
    assert calls * (cpu_cost(1) + cpu_cost(16)) < 450 < calls * (cpu_cost(1) + cpu_cost(16) + cpu_cost(128))
    spec = resolve_deployment(spec, "<config>", K3)
    d = tail_decision(spec, K3, cpu_cost, 450.0)
    assert d.pending and d.measure.token_counts == (1, 16)
    assert "over the warm-up limit of 450 s" in d.bound and "measured at T = [1, 16] only" in d.bound
    assert "the static rule's sharded above T = 16" in d.bound and d.estimate_s < 450
    # Time for one count: T = 1 is measured, the rule-based tail serves above it.
    d = tail_decision(spec, K3, cpu_cost, 100.0)
    assert d.pending and d.measure.token_counts == (1,)
    # Not even T = 1 (16 x 1.5 s): the static rule, and the reason says why.
    d = tail_decision(spec, K3, cpu_cost, 10.0)
    assert not d.pending and d.plan.tails == ("sharded",)
    assert "not even T = 1 fits, so the static rule applies" in d.plan.reason
    # On a GPU the whole measurement is estimated at well under a minute: all counts measured.
    gpu = tail_decision(spec, K3, partial(forward_cost_s, plan, K3, device="gpu"), 450.0)
    assert gpu.measure.token_counts == (1, 16, 128, 1024) and gpu.bound is None


def test_body_limit_admits_a_full_request_of_7168_wide_input(k3_dir):
    from safetensors.torch import save

    _, resolved, _ = decide_app({"checkpoint": str(k3_dir), "tp_size": 8, "max_tokens_per_request": 64})
    limit = default_max_body_bytes(resolved)
    body = save({"hidden_states": torch.zeros(64, 7168), "router_logits": torch.zeros(64, 896)})
    assert len(body) <= limit  # F32 hidden states and router logits: the largest legal body
    # At K3's production size: 16384 tokens x (7168 + 896) x 4 B = 528_482_304 B of tensor data.
    _, resolved, _ = decide_app({"checkpoint": str(k3_dir), "tp_size": 8, "max_tokens_per_request": 16384})
    assert default_max_body_bytes(resolved) >= 16384 * (7168 + 896) * 4 + (len(body) - 64 * 8064 * 4)


def test_shipped_k3_config_serves_every_moe_layer_once_and_fits(k3_dir):
    import yaml

    from deployments.config.spec import PROJECT_ROOT as ROOT

    config = yaml.safe_load((ROOT / "deployments/configs/mi300x.yaml").read_text())
    args = dict(config["applications"][0]["args"], checkpoint=str(k3_dir))
    _, resolved, decisions = decide_app(args)  # refuses at build time if any does not fit
    served = sorted(layer for r in resolved for layer in r.layers)
    assert served == K3.moe_layers == list(range(1, 93))  # every MoE layer exactly once
    assert all(d.memory is not None and d.memory.fits for d in decisions)
    assert all(r.spec.tp_size == 8 and r.spec.dtype == "bfloat16" for r in resolved)
    # The ranges are the planner's proposal for this device and token budget.
    spec = resolved[0].spec
    split = memory.propose_split(K3, dict.fromkeys(K3.moe_layers, "mxfp4"), "bfloat16", 8,
                                 gpu_budget(spec.device_memory_gb, spec.memory_fraction),
                                 max_tokens=spec.max_forward_tokens, backend=spec.backend)
    assert [format_layers(r.layers) for r in resolved] == split.ranges
    # backend auto on MI300X may pick aiter: its shuffled copies are planned (3 groups, not 2).
    assert spec.backend == "auto" and len(resolved) == 3
    assert all(d.memory.experts_backend == "aiter" and d.memory.by_part["experts_backend"] > 0 for d in decisions)
    assert decide([r.spec for r in resolved], K3)  # the pure controller agrees (format stated)


def test_cli_explain_prints_bytes_by_part_and_headroom(make_ckpt, k3_dir, capsys):
    from moe_runtime.cli import main

    ckpt = make_ckpt("tiny", mxfp4=True)
    assert main(["forward", "--checkpoint", str(ckpt), "--layer", "1", "--tp", "2", "--explain",
                 "--device-memory-gb", "1", "--max-tokens", "64"]) == 0
    out = capsys.readouterr().out
    # tiny at TP 2, fp32: 8 experts x [64 x (32 + 2) + 64 x (16 + 1)] B = 26_112 B packed experts.
    assert "memory per rank (mxfp4 experts): experts_packed 26.11 kB" in out
    assert "budget GPU: 1 GB x 0.9 = 900.00 MB per rank; headroom" in out and "memory fits: True" in out
    # A config-only checkpoint: planned from the stated format, or said why not.
    assert main(["forward", "--checkpoint", str(k3_dir), "--layer", "1", "--tp", "8", "--dtype", "bfloat16",
                 "--explain", "--experts-format", "mxfp4", "--device-memory-gb", "192"]) == 0
    assert "experts_packed 1.97 GB" in capsys.readouterr().out
    assert main(["forward", "--checkpoint", str(k3_dir), "--layer", "1", "--explain"]) == 0
    assert "memory: not planned: the checkpoint holds no weights" in capsys.readouterr().out
    # `plan`: the split of every MoE layer for a device.
    assert main(["plan", "--checkpoint", str(k3_dir), "--experts-format", "mxfp4", "--max-tokens", "16384",
                 "--backend", "torch"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("2 groups of 46 layers (1-46, 47-92) with at least 71.59 GB headroom per rank")
    assert len(out) == 3 and out[1].strip().startswith("46 layer(s) (1-46) x ~2.13 GB per rank")
    # The default backend is auto: on a GPU it may be aiter, whose shuffled copies are planned.
    assert main(["plan", "--checkpoint", str(k3_dir), "--experts-format", "mxfp4", "--max-tokens", "16384"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("3 groups of 30/31 layers (1-31, 32-62, 63-92) with at least 42.57 GB headroom per rank")
    assert main(["plan", "--checkpoint", str(k3_dir)]) == 2  # format unknown: a clear error
    assert "give --experts-format" in capsys.readouterr().err


# -- a replica start that outlasts the health checks -------------------------------------------

SLOW_CLOCK_SLEEP_S = 2.0
SLOW_CLOCK_LOG = "LMS_SLOW_CLOCK_LOG"


def sleepy_clock() -> float:
    """Warm-up clock (resolved on the workers) that makes the replica's start slow: each reading
    sleeps, and the worker's pid is logged so the test can tell how many groups ever started."""
    with open(os.environ[SLOW_CLOCK_LOG], "a") as log:
        log.write(f"{os.getpid()}\n")
    time.sleep(SLOW_CLOCK_SLEEP_S)  # the slow start under test, not a wait
    return time.perf_counter()


@pytest.mark.ray
@pytest.mark.slow
def test_a_replica_start_longer_than_health_checks_is_not_killed(tiny_ckpt, tmp_path, serve_ports):
    """Ray Serve 2.60 health-checks only RUNNING replicas (deployment_state.py:
    check_and_update_replicas -> _dirty_set_active_pairs) and never stops a STARTING replica
    for being slow (_check_startup_replicas(STARTING) has stop_on_slow False; it only warns
    every 30 s), so the only bound on a long load or warm-up is our startup_timeout_s. Here
    the start lasts >= 16 clock readings x 2 s = 32 s while health checks are due every
    0.5 s with about the shortest timeout the bounds allow (above the health all-reduce's 3 + 5 s):
    had Serve probed the starting replica it would have failed 3 probes within ~27 s
    and replaced it; instead the one group that started serves. The ranks read the clock in
    step, so their collectives wait for no more than the skew between two sleeps."""
    from conftest import TEST_APP, serve_deploy  # here: the workers import this module for its clock

    from deployments.client import MoEClient
    from moe_runtime.layer import moe_forward

    log = tmp_path / "clock.log"
    args = {"checkpoint": str(tiny_ckpt), **TEST_APP, "name": "slow", "tp_size": 2, "tail": "auto",
            "auto_tune_tokens": [1, 2], "auto_tune_reps": 1,
            "tune_clock": f"tests.test_memory:{sleepy_clock.__name__}",
            "health_check_period_s": 0.5, "health_check_timeout_s": 8.5,
            "collective_timeout_s": 3, "call_margin_s": 10, "graceful_shutdown_timeout_s": 1}
    # The clock's log path reaches the workers through the app's environment (they inherit it).
    serve_deploy({"applications": [{
        "name": "slow", "route_prefix": "/", "import_path": "deployments.app:build_app", "args": args,
        "runtime_env": {"env_vars": {SLOW_CLOCK_LOG: str(log)}}}]}, wait_for="slow")
    status = MoEClient("slow", timeout_s=60).status()["deployments"]["slow"]
    assert status["controller"]["measured"]
    # 2 token counts x 4 tails x (start + stop readings) on each of the 2 ranks.
    pids = Path(log).read_text().split()
    assert len(pids) == 2 * 4 * 2 * 2
    assert sorted(set(pids)) == sorted(str(w["pid"]) for w in status["workers"])  # one group ever
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    # fp32 on both sides; another process may block its GEMMs differently: ~1e-7 relative.
    torch.testing.assert_close(MoEClient("slow", timeout_s=60).forward(x, 1),
                               moe_forward(x, load_layer_weights(tiny_ckpt, cfg, 1), cfg), rtol=1e-5, atol=1e-5)
