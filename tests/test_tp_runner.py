"""The TP runner on real gloo groups: every tail against the single-device layer.

One local group is spawned per TP size; each rank loops over every case of the module and
returns all its outputs, and the tests below compare them in the parent (spawning is the
expensive part on a CPU runner, the tiny layer itself is not). Loader and construction
checks that need no collective run in this process with an unconnected ``Collectives``.

Legend: T tokens, H hidden (128 on the tiny preset), D latent (64), E experts (8),
I expert intermediate (64), Is shared intermediate (64), P TP size, r rank.
"""

from __future__ import annotations

import functools
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moe_runtime.checkpoint import CheckpointReader, load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.experts import mxfp4_cpu
from moe_runtime.layer import moe_forward, shared_experts
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group
from moe_runtime.tp.plan import TailPlan, TailTier
from moe_runtime.tp.routed_input import RoutedInputConfig
from moe_runtime.tp.runner import build_rank_runners, sp_rows
from moe_runtime.tp.sharding import TPShard
from moe_runtime.units import SERVED_DTYPES, torch_dtype

LAYER = 1  # the tiny preset's first MoE layer (layer 0 is dense)
TAILS = ("replicated", "overlap", "sharded", "single_allreduce", "sequence_parallel")
TOKENS = (1, 33, 257)  # a single decode token, odd sizes that do not divide P
DTYPES = {name: torch_dtype(name) for name in SERVED_DTYPES}
TIERED = TailPlan((TailTier(16, "overlap"), TailTier(None, "sharded")), "tiers under test")
TIERED_TOKENS = (1, 16, 17, 33, 257)
TIERED3 = TailPlan(
    (TailTier(1, "single_allreduce"), TailTier(32, "overlap"), TailTier(None, "sharded")), "three tiers"
)
TIERED3_TOKENS = (1, 2, 32, 33)
ROUTED_QUANTS = ("none", "fp8-approx", "mxfp4-approx")
ROUTED_TAILS = ("replicated", "sharded", "sequence_parallel")
ROUTED_MIN_TOKENS = 32  # T = 1 stays below it (replicated down-projection), 33 and 257 shard

# Collectives one forward issues, per tail (DESIGN §4), with and without shared experts.
EXPECTED_COUNTS = {
    "replicated": {"all_reduce": 2},
    "overlap": {"all_reduce": 2},
    "sharded": {"all_reduce": 2},
    "single_allreduce": {"all_reduce": 1},
    "sequence_parallel": {"reduce_scatter": 2},
}
EXPECTED_COUNTS_NO_SHARED = {
    "replicated": {"all_reduce": 1},
    "overlap": {"all_reduce": 1},
    "single_allreduce": {"all_reduce": 1},
    "sequence_parallel": {"reduce_scatter": 1},
}


