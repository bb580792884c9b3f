"""Where a model's MoE blocks run: the tier (a session peer) or this process (the reference).

Both take a block's input ``[T, H]`` and return its output in the same dtype. The model reaches
them through one custom op, ``torch.ops.latent_moe.tier_moe(x, out, layer, tier)`` (``tier``: the
number :func:`add` gave; the answer is written into ``out``), so torch.compile sees one opaque
call and vLLM splits its piecewise graphs around it (``models.check_engine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moe_runtime.checkpoint import CheckpointReader, load_layer_weights
from moe_runtime.families import is_standard, load_layer_config
from moe_runtime.layer import moe_forward
from moe_runtime.standard.layer import standard_moe_forward
from moe_runtime.standard.weights import load_standard_layer
from moe_runtime.units import torch_dtype

from ..common.wire import DeviceRows, WireTensor
from ..dataplane.errors import SessionError
from ..dataplane.peer import Peer, SessionTicket
from . import metrics


class LocalTier:
    """Every mapped layer of a checkpoint in this process: a tier checkpoint (``moe_runtime.layer``)
    or a Qwen3-MoE / DeepSeek-V3 model folder, the engine's own included (``moe_runtime.standard``)."""

    def __init__(self, checkpoint: str | Path, layers: Sequence[int], dtype: torch.dtype, backend: str,
                 hidden_size: int):
        self.cfg = load_layer_config(checkpoint)
        load, self._forward = ((load_standard_layer, standard_moe_forward) if is_standard(self.cfg)
                               else (load_layer_weights, moe_forward))
        check_layers(layers, self.cfg.moe_layers, f"tier checkpoint {checkpoint}")
        check_hidden(hidden_size, self.cfg.hidden_size, f"tier checkpoint {checkpoint}")
        reader = CheckpointReader(checkpoint)
        # vLLM builds its model under its device as torch's default (cuda on a GPU): read on the
        # CPU, and move each layer to the device its rows come on at its first call.
        with torch.device("cpu"):
            self.weights = {x: load(reader, self.cfg, x, dtype) for x in sorted(set(layers))}
        self.device = dict.fromkeys(self.weights, torch.device("cpu"))
        self.dtype, self.backend = dtype, backend
        self.stats = metrics.TierStats(self.weights)

    @metrics.recorded
    def forward(self, x_TH: torch.Tensor, layer: int) -> torch.Tensor:
        if self.device[layer] != x_TH.device:
            self.weights[layer], self.device[layer] = self.weights[layer].to(x_TH.device), x_TH.device
        return self._forward(x_TH.to(self.dtype), self.weights[layer], self.cfg, self.backend).to(x_TH.dtype)


class SessionTier:
    """This engine as peer ``index`` of a session (``deployments.dataplane.peer``); ``step``: the
    tier layers of one model step, in order. Joins at once: a tier out of reach fails the build.
    An engine on a GPU whose tier's ranks offer NCCL channels sends its rows GPU to GPU
    (``dataplane.channel``); otherwise as bytes on its connection."""

    def __init__(self, ticket: SessionTicket, index: int, step: Sequence[int], hidden_size: int,
                 max_tokens: int, device: str = "cpu"):
        check_layers(step, ticket.layers, f"session {ticket.name!r}")
        for g in ticket.groups:
            check_hidden(hidden_size, g.hidden_size, f"session {ticket.name!r} (deployment {g.deployment!r})")
            if max_tokens > g.max_tokens:
                raise ValueError(
                    f"the engine's max_num_batched_tokens = {max_tokens} exceeds the {g.max_tokens} rows per "
                    f"peer and layer that session {ticket.name!r} reserved on deployment {g.deployment!r}: "
                    f"lower it or open the session with max_tokens >= {max_tokens}")
        self.ticket = ticket
        on_gpu = torch.device(device).type == "cuda" and all(g.channel == "nccl" for g in ticket.groups)
        self.device = device if on_gpu else None
        self.peer = Peer(ticket, index, tuple(step), self.device)
        self.stats = metrics.TierStats(step)

    @metrics.recorded
    def forward(self, x_TH: torch.Tensor, layer: int) -> torch.Tensor:
        g = self.ticket.group_for(layer)
        x = x_TH.detach().to(torch_dtype(g.dtype)).contiguous()
        rows = DeviceRows(x, g.dtype) if self.device is not None else WireTensor.from_torch(x)
        try:
            out, _ = self.peer.forward_wire(rows, layer)
        except SessionError as e:  # the group failed and no other took the session within move_s
            raise SessionError(e.failure, f"latent-MoE tier, layer {layer}, peer {self.peer.index} of "
                               f"session {self.ticket.name!r}: {e.message}", e.peer, e.replica) from e
        # Bytes come back as a CPU tensor; a device channel's rows are on the engine's GPU already.
        return out.to_torch().to(x_TH.device, x_TH.dtype)


def check_layers(wanted: Sequence[int], served: Sequence[int], where: str) -> None:
    missing = sorted(set(wanted) - set(served))
    if missing:
        raise ValueError(f"the model's MoE blocks map to tier layer(s) {missing}, which {where} does not "
                         f"serve (it serves {sorted(served)}); set additional_config latent_moe.layers")


def check_hidden(model: int, tier: int, where: str) -> None:
    if model != tier:
        raise ValueError(f"the model's hidden_size = {model} but {where} has hidden_size = {tier}")


class TPFollower:
    """A rank other than 0 of a tensor-parallel engine: rank 0 is the engine's tier (one peer of its
    session); this rank gets rank 0's answer through the engine's TP group (:func:`tier_moe`)."""


_TIERS: dict[int, LocalTier | SessionTier | TPFollower] = {}
# The engine's vLLM TP group (set_tp_group) when its tensor_parallel_size > 1.
_TP_GROUP: Any = None


def set_tp_group(group: Any) -> None:
    global _TP_GROUP
    _TP_GROUP = group


def tp_rank() -> int:
    """This process's rank in its engine's TP group (0 without one)."""
    return 0 if _TP_GROUP is None else _TP_GROUP.rank_in_group


def add(tier: LocalTier | SessionTier | TPFollower) -> int:
    """Register ``tier`` for the op; its number."""
    number = len(_TIERS)
    _TIERS[number] = tier
    if hasattr(tier, "stats"):  # the engine's metrics (a TP engine's rank 0 holds its tier)
        metrics.publish(tier.stats)
    return number


@torch.library.custom_op("latent_moe::tier_moe", mutates_args=("out",))
def tier_moe(x: torch.Tensor, out: torch.Tensor, layer: int, tier: int) -> None:
    # The answer goes into ``out``, a buffer the caller made: under piecewise CUDA graphs the graph
    # piece before the op allocates it and the piece after reads it at the address captured.
    if dummy_pass():  # its output is thrown away: no step of the session, no rows on the tier
        out.zero_()
        return
    if tp_rank() == 0:
        out.copy_(_TIERS[tier].forward(x, layer))
    if _TP_GROUP is not None:  # every rank of a TP engine holds the same rows; rank 0 asked the tier
        _TP_GROUP.broadcast(out, src=0)


@tier_moe.register_fake
def _(x: torch.Tensor, out: torch.Tensor, layer: int, tier: int) -> None:
    return None


def dummy_pass() -> bool:
    """Whether vLLM runs the model on made-up rows: its warm-up, compilation and profiling passes
    (and CUDA-graph capture) run the model without attention metadata, a real batch never."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return is_forward_context_available() and get_forward_context().attn_metadata is None
