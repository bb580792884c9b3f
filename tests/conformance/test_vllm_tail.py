"""Conformance with vLLM's ROCm Kimi-K3 runner: the sharded-tail rule and the sharded tail itself.

Opt-in lane (``scripts/test.sh --vllm``, docs/conformance.md): skipped where vLLM does not import.
vLLM's ``ROCmLatentMoERunner`` is built with its base class's constructor stubbed to set only the
state the subclass reads, and with the TP world size / rank / all-reduce replaced by an in-process
group of threads, so its own ``__init__`` decision and ``_shard_up_proj_tail`` run unmodified on CPU.
"""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM conformance lane: run scripts/test.sh --vllm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe.runner import moe_runner as vllm_base  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.models.kimi_k3.amd import latent_moe_runner as vllm_latent  # noqa: E402

from moe_runtime.config import LatentMoEConfig  # noqa: E402
from moe_runtime.tp.plan import TailPlan, legal_tails, shardability_for, sharded_tail_shardability  # noqa: E402
from moe_runtime.tp.runner import build_rank_runners  # noqa: E402


class ThreadGroup:
    """``world`` ranks as threads of this process; a sum all-reduce in rank order on every rank."""

    def __init__(self, world: int):
        self.world = world
        self._slots: list[torch.Tensor | None] = [None] * world
        self._barrier = threading.Barrier(world, timeout=60)
        self._local = threading.local()

    @property
    def rank(self) -> int:
        return self._local.rank

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._slots[self.rank] = t.clone()
        self._barrier.wait()
        total = self._slots[0].clone()
        for part in self._slots[1:]:
            total += part
        self._barrier.wait()  # nobody overwrites a slot before every rank has summed
        return total

    def run(self, fn) -> list:
        results: list = [None] * self.world
        errors: list[BaseException] = []

        def main(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # surfaced below; a dead rank breaks the barrier
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class ThreadComm:
    """Our ``Collectives`` interface (in-place all-reduce) over a ThreadGroup."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world, self.device = group, rank, group.world, torch.device("cpu")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t.copy_(self.group.all_reduce(t))


def stub_vllm(monkeypatch: pytest.MonkeyPatch, world: int, group: ThreadGroup | None = None) -> None:
    """Replace the base-class constructor and the TP helpers the K3 runner module imported."""

    def base_init(self, *, moe_config, routed_output_transform, routed_scaling_factor, shared_experts):
        torch.nn.Module.__init__(self)
        self.moe_config = moe_config
        self.routed_output_transform = routed_output_transform
        self.routed_scaling_factor = routed_scaling_factor
        self._shared_experts = shared_experts

    monkeypatch.setattr(vllm_base.MoERunner, "__init__", base_init)
    monkeypatch.setattr(vllm_latent, "get_tensor_model_parallel_world_size", lambda: world)
    if group is not None:
        monkeypatch.setattr(vllm_latent, "get_tensor_model_parallel_rank", lambda: group.rank)
        monkeypatch.setattr(vllm_latent, "tensor_model_parallel_all_reduce", group.all_reduce)
        monkeypatch.setattr(vllm_base, "tensor_model_parallel_all_reduce", group.all_reduce)


def vllm_runner(
    *, world: int, up_weight: torch.Tensor | None, preshard: bool, has_shared: bool,
    sequence_parallel: bool, scaling: float, norm: torch.nn.Module | None = None,
) -> vllm_latent.ROCmLatentMoERunner:
    up_proj = None if up_weight is None else SimpleNamespace(weight=up_weight)
    transform = SimpleNamespace(up_proj=up_proj, row_sharded=preshard, norm=norm)
    moe_config = SimpleNamespace(
        is_sequence_parallel=sequence_parallel, tp_size=world, ep_size=1, skip_final_all_reduce=False
    )
    return vllm_latent.ROCmLatentMoERunner(
        moe_config=moe_config, routed_output_transform=transform, routed_scaling_factor=scaling,
        shared_experts=object() if has_shared else None,
    )


# Every combination of the six conditions: routed up-projection present, TP size (1 = nothing to
# shard), Wup pre-sharded, Wup rows divisible by TP (8 rows divide 2 and 4, 9 rows divide neither),
# shared experts present, sequence parallelism, and the runner-visible routed scaling factor.
TRUTH_TABLE = list(itertools.product(
    (True, False), (1, 2, 4), (False, True), (8, 9), (True, False), (False, True), (1.0, 2.5)
))


def test_shardability_rule_matches_vllm_runner_on_every_condition(monkeypatch):
    mismatches = []
    for has_up, world, preshard, rows, shared, sp, scaling in TRUTH_TABLE:
        stub_vllm(monkeypatch, world)
        theirs = vllm_runner(
            world=world, up_weight=torch.empty(rows, 4) if has_up else None, preshard=preshard,
            has_shared=shared, sequence_parallel=sp, scaling=scaling,
        )
        ours = sharded_tail_shardability(
            has_up_proj=has_up, tp_size=world, up_proj_rows=rows, preshard_up_proj=preshard,
            has_shared_experts=shared, sequence_parallel=sp, runner_scaling_factor=scaling,
        )
        if theirs._tail_shardable != ours.shardable:
            mismatches.append((has_up, world, preshard, rows, shared, sp, scaling, theirs._tail_shardable))
        elif ours.shardable:
            # The rows each rank up-projects: its pre-sharded block, or its 1/world of Wup.
            assert theirs._up_proj_shard_size == (rows if preshard else rows // world)
    assert not mismatches, f"(up, tp, preshard, rows, shared, sp, scaling, vllm) differ: {mismatches}"
    assert sum(r[0] and r[1] > 1 and r[4] and not r[5] and r[6] == 1.0 for r in TRUTH_TABLE) > 0


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("hidden,shared", [(128, 1), (130, 1), (128, 0)])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_config_rule_matches_vllm_runner_built_like_k3(monkeypatch, world, hidden, shared, sequence_parallel):
    """``shardability_for`` / ``legal_tails`` on a config vs the runner vLLM's K3 model builds for it
    (replicated Wup, scaling factor 1.0 as in every K3 config)."""
    cfg = LatentMoEConfig(
        hidden_size=hidden, routed_expert_hidden_size=64, num_experts=8, num_experts_per_token=2,
        moe_intermediate_size=64, num_hidden_layers=2, num_shared_experts=shared,
    )
    stub_vllm(monkeypatch, world)
    theirs = vllm_runner(
        world=world, up_weight=torch.empty(hidden, 4), preshard=False, has_shared=shared > 0,
        sequence_parallel=sequence_parallel, scaling=cfg.routed_scaling_factor,
    )
    ours = shardability_for(cfg, world, sequence_parallel=sequence_parallel)
    assert ours.shardable == theirs._tail_shardable, ours.reason
    assert ("sharded" in legal_tails(cfg, world, sequence_parallel=sequence_parallel)) == theirs._tail_shardable


def test_scaling_factor_is_folded_by_our_router_not_by_vllm_runner(monkeypatch):
    """The one documented difference: a config with routed_scaling_factor != 1 keeps the sharded
    tail here (our router folds the factor into the top-k weights, so the runner sees 1.0), while
    vLLM's K3 hands the factor to its runner, which then falls back to the replicated tail."""
    cfg = LatentMoEConfig(
        hidden_size=128, routed_expert_hidden_size=64, num_experts=8, num_experts_per_token=2,
        moe_intermediate_size=64, num_hidden_layers=2, num_shared_experts=1, routed_scaling_factor=2.5,
    )
    stub_vllm(monkeypatch, 2)
    theirs = vllm_runner(world=2, up_weight=torch.empty(128, 4), preshard=False, has_shared=True,
                         sequence_parallel=False, scaling=cfg.routed_scaling_factor)
    assert shardability_for(cfg, 2).shardable and not theirs._tail_shardable


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preshard", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_tail_matches_vllm_shard_up_proj_tail(monkeypatch, make_ckpt, world, preshard, dtype):
    """Both tails, on the same per-rank partials and the same Wup / RMSNorm weights, with the same
    simulated all-reduce; vLLM's runs with the fused output in the model dtype, as in production."""
    ckpt = make_ckpt("tiny")
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    layer = cfg.moe_layers[0]
    T, H, D = 5, cfg.hidden_size, cfg.routed_expert_hidden_size
    gen = torch.Generator().manual_seed(world + 10 * preshard)
    L_partials = [torch.randn(T, D, generator=gen) for _ in range(world)]
    S_partials = [torch.randn(T, H, generator=gen).to(dtype) for _ in range(world)]

    group = ThreadGroup(world)
    plan = TailPlan.single("sharded", "conformance")
    runners = [
        build_rank_runners(ckpt, cfg, [layer], ThreadComm(group, r), plan, dtype=dtype,
                           preshard_up_proj=preshard)[layer]
        for r in range(world)
    ]
    ours = group.run(lambda r: runners[r].apply_tail("sharded", L_partials[r].clone(), S_partials[r].clone(), dtype))

    stub_vllm(monkeypatch, world, group)
    with set_current_vllm_config(VllmConfig()):
        norms = []
        for r in range(world):
            norm = RMSNorm(D, eps=cfg.rms_norm_eps)
            norm.weight.data = runners[r].w.norm_D.clone()
            norms.append(norm)
        theirs_runners = [
            vllm_runner(world=world, up_weight=runners[r].w.up_HD, preshard=preshard, has_shared=True,
                        sequence_parallel=False, scaling=1.0, norm=norms[r])
            for r in range(world)
        ]
        assert all(t._tail_shardable for t in theirs_runners)
        theirs = group.run(lambda r: theirs_runners[r]._shard_up_proj_tail(
            L_partials[r].to(dtype), S_partials[r].clone(), None))

    assert all(torch.equal(theirs[0], t) for t in theirs[1:])  # every vLLM rank holds the full result
    ref = theirs[0].float()
    err = (ours[0].float() - ref).abs().max().item() / ref.abs().max().item()
    # fp32: the same operations in the same order up to RMSNorm's association, so float rounding
    # only. bf16: vLLM rounds each rank's latent partial to bf16 before the sum, we after the norm;
    # each rounding is <= 2**-9 relative and about three separate the two results: 1e-2 of max|out|.
    tol = 0.0 if dtype == torch.float32 else 1e-2
    assert err <= tol, f"sharded tail differs from vLLM's by {err:.2e} of max|out| (> {tol})"
