"""The rank-local latent-MoE runner: the layer math of ``layer.py`` around TP collectives.

Each rank holds its shard (``sharding.py``) and calls ``forward`` with the same batch; the
tails (DESIGN §4) decide how partial sums are reduced and where the up-projection runs.
Legend: T tokens (Tp padded to a multiple of P), H hidden, D latent, P TP size.
"""

from __future__ import annotations

import functools
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch

from .. import mxfp4
from ..activation import GatedActivation
from ..checkpoint import CheckpointReader, checkpoint_expert_formats, load_layer_weights
from ..config import LatentMoEConfig
from ..experts import (
    DEFAULT_SCRATCH_BYTES,
    ActQuant,
    backend_candidates,
)
from ..experts.check import BackendCheck
from ..experts.mxfp4_cpu import dense_linear
from ..layer import down_project, latent_norm, routed_experts, shared_experts
from ..logs import log_once
from ..units import ACTIVATION_SCALE_RULE, MXFP4, check_mxfp4_scale_rule, check_scale_rule
from ..weights import LayerWeights
from .collectives import Collectives
from .plan import TailPlan, check_preshard, legal_tails, shardability_for
from .routed_input import ACTIVATION_QUANT_MODES, RoutedInputConfig, dequantize, quantize
from .served import ServedRunner, choose_backend
from .sharding import TPShard


class StageTimer:
    """Accumulates wall time per stage when enabled (benchmarks); free otherwise."""

    def __init__(self, device: torch.device):
        self.enabled = False
        self.device = device
        self.totals: defaultdict[str, float] = defaultdict(float)
        self._last = 0.0

    def start(self) -> None:
        if self.enabled:
            self.sync()
            self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        if self.enabled:
            self.sync()
            now = time.perf_counter()
            self.totals[stage] += now - self._last
            self._last = now

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def activation_quantizer(
    mode: str, cfg: LatentMoEConfig, world: int, scale_rule: str = ACTIVATION_SCALE_RULE
) -> ActQuant | None:
    """The experts' activation fake-quant for ``experts_activation_quant`` (None: W4A16).

    ``mxfp4`` emulates the ROCm production experts (W4A4): ``h`` and the gated activation are
    quantised to MXFP4 in 32-blocks along ``D`` and ``I / P``, so both must be multiples of 32,
    each block's exponent by ``scale_rule`` (``even``, the production rule, or ``floor``).
    """
    if mode not in ACTIVATION_QUANT_MODES:
        raise ValueError(f"experts activation quantisation {mode!r} is not one of {ACTIVATION_QUANT_MODES}")
    check_scale_rule(scale_rule)
    if mode == "none":
        return None
    widths = {
        "latent size D": cfg.routed_expert_hidden_size,
        f"expert intermediate per rank I / P = {cfg.moe_intermediate_size} / {world}": (
            cfg.moe_intermediate_size // world
        ),
    }
    for name, width in widths.items():
        if width % mxfp4.BLOCK:
            raise ValueError(
                f"MXFP4 expert activations need the {name} to be a multiple of {mxfp4.BLOCK}: "
                f"{width} % {mxfp4.BLOCK} = {width % mxfp4.BLOCK}"
            )
    return functools.partial(mxfp4.quantize_dequantize, scale_rule=scale_rule)


def check_activation_quant(
    mode: str, cfg: LatentMoEConfig, world: int, reader: CheckpointReader, layers: Iterable[int]
) -> None:
    """``experts_activation_quant`` is usable for these layers at TP ``world`` (ValueError if not).

    ``mxfp4`` (W4A4 emulation) needs experts stored MXFP4: it reproduces what the ROCm
    production experts do with those weights; in front of dense experts it would only be a
    loss of precision that no deployment runs.
    """
    activation_quantizer(mode, cfg, world)
    if mode == "none":
        return
    formats = checkpoint_expert_formats(reader, cfg, layers)
    dense = [i for i, fmt in formats.items() if fmt != MXFP4]
    if dense:
        raise ValueError(
            f"experts_activation_quant {mode!r} emulates W4A4 MXFP4 experts, but the experts of "
            f"layer(s) {dense} are stored dense in {reader.root}"
        )


class _SkipPrequantised:
    """``act_quant`` for a batch whose latent ``h`` was already quantised on its token shard
    before the all-gather: the backend's quantisation of that very tensor is skipped (it would
    be the identity: MXFP4 values re-quantise to themselves), the gated activation's is not."""

    def __init__(self, quant: ActQuant, h_TD: torch.Tensor):
        self.quant, self.h_TD = quant, h_TD

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t if t is self.h_TD else self.quant(t)


