"""The aliases' model classes: vLLM's own model classes with every MoE block on the tier.

Each alias subclasses the native class (:data:`NATIVE`) and changes two things, the plugin's one
seam into vLLM's model code:

* **the block**: a native model builds its MoE blocks by naming a class of a vLLM module.
  :func:`tier_blocks` puts :class:`TierMoE` under that name while the native ``__init__`` runs
  (and the native class back after), so the model gets parameter-free blocks and vLLM creates
  no gate, expert or shared-expert weights;
* **the checkpoint**: :func:`without_blocks` drops every tensor of those blocks (one rule for
  every alias: a name holding ``layers.N.<block>.`` of a block built at layer N) before the
  native loader sees them.

Then the blocks' tier is opened (``settings``, ``tiers``): the blocks' layers in model order are
one step of this engine as a session peer. ``tests/vllm_lane`` checks that each native module
still names its block class, so a vLLM release that renames one fails there, not in a user's
engine.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from moe_runtime.units import torch_dtype

from . import idle, tiers
from .settings import TierSettings

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
OP = "latent_moe::tier_moe"
log = logging.getLogger(__name__)

# Alias class -> (vLLM's model class it subclasses, the (module, class name) of its MoE block).
NATIVE: dict[str, tuple[str, tuple[str, str]]] = {
    "TierQwen3MoeForCausalLM": ("vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM",
                                ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeSparseMoeBlock")),
    "TierDeepseekV3ForCausalLM": ("vllm.model_executor.models.deepseek_v2:DeepseekV3ForCausalLM",
                                  ("vllm.model_executor.models.deepseek_v2", "DeepseekV2MoE")),
    "TierKimiK3ForConditionalGeneration": ("vllm.models.kimi_k3:KimiK3ForConditionalGeneration",
                                           ("<kimi_k3 stack>", "KimiMoE")),
}


class TierMoE(nn.Module):
    """One MoE block on the tier: ``[T, H]`` in, the layer's output (routed + shared) out.

    It holds no experts (``experts`` is None), but answers the expert counts vLLM's MoE model
    classes read from their blocks (the model config's; none redundant)."""

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any):
        super().__init__()
        found = _LAYER.search(prefix + ".")
        if found is None:
            raise ValueError(f"cannot tell the decoder layer of MoE block {prefix!r}")
        self.prefix, self.layer = prefix, int(found.group(1))
        self.tier_layer = self.layer  # set from the settings' layer map once the model is built
        self.tier = -1  # tiers.add's number, once the tier is open
        # The native blocks take the text config as config= (DeepSeek, Kimi) or in vllm_config= (Qwen3).
        model_config = getattr(kwargs.get("vllm_config"), "model_config", None)
        text = kwargs.get("config") or getattr(model_config, "hf_text_config", None)
        experts = next((getattr(text, n) for n in ("num_experts", "n_routed_experts", "num_local_experts")
                        if getattr(text, n, None)), 0)
        self.n_routed_experts = self.n_logical_experts = experts
        self.n_physical_experts = self.n_local_physical_experts = experts
        self.n_shared_experts = getattr(text, "n_shared_experts", None) or 0
        self.n_redundant_experts = 0
        self.experts = None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = torch.empty_like(x)
        torch.ops.latent_moe.tier_moe(x, out, self.tier_layer, self.tier)
        return out.view_as(hidden_states)


@contextlib.contextmanager
def tier_blocks(native: tuple[str, str]) -> Iterator[list[TierMoE]]:
    """While open, the ``(module, class name)`` of a native MoE block builds a :class:`TierMoE`;
    yields the blocks built, in build order."""
    built: list[TierMoE] = []

    class Block(TierMoE):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            built.append(self)

    module_name, name = native
    module = importlib.import_module(module_name)
    saved = getattr(module, name)
    setattr(module, name, Block)
    try:
        yield built
    finally:
        setattr(module, name, saved)