def make_input(T: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    """The deterministic layer input for ``T`` tokens, identical in the parent and every rank."""
    return torch.randn(T, H, generator=torch.Generator().manual_seed(7919 * T + 1)).to(dtype)


# -- collectives that record / do nothing -------------------------------------------------------


class RecordingCollectives(Collectives):
    """Records a clone of every tensor handed to ``all_reduce`` while ``recording`` is on
    (module level so the spawned ranks can unpickle this module's rank function)."""

    def __init__(self, rank: int, world: int):
        super().__init__(rank, world)
        self.recording = False
        self.recorded: list[torch.Tensor] = []

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.recording:
            self.recorded.append(t.detach().clone())
        return super().all_reduce(t)


class UnconnectedCollectives(Collectives):
    """Rank ``rank`` of ``world`` without a process group: enough to load and construct a
    runner (construction issues no collective); any collective would fail loudly."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.device = rank, world, torch.device("cpu")
        self.counts, self.nbytes = Counter(), Counter()


# -- what every rank runs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One runner built on every rank, then called once per token count."""

    name: str
    ckpt: str
    dtype: torch.dtype
    plan: TailPlan
    tokens: tuple[int, ...]
    preshard: bool = False
    routed_input: RoutedInputConfig | None = None
    record: bool = False  # record the all-reduce inputs and the rank's shared partial


def _rank_cases(comm: Collectives, jobs: list[Job]) -> dict:
    """Rank body: run every job, return ``{(job, T): result}`` for the parent to compare."""
    # Every rank takes the same GEMM path for a shape: the measured CPU crossovers
    # (experts.crossover) time each path in each rank's own process, and under load two ranks can
    # choose differently, so a tail that computes the same bf16 GEMM on every rank (replicated,
    # overlap, single all-reduce) would round differently per rank. Serving returns rank 0's rows;
    # a group agreeing on one choice is still to be built.
    os.environ[mxfp4_cpu.BATCHED_ENV] = "0"
    rec = RecordingCollectives(comm.rank, comm.world)
    results: dict = {}
    for job in jobs:
        cfg = LatentMoEConfig.from_pretrained(job.ckpt)
        runner = build_rank_runners(
            job.ckpt, cfg, [LAYER], rec, job.plan, dtype=job.dtype,
            preshard_up_proj=job.preshard, routed_input=job.routed_input,
        )[LAYER]
        for T in job.tokens:
            x_TH = make_input(T, cfg.hidden_size, job.dtype)
            rec.counts.clear()
            rec.nbytes.clear()
            rec.recorded = []
            rec.recording = job.record
            out = runner.forward(x_TH)
            rec.recording = False
            res = {"out": out, "counts": dict(rec.counts), "nbytes": dict(rec.nbytes), "tail": runner.last_tail}
            if job.record:
                res["all_reduce_inputs"] = rec.recorded
                res["shared_partial"] = shared_experts(x_TH, runner.w, runner.act)
            results[(job.name, T)] = res
        results[(job.name, "tail_counts")] = dict(runner.tail_counts)
    return results


# -- checkpoints, jobs and the two groups ------------------------------------------------------


@dataclass
class Suite:
    ckpts: dict[str, Path]
    jobs: dict[int, list[Job]] = field(default_factory=dict)
    results: dict[int, list[dict]] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)

    def ckpt_names(self, P: int) -> tuple[str, ...]:
        # MXFP4 experts split along I only at P = 2 on tiny (I / P = 32, one block).
        return ("base", "no_norm", "mxfp4", "no_shared") if P == 2 else ("base", "no_norm", "no_shared")

    def build_jobs(self, P: int) -> list[Job]:
        jobs = []
        for ck in self.ckpt_names(P):
            for dname, dtype in DTYPES.items():
                for tail in TAILS:
                    if ck == "no_shared" and tail == "sharded":
                        continue  # illegal without a shared partial (tested at construction)
                    jobs.append(Job(f"{ck}/{dname}/{tail}", str(self.ckpts[ck]), dtype,
                                    TailPlan.single(tail, "test"), TOKENS, record=tail == "sharded"))
        for dname, dtype in DTYPES.items():
            base = str(self.ckpts["base"])
            jobs.append(Job(f"preshard/{dname}", base, dtype, TailPlan.single("sharded", "test"), TOKENS,
                            preshard=True, record=True))
            jobs.append(Job(f"tiered/{dname}", base, dtype, TIERED, TIERED_TOKENS))
            jobs.append(Job(f"tiered3/{dname}", base, dtype, TIERED3, TIERED3_TOKENS))
        for quant in ROUTED_QUANTS:
            for tail in ROUTED_TAILS:
                ri = RoutedInputConfig(enabled=True, quant=quant, min_sharded_tokens=ROUTED_MIN_TOKENS)
                jobs.append(Job(f"routed_{quant}/{tail}", str(self.ckpts["base"]), torch.float32,
                                TailPlan.single(tail, "test"), TOKENS, routed_input=ri))
        return jobs

    def run(self, P: int) -> list[dict]:
        """The group's results, spawned once per P; a failed group fails every later test at
        once instead of being respawned for each of them."""
        if P in self.failures:
            pytest.fail(f"the P = {P} group failed earlier:\n{self.failures[P]}")
        if P not in self.results:
            self.jobs[P] = self.build_jobs(P)
            try:
                self.results[P] = run_local_group(P, _rank_cases, self.jobs[P], timeout_s=240.0)
            except (RuntimeError, TimeoutError) as exc:
                self.failures[P] = str(exc)
                raise
        return self.results[P]


@pytest.fixture(scope="module")
def suite(make_ckpt) -> Suite:
    return Suite({
        "base": make_ckpt(),
        "no_norm": make_ckpt(latent_moe_use_norm=False),
        "mxfp4": make_ckpt(mxfp4=True),
        "no_shared": make_ckpt(num_shared_experts=0),
    })


@functools.cache
def _full_weights(ckpt: str, dtype: torch.dtype):
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    return cfg, load_layer_weights(ckpt, cfg, LAYER, dtype)