def sp_rows(num_tokens: int, world: int, rank: int) -> tuple[int, int]:
    """The ``[start, stop)`` token rows rank ``rank`` returns under sequence parallelism."""
    per_rank = -(-num_tokens // world)
    return min(rank * per_rank, num_tokens), min((rank + 1) * per_rank, num_tokens)


class LatentMoERunner(ServedRunner):
    """One MoE layer on one rank of a TP group."""

    def __init__(
        self,
        cfg: LatentMoEConfig,
        weights: LayerWeights,
        comm: Collectives,
        plan: TailPlan,
        shard: TPShard,
        backend: str = "torch",
        routed_input: RoutedInputConfig | None = None,
        scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
        experts_activation_quant: str = "none",
        mxfp4_scale_rule: str = ACTIVATION_SCALE_RULE,
    ):
        if comm.world != shard.world or comm.rank != shard.rank:
            raise ValueError(
                f"collectives are rank {comm.rank} of {comm.world} but the shard is rank "
                f"{shard.rank} of {shard.world}"
            )
        self.cfg, self.w, self.comm, self.plan, self.shard = cfg, weights, comm, plan, shard
        self.act_quant = activation_quantizer(experts_activation_quant, cfg, shard.world, mxfp4_scale_rule)
        self.experts_activation_quant = experts_activation_quant
        self.routed_input = (routed_input or RoutedInputConfig()).resolve(
            experts_activation_quant, cfg.routed_expert_hidden_size
        )
        check_mxfp4_scale_rule(mxfp4_scale_rule, experts_activation_quant, self.routed_input.quant)
        self.mxfp4_scale_rule = mxfp4_scale_rule
        sequence_parallel = "sequence_parallel" in plan.tails
        if sequence_parallel and len(plan.tails) > 1:
            raise ValueError(f"sequence_parallel cannot share a plan with other tails: {plan.describe()}")
        rule = shardability_for(cfg, shard.world, shard.preshard_up_proj, sequence_parallel)
        legal = legal_tails(cfg, shard.world, shard.preshard_up_proj, sequence_parallel)
        why = rule.reason
        if shard.preshard_up_proj:
            check_preshard(rule, shard.preshard_up_proj)
            why = "Wup is pre-sharded, so only the sharded tail has the rows it needs"
        self.legal_tails, self._illegal_why = legal, why
        self.set_plan(plan)
        self._check_shapes()
        self.init_backend(backend, scratch_bytes, weights.experts)
        self.act = GatedActivation.from_config(cfg)
        self.device = weights.down_DH.device
        self.timer = StageTimer(self.device)
        self.tail_counts: Counter[str] = Counter()
        self._tails = {
            "replicated": self._tail_replicated,
            "overlap": self._tail_overlap,
            "sharded": self._tail_sharded,
            "single_allreduce": self._tail_single_allreduce,
            "sequence_parallel": self._tail_sequence_parallel,
        }
        if shard.rank == 0:
            log_once(
                f"latent-MoE runner: TP {shard.world}, device {self.device}, backend {backend} "
                f"(experts path {self.experts_path}: {self.experts_path_reason}), "
                f"tails {plan.describe()} ({plan.reason}), routed input "
                f"{'token-sharded/' + self.routed_input.quant if self.routed_input.enabled else 'replicated'}"
                f", experts activations {experts_activation_quant}, MXFP4 activation scale rule "
                f"{mxfp4_scale_rule}"
            )

    def set_plan(self, plan: TailPlan) -> None:
        """Adopt a (e.g. measured) plan; every tail in it must be legal on this group."""
        illegal = [t for t in plan.tails if t not in self.legal_tails]
        if illegal:
            raise ValueError(
                f"tail(s) {illegal} are illegal here (legal: {list(self.legal_tails)}): {self._illegal_why}"
            )
        self.plan = plan

    def _check_shapes(self) -> None:
        cfg, P = self.cfg, self.shard.world
        H, D, E = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts
        I_local = cfg.moe_intermediate_size // P
        H_up = H // P if self.shard.preshard_up_proj else H
        ex = self.w.experts
        found = {
            "experts (E, I_local, D)": (ex.num_experts, ex.intermediate_size, ex.latent_size),
            "up_HD": tuple(self.w.up_HD.shape),
        }
        expected = {"experts (E, I_local, D)": (E, I_local, D), "up_HD": (H_up, D)}
        for name, shape in expected.items():
            if found[name] != shape:
                raise ValueError(f"{name} is {found[name]}, expected {shape} for TP {P}")

    # -- forward --------------------------------------------------------------------------

    def forward(
        self, x_TH: torch.Tensor, router_logits_TE: torch.Tensor | None = None, tail: str | None = None
    ) -> torch.Tensor:
        """``out [T, H]`` (sequence-parallel: only this rank's rows, see ``sp_rows``).

        ``tail`` overrides the plan for this call (tail measurement); it must be legal here.
        """
        T = x_TH.shape[0]
        if tail is None:
            tail = self.plan.tail_for(T)
        elif tail not in self.legal_tails:
            raise ValueError(f"tail {tail!r} is not legal here; legal: {list(self.legal_tails)}")
        self.timer.start()
        h_TD = self.routed_input_latent(x_TH)
        act_quant = self.act_quant
        if self._token_sharded(T) and self.routed_input.quant == "mxfp4":
            act_quant = _SkipPrequantised(self.act_quant, h_TD)  # h was quantised on its shard
        L_TD = routed_experts(
            x_TH, h_TD, self.w, self.cfg, self.backend, self.act, router_logits_TE, act_quant
        )
        S_TH = shared_experts(x_TH, self.w, self.act)
        self.timer.mark("experts")
        return self.apply_tail(tail, L_TD, S_TH, x_TH.dtype)

    def apply_tail(
        self, tail: str, L_TD: torch.Tensor, S_TH: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """Everything after the experts, from this rank's partials (which it may modify).

        ``L_TD`` comes from the experts in fp32 (their local accumulation); under TP it is
        summed across ranks in the deployment dtype, as the reference runner reduces its fused
        output (bf16 deployments: half the bytes of fp32 on the wire, one more bf16 rounding of
        each rank's partial; the norm then runs in fp32 on the sum).
        """
        if self.shard.world > 1:
            L_TD = L_TD.to(dtype)
        out = self._tails[tail](L_TD, S_TH, dtype)
        self.tail_counts[tail] += 1
        self.last_tail = tail
        return out

    __call__ = forward

    def routed_input_latent(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The latent ``h [T, D]`` every rank feeds its experts (token-sharded when enabled)."""
        T, P = x_TH.shape[0], self.shard.world
        ri = self.routed_input
        if not self._token_sharded(T):
            h_TD = down_project(x_TH, self.w)
            self.timer.mark("down_proj")
            return h_TD
        start, stop = sp_rows(T, P, self.shard.rank)
        per_rank = -(-T // P)
        h_local = down_project(x_TH[start:stop], self.w)
        if h_local.shape[0] < per_rank:  # the last ranks pad so every gather has equal rows
            h_local = torch.cat([h_local, h_local.new_zeros(per_rank - h_local.shape[0], h_local.shape[1])])
        self.timer.mark("down_proj")
        gathered = [self.comm.all_gather(part) for part in quantize(h_local, ri.quant, self.mxfp4_scale_rule)]
        self.timer.mark("collectives")
        return dequantize(gathered, ri.quant, x_TH.dtype)[:T]

    def _token_sharded(self, num_tokens: int) -> bool:
        ri = self.routed_input
        return ri.enabled and self.shard.world > 1 and num_tokens >= ri.min_sharded_tokens

    def _norm(self, L_TD: torch.Tensor) -> torch.Tensor:
        return latent_norm(L_TD, self.w, self.cfg.rms_norm_eps)

    def _up(self, L_hat_TD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dense_linear(L_hat_TD.to(dtype), self.w.up_HD)

    # -- tails (DESIGN §4) ----------------------------------------------------------------

    def _tail_replicated(self, L_TD, S_TH, dtype):
        self.comm.all_reduce(L_TD)
        self.timer.mark("collectives")
        R_TH = self._up(self._norm(L_TD), dtype)
        self.timer.mark("up_proj")
        if S_TH is None:
            return R_TH
        self.comm.all_reduce(S_TH)
        self.timer.mark("collectives")
        return R_TH + S_TH

    def _tail_overlap(self, L_TD, S_TH, dtype):
        self.comm.all_reduce(L_TD)
        self.timer.mark("collectives")
        pending = None if S_TH is None else self.comm.all_reduce_async(S_TH)
        R_TH = self._up(self._norm(L_TD), dtype)  # runs while the shared sum is in flight
        self.timer.mark("up_proj")
        if pending is None:
            return R_TH
        pending.wait()
        self.timer.mark("collectives")
        return R_TH + S_TH

    def _tail_sharded(self, L_TD, S_TH, dtype):
        self.comm.all_reduce(L_TD)
        self.timer.mark("collectives")
        L_hat = self._norm(L_TD).to(dtype)
        H_local = self.cfg.hidden_size // self.shard.world
        start = self.shard.rank * H_local
        up_block = self.w.up_HD if self.shard.preshard_up_proj else self.w.up_HD[start : start + H_local]
        # Only this rank's column block of the shared partial gains its up-projection
        # shard; the final all-reduce both sums the shared partials and stitches blocks.
        S_TH[:, start : start + H_local].addmm_(L_hat, up_block.t())
        self.timer.mark("up_proj")
        self.comm.all_reduce(S_TH)
        self.timer.mark("collectives")
        return S_TH

    def _tail_single_allreduce(self, L_TD, S_TH, dtype):
        # One all-reduce of [S_r | L_r] (width H + D); the norm and the full up-projection then
        # run on the summed latent on every rank (the replicated tail's math, one collective).
        D = L_TD.shape[1]
        buf = L_TD if S_TH is None else torch.cat([S_TH.to(L_TD.dtype), L_TD], dim=1)
        self.comm.all_reduce(buf)
        self.timer.mark("collectives")
        R_TH = self._up(self._norm(buf[:, -D:]), dtype)
        self.timer.mark("up_proj")
        return R_TH if S_TH is None else (buf[:, :-D] + R_TH).to(dtype)

    def _tail_sequence_parallel(self, L_TD, S_TH, dtype):
        T, P = L_TD.shape[0], self.shard.world
        pad = -T % P
        start, stop = sp_rows(T, P, self.shard.rank)

        def scatter(t: torch.Tensor) -> torch.Tensor:
            if pad:
                t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
            return self.comm.reduce_scatter(t)[: stop - start]

        L_rows = scatter(L_TD)
        self.timer.mark("collectives")
        R_rows = self._up(self._norm(L_rows), dtype)
        self.timer.mark("up_proj")
        if S_TH is None:
            return R_rows
        S_rows = scatter(S_TH)
        self.timer.mark("collectives")
        return R_rows + S_rows


def build_rank_runners(
    checkpoint: str | Path,
    cfg: LatentMoEConfig,
    layers: Iterable[int],
    comm: Collectives,
    plan: TailPlan,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    backend: str = "torch",
    preshard_up_proj: bool = False,
    routed_input: RoutedInputConfig | None = None,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    progress: bool | None = False,
    experts_activation_quant: str = "none",
    mxfp4_scale_rule: str = ACTIVATION_SCALE_RULE,
) -> dict[int, LatentMoERunner]:
    """Load this rank's shard of every layer in ``layers`` and wrap each in a runner; each
    runner records its ``load_s`` and ``load_bytes_read`` (this rank's slices only).
    ``mxfp4_scale_rule``: how MXFP4 activations (W4A4 experts, MXFP4 routed input) pick their
    block exponents, ``even`` (production) or ``floor`` (OCP)."""
    shard = TPShard(comm.rank, comm.world, preshard_up_proj)
    candidates, why = backend_candidates(backend)
    reader = CheckpointReader(checkpoint)
    layers = list(layers)
    check_activation_quant(experts_activation_quant, cfg, comm.world, reader, layers)
    ri_quant = (routed_input or RoutedInputConfig()).resolve(
        experts_activation_quant, cfg.routed_expert_hidden_size
    ).quant
    check_mxfp4_scale_rule(mxfp4_scale_rule, experts_activation_quant, ri_quant)
    act_quant = activation_quantizer(experts_activation_quant, cfg, comm.world, mxfp4_scale_rule)
    runners: dict[int, LatentMoERunner] = {}
    checks: list[BackendCheck] | None = None
    for layer in layers:
        start, read_before = time.perf_counter(), reader.bytes_read
        weights = load_layer_weights(reader, cfg, layer, dtype, shard, progress).to(device)
        load_s, bytes_read = time.perf_counter() - start, reader.bytes_read - read_before
        if checks is None:  # non-torch backends must match torch on the first layer's real experts
            backend_name, checks, warning = choose_backend(
                candidates, backend, why, weights.experts, GatedActivation.from_config(cfg),
                top_k=cfg.num_experts_per_token, layer=layer, scratch_bytes=scratch_bytes, device=device,
                rank=comm.rank, label="experts backend: ", act_quant=act_quant,
            )
        runner = LatentMoERunner(
            cfg, weights, comm, plan, shard, backend_name, routed_input, scratch_bytes,
            experts_activation_quant, mxfp4_scale_rule,
        )
        runner.load_s, runner.load_bytes_read = load_s, bytes_read
        runner.backend_checks = checks
        runner.backend_warning = warning
        runners[layer] = runner
    return runners