def open_tier(vllm_config: Any, blocks: list[TierMoE]) -> TierSettings:
    """Check the engine's config against the tier, open it and wire every block to it."""
    settings = TierSettings.parse(vllm_config.additional_config)
    check_engine(vllm_config)
    if not blocks:
        raise ValueError("the model built no MoE block to send to the tier")
    for block in blocks:
        block.tier_layer = settings.tier_layer(block.layer)
    step = [b.tier_layer for b in blocks]
    if len(set(step)) != len(step):
        raise ValueError(f"two MoE blocks map to one tier layer: {step}")
    hidden = vllm_config.model_config.hf_text_config.hidden_size
    tier: tiers.LocalTier | tiers.SessionTier | tiers.TPFollower
    if vllm_config.parallel_config.tensor_parallel_size > 1:  # rank 0 is the engine's one peer
        from vllm.distributed.parallel_state import get_tp_group

        tiers.set_tp_group(get_tp_group())
    if tiers.tp_rank() > 0:
        tier = tiers.TPFollower()
    elif settings.ticket is not None:
        peer = idle.engine_peer(vllm_config, settings)
        device = torch.device(vllm_config.device_config.device)
        if device.type == "cuda" and device.index is None:  # this worker's own GPU
            device = torch.device("cuda", torch.cuda.current_device())
        tier = tiers.SessionTier(
            settings.ticket, peer, step, hidden, vllm_config.scheduler_config.max_num_batched_tokens,
            str(device))
        if idle.tells_idle(vllm_config):  # its scheduler's notices come to this listener
            tier.notices = idle.IdleListener(idle.address(settings.ticket, peer), tier.peer.idle)
        else:
            log.info("latent-MoE tier: this engine's scheduler does not tell its session when it runs out of "
                     "requests (an elastic session's other engines wait idle_after_s for it each time); "
                     "scheduler_cls=deployments.vllm_plugin.idle.TierScheduler does (docs/vllm.md)")
    else:
        dtype = torch_dtype(settings.dtype) if settings.dtype else vllm_config.model_config.dtype
        tier = tiers.LocalTier(settings.checkpoint, step, dtype, settings.backend, hidden)
    number = tiers.add(tier)
    for block in blocks:
        block.tier = number
    return settings


def check_engine(vllm_config: Any) -> None:
    """Refuse what cannot run with the MoE on the tier, and split compiled graphs around the op."""
    from vllm.config import CompilationMode

    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp != 1:
        raise ValueError(f"a latent-MoE tier model runs at pipeline_parallel_size 1 (an engine's MoE layers "
                         f"are one step of one session peer), got pipeline_parallel_size = {pp}")
    if vllm_config.parallel_config.enable_eplb:
        raise ValueError("expert-parallel load balancing (enable_eplb) moves experts the engine does not "
                         "hold: the tier holds every expert; turn it off")
    cc = vllm_config.compilation_config
    if cc.cudagraph_mode.has_full_cudagraphs():
        raise ValueError(
            f"cudagraph_mode {cc.cudagraph_mode.name} captures whole forwards in CUDA graphs, and a replay "
            f"would skip the tier's call (host I/O the graph does not hold); use piecewise graphs, which "
            "run the tier between their pieces: --compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}'")
    split = cc.splitting_ops
    if cc.mode == CompilationMode.VLLM_COMPILE and split is not None and OP not in split:
        split.append(OP)  # piecewise graphs end before the op and start again after it
        log.info("latent-MoE tier: compiled graphs split at %s", OP)


def without_blocks(weights: Iterable[tuple[str, torch.Tensor]],
                   blocks: list[TierMoE]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors minus those of the tier's blocks: a name holding a block's
    ``layers.N.<block>.`` (the module tree may name what comes before it otherwise, as Kimi-K3's
    ``language_model.model.`` against its checkpoint's ``language_model.``)."""
    mine = tuple("." + b.prefix[b.prefix.index("layers."):] + "." for b in blocks)
    return ((name, w) for name, w in weights if not any(m in "." + name for m in mine))


def native_block(block: tuple[str, str]) -> tuple[str, str]:
    """The (module, class name) of a native MoE block on this platform."""
    if block[0] != "<kimi_k3 stack>":
        return block
    from vllm.platforms import current_platform

    # Kimi-K3's decoder stack lives in a module per platform.
    return ("vllm.models.kimi_k3.amd.linear" if current_platform.is_rocm()
            else "vllm.models.kimi_k3.nvidia.model", block[1])


def tier_model(name: str) -> type[nn.Module]:
    """The alias class ``name``: :data:`NATIVE`'s model class with its MoE blocks on the tier."""
    native_path, block = NATIVE[name]
    module_name, class_name = native_path.split(":")
    native = getattr(importlib.import_module(module_name), class_name)
    block = native_block(block)

    def __init__(self: Any, *, vllm_config: Any, prefix: str = "") -> None:
        with tier_blocks(block) as built:
            native.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self.blocks = list(built)
        self.settings = open_tier(vllm_config, self.blocks)

    def load_weights(self: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        return native.load_weights(self, without_blocks(weights, self.blocks))

    doc = f"vLLM's {class_name} with its MoE blocks ({block[1]}) on the latent-MoE tier."
    return type(name, (native,), {"__init__": __init__, "load_weights": load_weights, "__doc__": doc,
                                  "__module__": __name__})


def __getattr__(name: str) -> type[nn.Module]:
    # vLLM imports an alias's class by name; build it on first use (vLLM is imported then).
    if name not in NATIVE:
        raise AttributeError(name)
    cls = globals()[name] = tier_model(name)
    return cls
