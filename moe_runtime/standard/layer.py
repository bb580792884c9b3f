"""The standard MoE layer's forward on one device, and on one rank of a TP group.

The math is the latent layer's with the latent D = H and no down/up projection or norm, and
it runs through the same code: ``router.route`` (softmax or sigmoid scores, correction bias for
the choice only, grouped top-k, renormalisation, routed scaling), an experts backend (SiLU
experts, fp32 combine) and ``layer.gated_mlp`` (the shared experts). Under TP every rank
holds an intermediate-dimension slice of every expert and of the shared MLP (``weights.py``),
so its routed and shared outputs are partial sums of ``out``: one all-reduce of their sum, in
the compute dtype, gives ``out`` on every rank (partials accumulate in fp32 locally).

Legend: T tokens, H hidden, E experts, K experts per token.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch

from ..activation import GatedActivation
from ..checkpoint import CheckpointReader
from ..experts import DEFAULT_SCRATCH_BYTES, ExpertsBackend, backend_candidates, get_backend
from ..layer import check_input, gated_mlp
from ..router import route
from ..tp.collectives import Collectives
from ..tp.plan import STANDARD_TAIL
from ..tp.served import ServedRunner, choose_backend
from ..tp.sharding import TPShard
from .config import StandardMoEConfig
from .weights import StandardMoEWeights, load_standard_layer

SILU = GatedActivation()  # both families run SiLU(gate) * up experts (config checks hidden_act)


def standard_moe_partial(
    x_TH: torch.Tensor,
    w: StandardMoEWeights,
    cfg: StandardMoEConfig,
    backend: ExpertsBackend,
    router_logits_TE: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``[T, H]``: the routed experts' weighted sum plus the shared experts' output, a
    partial sum of the layer's output when ``w`` is a TP shard. Inputs are not checked."""
    ids_TK, weights_TK = route(x_TH, w.gate_EH, w.bias_E, cfg.router, router_logits_TE)
    out_TH = backend(x_TH, ids_TK, weights_TK, w.experts, SILU)
    if w.has_shared:
        out_TH += gated_mlp(x_TH, w.shared_gate_SH, w.shared_up_SH, w.shared_down_HS, SILU).float()
    return out_TH


def standard_moe_forward(
    x_TH: torch.Tensor,
    w: StandardMoEWeights,
    cfg: StandardMoEConfig,
    backend: str | ExpertsBackend = "torch",
    router_logits_TE: torch.Tensor | None = None,
) -> torch.Tensor:
    """One standard MoE layer on one device: ``[T, H]`` in ``w``'s dtype (the residual add is the
    caller's). ValueError naming what is wrong with ``x_TH`` or ``router_logits_TE``."""
    check_input(x_TH, cfg, w.dtype, router_logits_TE)
    be = get_backend(backend) if isinstance(backend, str) else backend
    return standard_moe_partial(x_TH, w, cfg, be, router_logits_TE).to(x_TH.dtype)


class StandardMoERunner(ServedRunner):
    """One standard MoE layer on one rank of a TP group: ``forward`` returns ``out [T, H]`` on
    every rank after one all-reduce (none at TP 1). Its one plan is ``tp.plan.standard_plan``
    (``last_tail``: ``standard``); it reports what a latent runner does (``tp.served``)."""

    def __init__(
        self,
        cfg: StandardMoEConfig,
        weights: StandardMoEWeights,
        comm: Collectives,
        backend: str = "torch",
        scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    ):
        P = comm.world
        I_local, Is_local = cfg.moe_intermediate_size // P, cfg.shared_intermediate_size // P
        found = (weights.experts.num_experts, weights.experts.intermediate_size, weights.experts.latent_size)
        if found != (cfg.num_experts, I_local, cfg.hidden_size):
            raise ValueError(f"experts (E, I_local, H) are {found}, expected "
                             f"{(cfg.num_experts, I_local, cfg.hidden_size)} for TP {P}")
        shared = 0 if weights.shared_gate_SH is None else weights.shared_gate_SH.shape[0]
        if shared != Is_local:
            raise ValueError(f"shared experts hold {shared} rows, expected Is / P = "
                             f"{cfg.shared_intermediate_size} / {P} = {Is_local}")
        self.cfg, self.w, self.comm = cfg, weights, comm
        self.init_backend(backend, scratch_bytes, weights.experts)

    def forward(self, x_TH: torch.Tensor, router_logits_TE: torch.Tensor | None = None) -> torch.Tensor:
        check_input(x_TH, self.cfg, self.w.dtype, router_logits_TE)
        out_TH = standard_moe_partial(x_TH, self.w, self.cfg, self.backend, router_logits_TE).to(x_TH.dtype)
        if self.comm.world > 1:
            self.comm.all_reduce(out_TH)
        self.last_tail = STANDARD_TAIL
        return out_TH

    __call__ = forward


def build_standard_runners(
    checkpoint: str | Path,
    cfg: StandardMoEConfig,
    layers: Iterable[int],
    comm: Collectives,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    backend: str = "torch",
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
) -> dict[int, StandardMoERunner]:
    """Load this rank's shard of every layer in ``layers`` and wrap each in a runner. A backend
    other than ``torch`` serves only after matching it on the first layer's experts (as the
    latent runners do; ``auto`` falls back to ``torch``)."""
    candidates, why = backend_candidates(backend)
    reader = CheckpointReader(checkpoint)
    shard = TPShard(comm.rank, comm.world)
    runners: dict[int, StandardMoERunner] = {}
    chosen = None
    for layer in layers:
        start, read_before = time.perf_counter(), reader.bytes_read
        w = load_standard_layer(reader, cfg, layer, dtype, shard)
        if device != "cpu":
            w = w.to(device)
        load_s, bytes_read = time.perf_counter() - start, reader.bytes_read - read_before
        if chosen is None:
            chosen, checks, warning = choose_backend(
                candidates, backend, why, w.experts, SILU, top_k=cfg.num_experts_per_tok, layer=layer,
                scratch_bytes=scratch_bytes, device=device, rank=comm.rank,
                label=f"{cfg.family} MoE runner: TP {comm.world}, {dtype}, experts backend ",
            )
        runner = StandardMoERunner(cfg, w, comm, chosen, scratch_bytes)
        runner.load_s, runner.load_bytes_read = load_s, bytes_read
        runner.backend_checks, runner.backend_warning = checks, warning
        runners[layer] = runner
    return runners