def reference(ckpt: str | Path, dtype: torch.dtype, T: int) -> torch.Tensor:
    """The single-device layer on the unsharded weights, same dtype."""
    cfg, w = _full_weights(str(ckpt), dtype)
    return moe_forward(make_input(T, cfg.hidden_size, dtype), w, cfg)


def assert_matches_reference(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Tolerances, relative to the output's magnitude ``m = max |ref|`` (O(1) here):

    * float32: a TP rank sums the same products in another order (GEMMs over I / P and
      Is / P, then the all-reduce), so the error is a few fp32 rounding steps of the
      largest terms: ~1e-6 relative (4e-7 * m measured over every case here); 1e-5 * m
      leaves a margin of 10x or more.
    * bfloat16: every rank rounds its partials to bf16 before they are summed (the expert
      down-GEMM output, the shared partial, the up-projection shard, and the latent partial
      L_r, which crosses the wire in bf16 as in the reference runner), the bf16 all-reduce
      rounds each partial sum once more, and the reference rounds once. Each rounding is half
      an ulp (2**-9 relative); the latent's P roundings pass through the norm (a relative
      error of the whole row's scale, a few 2**-9) and the D-wide up-projection, the others
      add to the output directly: a few bf16 ulps of m. An element-wise rtol of 2**-7 (two
      ulps) plus an atol of 4 ulps of m (4 * 2**-8 * m) covers that while still catching any
      real error (a wrong block or a missing partial is O(m)). Measured over every bf16 case
      here: at most 0.0097 * m (2.5 ulps), 0.46 of this tolerance (0.008 * m, 0.4 of it,
      when the latent was still reduced in fp32).
    """
    assert got.dtype == ref.dtype and got.shape == ref.shape
    m = ref.abs().max().item()
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * m)
    else:
        torch.testing.assert_close(got, ref, rtol=2**-7, atol=4 * 2**-8 * m)


def gather_output(results: list[dict], key: tuple, tail: str, P: int, T: int) -> torch.Tensor:
    """The layer output as the caller sees it: rank 0's, or the ranks' SP rows in order.

    Also checks what every rank returned: identical outputs after an all-reduce, exactly its
    ``sp_rows`` under sequence parallelism.
    """
    outs = [results[r][key]["out"] for r in range(P)]
    if tail != "sequence_parallel":
        for r in range(1, P):
            assert torch.equal(outs[r], outs[0]), f"rank {r} returned another output than rank 0"
        return outs[0]
    for r, out in enumerate(outs):
        start, stop = sp_rows(T, P, r)
        assert out.shape[0] == stop - start, f"rank {r} returned {out.shape[0]} rows, sp_rows says {start}:{stop}"
    return torch.cat(outs)


# -- every tail x dtype x T x checkpoint --------------------------------------------------------

CASES = [
    pytest.param(P, ck, dname, tail, id=f"P{P}-{ck}-{dname}-{tail}")
    for P in (2, 4)
    for ck in (("base", "no_norm", "mxfp4", "no_shared") if P == 2 else ("base", "no_norm", "no_shared"))
    for dname in DTYPES
    for tail in TAILS
    if not (ck == "no_shared" and tail == "sharded")
]


@pytest.mark.parametrize("P, ck, dname, tail", CASES)
def test_tail_matches_single_device(suite: Suite, P: int, ck: str, dname: str, tail: str) -> None:
    results = suite.run(P)
    expected_counts = (EXPECTED_COUNTS_NO_SHARED if ck == "no_shared" else EXPECTED_COUNTS)[tail]
    for T in TOKENS:
        key = (f"{ck}/{dname}/{tail}", T)
        got = gather_output(results, key, tail, P, T)
        assert_matches_reference(got, reference(suite.ckpts[ck], DTYPES[dname], T))
        # Bytes each rank hands to its collectives: the latent partial (D wide) and the shared
        # partial (H wide), both in the deployment dtype, for every tail (single_allreduce:
        # one [S | L] buffer; sequence_parallel: T padded to a multiple of P).
        rows = T + (-T % P) if tail == "sequence_parallel" else T
        width = 64 + (0 if ck == "no_shared" else 128)
        expected_bytes = {kind: rows * width * DTYPES[dname].itemsize for kind in expected_counts}
        for r in range(P):
            assert results[r][key]["tail"] == tail
            assert results[r][key]["counts"] == expected_counts, (r, T)
            assert results[r][key]["nbytes"] == expected_bytes, (r, T)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("preshard", [False, True], ids=["replicated_wup", "preshard_wup"])
def test_sharded_tail_writes_only_its_column_block(suite: Suite, P: int, dname: str, preshard: bool) -> None:
    """Before the final all-reduce each rank changed only columns [r*H/P, (r+1)*H/P) of its
    shared partial; that all-reduce both sums the partials and stitches the blocks."""
    results = suite.run(P)
    job = f"preshard/{dname}" if preshard else f"base/{dname}/sharded"
    H = LatentMoEConfig.from_pretrained(suite.ckpts["base"]).hidden_size
    for T in TOKENS:
        for r in range(P):
            res = results[r][(job, T)]
            assert res["counts"] == {"all_reduce": 2}
            L_TD, folded_TH = res["all_reduce_inputs"]
            shared_TH = res["shared_partial"]
            assert L_TD.shape == (T, 64) and folded_TH.shape == shared_TH.shape == (T, H)
            lo, hi = r * H // P, (r + 1) * H // P
            assert torch.equal(folded_TH[:, :lo], shared_TH[:, :lo])
            assert torch.equal(folded_TH[:, hi:], shared_TH[:, hi:])
            changed_rows = (folded_TH[:, lo:hi] != shared_TH[:, lo:hi]).any(dim=1)
            assert changed_rows.all(), f"rank {r}: some token rows of its own block were not written"


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("dname", list(DTYPES))
def test_preshard_outputs(suite: Suite, P: int, dname: str) -> None:
    results = suite.run(P)
    for T in TOKENS:
        got = gather_output(results, (f"preshard/{dname}", T), "sharded", P, T)
        assert_matches_reference(got, reference(suite.ckpts["base"], DTYPES[dname], T))


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("plan_name", ["tiered", "tiered3"])
def test_per_batch_tiers_pick_per_call(suite: Suite, P: int, dname: str, plan_name: str) -> None:
    results = suite.run(P)
    plan, tokens = (TIERED, TIERED_TOKENS) if plan_name == "tiered" else (TIERED3, TIERED3_TOKENS)
    job = f"{plan_name}/{dname}"
    expected_tails = {T: plan.tail_for(T) for T in tokens}
    if plan_name == "tiered":
        assert expected_tails == {1: "overlap", 16: "overlap", 17: "sharded", 33: "sharded", 257: "sharded"}
    else:
        assert expected_tails == {1: "single_allreduce", 2: "overlap", 32: "overlap", 33: "sharded"}
    for T in tokens:
        got = gather_output(results, (job, T), expected_tails[T], P, T)
        assert_matches_reference(got, reference(suite.ckpts["base"], DTYPES[dname], T))
        for r in range(P):
            assert results[r][(job, T)]["tail"] == expected_tails[T]
            assert results[r][(job, T)]["counts"] == EXPECTED_COUNTS[expected_tails[T]]
    assert results[0][(job, "tail_counts")] == dict(Counter(expected_tails.values()))


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("quant", ROUTED_QUANTS)
@pytest.mark.parametrize("tail", ROUTED_TAILS)
def test_token_sharded_routed_input_counts(suite: Suite, P: int, quant: str, tail: str) -> None:
    """The token-sharded routed input adds one all-gather per gathered tensor (values, then
    scales when quantised) above ``min_sharded_tokens`` and nothing below it; without
    quantisation the output is the single-device one."""
    results = suite.run(P)
    gathers = 1 if quant == "none" else 2
    for T in TOKENS:
        key = (f"routed_{quant}/{tail}", T)
        expected = dict(EXPECTED_COUNTS[tail])
        if T >= ROUTED_MIN_TOKENS:
            expected["all_gather"] = gathers
        for r in range(P):
            assert results[r][key]["counts"] == expected, (r, T)
        got = gather_output(results, key, tail, P, T)
        ref = reference(suite.ckpts["base"], torch.float32, T)
        if quant == "none" or T < ROUTED_MIN_TOKENS:
            assert_matches_reference(got, ref)
        else:
            assert torch.isfinite(got).all()  # accuracy of the quantised latent: test_routed_input.py


# -- loader: what a rank holds and reads (no process group needed) -----------------------------


def _tensor_bytes(ckpt: Path, layer: int) -> dict[str, int]:
    """Stored bytes of every tensor of ``layer``, keyed by the name after the layer prefix."""
    reader = CheckpointReader(ckpt)
    prefix = reader.layer_prefix(layer)
    sizes = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for name in h.keys():
                if name.startswith(prefix):
                    t = h.get_tensor(name)
                    sizes[name[len(prefix):]] = t.numel() * t.element_size()
    return sizes


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("preshard", [False, True], ids=["replicated_wup", "preshard_wup"])
def test_rank_holds_planned_shards(make_ckpt, P: int, preshard: bool) -> None:
    ckpt = make_ckpt()
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    H, D, E, I, Is = 128, 64, 8, 64, 64
    assert (cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts,
            cfg.moe_intermediate_size, cfg.shared_intermediate_size) == (H, D, E, I, Is)
    full = load_layer_weights(ckpt, cfg, LAYER, torch.bfloat16)
    plan = TailPlan.single("sharded" if preshard else "replicated", "test")
    for r in range(P):
        runner = build_rank_runners(ckpt, cfg, [LAYER], UnconnectedCollectives(r, P), plan,
                                    dtype=torch.bfloat16, preshard_up_proj=preshard)[LAYER]
        w = runner.w
        assert w.shapes() == {
            "gate_EH": (E, H), "bias_E": (E,), "down_DH": (D, H), "norm_D": (D,),
            "up_HD": (H // P, D) if preshard else (H, D),
            "experts.w13": (E, 2 * I // P, D), "experts.w2": (E, D, I // P),
            "shared_gate_SH": (Is // P, H), "shared_up_SH": (Is // P, H), "shared_down_HS": (H, Is // P),
        }
        # ... and they are this rank's slices of the full tensors (the sharding table).
        i0, i1 = r * I // P, (r + 1) * I // P
        s0, s1 = r * Is // P, (r + 1) * Is // P
        h0, h1 = r * H // P, (r + 1) * H // P
        assert torch.equal(w.experts.w13, torch.cat([full.experts.w13[:, i0:i1], full.experts.w13[:, I + i0 : I + i1]], 1))
        assert torch.equal(w.experts.w2, full.experts.w2[:, :, i0:i1])
        assert torch.equal(w.shared_gate_SH, full.shared_gate_SH[s0:s1])
        assert torch.equal(w.shared_up_SH, full.shared_up_SH[s0:s1])
        assert torch.equal(w.shared_down_HS, full.shared_down_HS[:, s0:s1])
        assert torch.equal(w.up_HD, full.up_HD[h0:h1] if preshard else full.up_HD)
        for name in ("gate_EH", "bias_E", "down_DH", "norm_D"):
            assert torch.equal(getattr(w, name), getattr(full, name)), name
        up_bytes = w.nbytes_by_part()["up_projection"]
        assert up_bytes * (P if preshard else 1) == full.nbytes_by_part()["up_projection"]


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("preshard", [False, True], ids=["replicated_wup", "preshard_wup"])
def test_reader_reads_only_the_rank_slices(make_ckpt, P: int, preshard: bool) -> None:
    ckpt = make_ckpt()
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    stored = _tensor_bytes(ckpt, LAYER)
    split = {k: v for k, v in stored.items() if k.startswith(("experts.", "shared_experts."))}
    replicated = {k: v for k, v in stored.items() if k not in split}
    assert len(split) == 3 * 8 + 3 and set(replicated) == {
        "gate.weight", "gate.e_score_correction_bias", "routed_expert_down_proj.weight",
        "routed_expert_norm.weight", "routed_expert_up_proj.weight",
    }
    up = replicated["routed_expert_up_proj.weight"]
    expected = sum(replicated.values()) + sum(split.values()) // P - (up - up // P if preshard else 0)
    for r in range(P):
        reader = CheckpointReader(ckpt)
        load_layer_weights(reader, cfg, LAYER, torch.bfloat16, TPShard(r, P, preshard))
        assert reader.bytes_read == expected, (r, reader.bytes_read, expected)
        assert reader.bytes_read < sum(stored.values())


def test_mxfp4_rank_slices_decode_like_the_full_tensor(make_ckpt) -> None:
    """At P = 2 each rank's w2 slice starts on a 32-element block, so decoding the slice
    equals slicing the decoded tensor, and only half of the packed bytes are read."""
    ckpt = make_ckpt(mxfp4=True)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    full_w13, full_w2 = load_layer_weights(ckpt, cfg, LAYER, torch.float32).experts.decode(torch.arange(8))
    stored = _tensor_bytes(ckpt, LAYER)
    expert_bytes = sum(v for k, v in stored.items() if k.startswith("experts."))
    for r in range(2):
        reader = CheckpointReader(ckpt)
        w13, w2 = load_layer_weights(reader, cfg, LAYER, torch.float32, TPShard(r, 2)).experts.decode(torch.arange(8))
        assert torch.equal(w2, full_w2[:, :, 32 * r : 32 * (r + 1)])
        assert torch.equal(w13, torch.cat([full_w13[:, 32 * r : 32 * (r + 1)],
                                           full_w13[:, 64 + 32 * r : 64 + 32 * (r + 1)]], 1))
        non_expert = sum(v for k, v in stored.items() if not k.startswith("experts."))
        shared = sum(v for k, v in stored.items() if k.startswith("shared_experts."))
        assert reader.bytes_read == non_expert - shared // 2 + expert_bytes // 2


# -- construction errors ----------------------------------------------------------------------


def _build(ckpt: Path, plan: TailPlan, rank: int, world: int, comm: Collectives | None = None, **kw):
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    comm = comm or UnconnectedCollectives(rank, world)
    return build_rank_runners(ckpt, cfg, [LAYER], comm, plan, dtype=torch.float32, **kw)[LAYER]


def test_sharded_at_tp1_is_illegal(make_ckpt) -> None:
    with pytest.raises(ValueError, match=r"\['sharded'\] are illegal.*TP size is 1: there is nothing to shard"):
        _build(make_ckpt(), TailPlan.single("sharded", "forced"), 0, 1, comm=Collectives())


def test_sharded_without_shared_experts_is_illegal(make_ckpt) -> None:
    with pytest.raises(ValueError, match=r"\['sharded'\] are illegal.*no shared experts"):
        _build(make_ckpt(num_shared_experts=0), TailPlan.single("sharded", "forced"), 0, 2)
    # A tier plan that only reaches the sharded tail for large batches is rejected up front.
    with pytest.raises(ValueError, match=r"\['sharded'\] are illegal.*no shared experts"):
        _build(make_ckpt(num_shared_experts=0), TIERED, 0, 2)


def test_plan_and_shard_mismatches_are_rejected(make_ckpt) -> None:
    ckpt = make_ckpt()
    # A pre-sharded Wup has only H / P rows: any tail but sharded would need all H.
    for plan in (TIERED, TailPlan.single("replicated", "t")):
        with pytest.raises(ValueError, match=r"illegal.*pre-sharded"):
            _build(ckpt, plan, 0, 2, preshard_up_proj=True)
    with pytest.raises(ValueError, match=r"pre-sharded.*no shared experts"):
        _build(make_ckpt(num_shared_experts=0), TailPlan.single("sharded", "t"), 0, 2, preshard_up_proj=True)
    mixed = TailPlan((TailTier(8, "overlap"), TailTier(None, "sequence_parallel")), "t")
    with pytest.raises(ValueError, match="sequence_parallel cannot share a plan"):
        _build(ckpt, mixed, 0, 2)


@pytest.mark.parametrize("rank", range(4))
def test_mxfp4_split_off_block_boundary_names_it(make_ckpt, rank: int) -> None:
    """Tiny MXFP4 at P = 4: I / P = 16 is not a multiple of the 32-element block, so no
    rank can take its w2 column slice; every rank must say so, not fail later in decode."""
    with pytest.raises(ValueError, match="block boundary"):
        _build(make_ckpt(mxfp4=True), TailPlan.single("replicated", "t"), rank, 4)


# -- a dying rank fails the group quickly -------------------------------------------------------


def _die_on_rank_1(comm: Collectives) -> torch.Tensor:
    if comm.rank == 1:
        raise RuntimeError("rank 1 exploded on purpose")
    probe = torch.ones(1)
    comm.all_reduce(probe)
    return probe


def test_dead_rank_does_not_hang() -> None:
    """Rank 1 fails before its all-reduce: the group reports a rank's failure (rank 1's error, or
    rank 0's collective giving up on it). A hang would end instead in run_local_group's own
    TimeoutError, which is not the RuntimeError expected here."""
    with pytest.raises(RuntimeError, match=r"rank \d failed") as info:
        run_local_group(2, _die_on_rank_1, timeout_s=120.0, collective_timeout_s=10.0)
    assert re.search(r"exploded on purpose|rank 1|Connection|timed out", str(info.value))
