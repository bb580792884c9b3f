"""Where a model's MoE blocks run: the tier (a session peer) or this process (the reference).

Both take a block's input ``[T, H]`` and return its output in the same dtype. The model reaches
them through one custom op, ``torch.ops.latent_moe.tier_moe(x, layer, tier)`` (``tier``: the
number :func:`add` gave), so torch.compile and graph capture see one opaque call; its fake
returns an empty tensor of the input's shape.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from moe_runtime.checkpoint import CheckpointReader, load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import moe_forward
from moe_runtime.units import torch_dtype

from ..common.wire import DeviceRows, WireTensor
from ..dataplane.errors import SessionError
from ..dataplane.peer import Peer, SessionTicket


class LocalTier:
    """Every mapped layer of a tier checkpoint in this process (``moe_runtime.layer.moe_forward``)."""

    def __init__(self, checkpoint: str | Path, layers: Sequence[int], dtype: torch.dtype, backend: str,
                 hidden_size: int):
        self.cfg = LatentMoEConfig.from_pretrained(checkpoint)
        check_layers(layers, self.cfg.moe_layers, f"tier checkpoint {checkpoint}")
        check_hidden(hidden_size, self.cfg.hidden_size, f"tier checkpoint {checkpoint}")
        reader = CheckpointReader(checkpoint)
        # vLLM builds its model under its device as torch's default (cuda on a GPU): read on the
        # CPU, and move each layer to the device its rows come on at its first call.
        with torch.device("cpu"):
            self.weights = {x: load_layer_weights(reader, self.cfg, x, dtype) for x in sorted(set(layers))}
        self.dtype, self.backend = dtype, backend
        self.calls: collections.Counter[int] = collections.Counter()

    def forward(self, x_TH: torch.Tensor, layer: int) -> torch.Tensor:
        self.calls[layer] += 1
        weights = self.weights[layer]
        if weights.down_DH.device != x_TH.device:
            weights = self.weights[layer] = weights.to(x_TH.device)
        return moe_forward(x_TH.to(self.dtype), weights, self.cfg, self.backend).to(x_TH.dtype)


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
        self.calls: collections.Counter[int] = collections.Counter()

    def forward(self, x_TH: torch.Tensor, layer: int) -> torch.Tensor:
        self.calls[layer] += 1
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


_TIERS: dict[int, LocalTier | SessionTier] = {}


def add(tier: LocalTier | SessionTier) -> int:
    """Register ``tier`` for the op; its number."""
    number = len(_TIERS)
    _TIERS[number] = tier
    if os.environ.get("LMS_VLLM_CALLS"):  # tests and benchmarks read each engine's calls per layer
        atexit.register(_write_calls, Path(os.environ["LMS_VLLM_CALLS"]), number)
    return number


def _write_calls(folder: Path, number: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    calls = {str(k): v for k, v in _TIERS[number].calls.items()}
    (folder / f"calls-{os.getpid()}-{number}.json").write_text(json.dumps(calls))


@torch.library.custom_op("latent_moe::tier_moe", mutates_args=())
def tier_moe(x: torch.Tensor, layer: int, tier: int) -> torch.Tensor:
    return _TIERS[tier].forward(x, layer)


@tier_moe.register_fake
def _(x: torch.Tensor, layer: int, tier: int) -> torch.Tensor:
    return torch.empty_like(x)
