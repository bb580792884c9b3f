"""The rank-local latent-MoE runner: the layer math of ``layer.py`` around TP collectives.

Each rank holds its shard (``sharding.py``) and calls ``forward`` with the same batch; the
tails (DESIGN §4) decide how partial sums are reduced and where the up-projection runs.
Legend: T tokens (Tp padded to a multiple of P), H hidden, D latent, P TP size.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch

from .activation import GatedActivation
from .checkpoint import CheckpointReader, load_layer_weights
from .collectives import Collectives
from .config import LatentMoEConfig
from .experts import DEFAULT_SCRATCH_BYTES, ActQuant, get_backend, select_backend
from .layer import down_project, latent_norm, routed_experts, shared_experts
from .plan import TailPlan, legal_tails, shardability_for
from .routed_input import RoutedInputConfig, dequantize, quantize
from .sharding import TPShard
from .weights import LayerWeights

logger = logging.getLogger("moe_runtime")
_logged: set[str] = set()


def log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


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


def sp_rows(num_tokens: int, world: int, rank: int) -> tuple[int, int]:
    """The ``[start, stop)`` token rows rank ``rank`` returns under sequence parallelism."""
    per_rank = -(-num_tokens // world)
    return min(rank * per_rank, num_tokens), min((rank + 1) * per_rank, num_tokens)


class LatentMoERunner:
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
        act_quant: ActQuant | None = None,
    ):
        if comm.world != shard.world or comm.rank != shard.rank:
            raise ValueError(
                f"collectives are rank {comm.rank} of {comm.world} but the shard is rank "
                f"{shard.rank} of {shard.world}"
            )
        self.cfg, self.w, self.comm, self.plan, self.shard = cfg, weights, comm, plan, shard
        self.routed_input = routed_input or RoutedInputConfig()
        self.routed_input.check_latent(cfg.routed_expert_hidden_size)
        sequence_parallel = "sequence_parallel" in plan.tails
        if sequence_parallel and len(plan.tails) > 1:
            raise ValueError(f"sequence_parallel cannot share a plan with other tails: {plan.describe()}")
        rule = shardability_for(cfg, shard.world, shard.preshard_up_proj, sequence_parallel)
        legal = legal_tails(cfg, shard.world, shard.preshard_up_proj, sequence_parallel)
        why = rule.reason
        if shard.preshard_up_proj:
            if not legal:
                raise ValueError(f"Wup is pre-sharded but the sharded tail is illegal: {rule.reason}")
            why = "Wup is pre-sharded, so only the sharded tail has the rows it needs"
        self.legal_tails, self._illegal_why = legal, why
        self.set_plan(plan)
        self._check_shapes()
        self.backend_name = backend
        self.backend = get_backend(backend, scratch_bytes)
        self.act_quant = act_quant
        self.act = GatedActivation.from_config(cfg)
        self.device = weights.down_DH.device
        self.timer = StageTimer(self.device)
        self.tail_counts: Counter[str] = Counter()
        self.load_s, self.load_bytes_read = 0.0, 0  # set by build_rank_runners
        self.last_tail: str | None = None
        self._tails = {
            "replicated": self._tail_replicated,
            "overlap": self._tail_overlap,
            "sharded": self._tail_sharded,
            "single_allreduce": self._tail_single_allreduce,
            "sequence_parallel": self._tail_sequence_parallel,
        }
        if shard.rank == 0:
            log_once(
                f"latent-MoE runner: TP {shard.world}, device {self.device}, backend {backend}, "
                f"tails {plan.describe()} ({plan.reason}), routed input "
                f"{'token-sharded/' + self.routed_input.quant if self.routed_input.enabled else 'replicated'}"
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

    def resident_bytes(self) -> int:
        return self.w.nbytes()

    def resident_bytes_by_part(self) -> dict[str, int]:
        return self.w.nbytes_by_part()

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
        L_TD = routed_experts(
            x_TH, h_TD, self.w, self.cfg, self.backend, self.act, router_logits_TE, self.act_quant
        )
        S_TH = shared_experts(x_TH, self.w, self.act)
        self.timer.mark("experts")
        return self.apply_tail(tail, L_TD, S_TH, x_TH.dtype)

    def apply_tail(
        self, tail: str, L_TD: torch.Tensor, S_TH: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """Everything after the experts, from this rank's partials (which it may modify)."""
        out = self._tails[tail](L_TD, S_TH, dtype)
        self.tail_counts[tail] += 1
        self.last_tail = tail
        return out

    __call__ = forward

    def routed_input_latent(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The latent ``h [T, D]`` every rank feeds its experts (token-sharded when enabled)."""
        T, P = x_TH.shape[0], self.shard.world
        ri = self.routed_input
        if not ri.enabled or P == 1 or T < ri.min_sharded_tokens:
            h_TD = down_project(x_TH, self.w)
            self.timer.mark("down_proj")
            return h_TD
        start, stop = sp_rows(T, P, self.shard.rank)
        per_rank = -(-T // P)
        h_local = down_project(x_TH[start:stop], self.w)
        if h_local.shape[0] < per_rank:  # the last ranks pad so every gather has equal rows
            h_local = torch.cat([h_local, h_local.new_zeros(per_rank - h_local.shape[0], h_local.shape[1])])
        self.timer.mark("down_proj")
        gathered = [self.comm.all_gather(part) for part in quantize(h_local, ri.quant)]
        self.timer.mark("collectives")
        return dequantize(gathered, ri.quant, x_TH.dtype)[:T]

    def _norm(self, L_TD: torch.Tensor) -> torch.Tensor:
        return latent_norm(L_TD, self.w, self.cfg.rms_norm_eps)

    def _up(self, L_hat_TD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return L_hat_TD.to(dtype) @ self.w.up_HD.t()

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
        # RMSNorm is a per-row scale, so R = ((gamma * L) . Wup^T) / rms(L): every rank's
        # pieces are linear in its partials and one all-reduce of their concatenation suffices.
        H = self.cfg.hidden_size
        scaled = L_TD if self.w.norm_D is None else L_TD * self.w.norm_D
        PR_TH = self._up(scaled, dtype).float()
        self.timer.mark("up_proj")
        parts = [PR_TH, L_TD] if S_TH is None else [S_TH.float(), PR_TH, L_TD]
        buf = self.comm.all_reduce(torch.cat(parts, dim=1))
        self.timer.mark("collectives")
        offset = 0 if S_TH is None else H
        R_TH = buf[:, offset : offset + H]
        if self.w.norm_D is not None:
            L_sum = buf[:, offset + H :]
            R_TH = R_TH * torch.rsqrt(L_sum.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        out = R_TH if S_TH is None else buf[:, :H] + R_TH
        return out.to(dtype)

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
) -> dict[int, LatentMoERunner]:
    """Load this rank's shard of every layer in ``layers`` and wrap each in a runner; each
    runner records its ``load_s`` and ``load_bytes_read`` (this rank's slices only)."""
    shard = TPShard(comm.rank, comm.world, preshard_up_proj)
    backend_name, why = select_backend(backend)
    if comm.rank == 0:
        log_once(f"experts backend: {backend_name} ({why})")
    reader = CheckpointReader(checkpoint)
    runners = {}
    for layer in layers:
        start, read_before = time.perf_counter(), reader.bytes_read
        weights = load_layer_weights(reader, cfg, layer, dtype, shard, progress).to(device)
        runner = LatentMoERunner(cfg, weights, comm, plan, shard, backend_name, routed_input, scratch_bytes)
        runner.load_s, runner.load_bytes_read = time.perf_counter() - start, reader.bytes_read - read_before
        runners[layer] = runner
    return runners
