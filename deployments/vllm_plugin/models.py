"""The aliases' model classes: vLLM's own decoders with every MoE block on the tier.

A native model builds its MoE blocks by naming a class in its module. :func:`tier_blocks` puts
:class:`TierMoE` under that name while the decoder stack is built (and puts the native class
back after), so the stack gets parameter-free blocks and vLLM creates no gate, expert or
shared-expert weights; checkpoint tensors under those blocks' prefixes are skipped on load.
Then the blocks' tier is opened (``settings``, ``tiers``): the blocks' layers in model order are
one step of this engine as a session peer.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from moe_runtime.units import torch_dtype

from . import tiers
from .settings import TierSettings

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class TierMoE(nn.Module):
    """One MoE block on the tier: ``[T, H]`` in, the layer's output (routed + shared) out."""

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any):
        super().__init__()
        found = _LAYER.search(prefix + ".")
        if found is None:
            raise ValueError(f"cannot tell the decoder layer of MoE block {prefix!r}")
        self.prefix, self.layer = prefix, int(found.group(1))
        self.tier_layer = self.layer  # set from the settings' layer map once the model is built
        self.tier = -1  # tiers.add's number, once the tier is open

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        return torch.ops.latent_moe.tier_moe(x, self.tier_layer, self.tier).view_as(hidden_states)


@contextlib.contextmanager
def tier_blocks(natives: Iterable[tuple[str, str]]) -> Iterator[list[TierMoE]]:
    """While open, each ``(module, class name)`` of ``natives`` builds a :class:`TierMoE`;
    yields the blocks built, in build order."""
    built: list[TierMoE] = []

    class Block(TierMoE):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            built.append(self)

    saved = []
    try:
        for module_name, name in natives:
            module = importlib.import_module(module_name)
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, Block)
        yield built
    finally:
        for module, name, native in saved:
            setattr(module, name, native)


def open_tier(vllm_config: Any, blocks: list[TierMoE]) -> TierSettings:
    """Check the engine's config against the tier, open it and wire every block to it."""
    settings = TierSettings.parse(vllm_config.additional_config)
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp != 1:
        raise ValueError(f"a latent-MoE tier model runs at tensor_parallel_size 1 per engine (the tier holds "
                         f"the MoE's parallelism), got tensor_parallel_size = {tp}")
    if not blocks:
        raise ValueError("the model built no MoE block to send to the tier")
    for block in blocks:
        block.tier_layer = settings.tier_layer(block.layer)
    step = [b.tier_layer for b in blocks]
    if len(set(step)) != len(step):
        raise ValueError(f"two MoE blocks map to one tier layer: {step}")
    hidden = vllm_config.model_config.hf_text_config.hidden_size
    if settings.ticket is not None:
        peer = settings.peer if settings.peer is not None else vllm_config.parallel_config.data_parallel_rank
        device = torch.device(vllm_config.device_config.device)
        if device.type == "cuda" and device.index is None:  # this worker's own GPU
            device = torch.device("cuda", torch.cuda.current_device())
        tier: tiers.LocalTier | tiers.SessionTier = tiers.SessionTier(
            settings.ticket, peer, step, hidden, vllm_config.scheduler_config.max_num_batched_tokens,
            str(device))
    else:
        dtype = torch_dtype(settings.dtype) if settings.dtype else vllm_config.model_config.dtype
        tier = tiers.LocalTier(settings.checkpoint, step, dtype, settings.backend, hidden)
    number = tiers.add(tier)
    for block in blocks:
        block.tier = number
    return settings


def without_blocks(weights: Iterable[tuple[str, torch.Tensor]], blocks: list[TierMoE],
                   prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors minus those of the tier's blocks (``prefix``: what the checkpoint's
    names carry before the blocks' own prefixes)."""
    skip = tuple(prefix + b.prefix + "." for b in blocks)
    return ((name, w) for name, w in weights if not name.startswith(skip))


def _qwen3_moe() -> type[nn.Module]:
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.interfaces import SupportsPP
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel
    from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix

    class TierQwen3MoeForCausalLM(nn.Module, SupportsPP):
        """Qwen3-MoE with its MoE blocks on the tier (its dense layers, attention, embeddings and
        head stay in vLLM)."""

        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                  "gate_up_proj": ["gate_proj", "up_proj"]}

        def __init__(self, *, vllm_config: Any, prefix: str = ""):
            super().__init__()
            config = vllm_config.model_config.hf_text_config
            self.config = config
            with tier_blocks([("vllm.model_executor.models.qwen3_moe", "Qwen3MoeSparseMoeBlock")]) as built:
                self.model = Qwen3MoeModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
            self.blocks = list(built)
            self.settings = open_tier(vllm_config, self.blocks)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                          quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(config.vocab_size)
            self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

        def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.model.embed_input_ids(input_ids)

        def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                    intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None) -> Any:
            return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
            return self.logits_processor(self.lm_head, hidden_states)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            kept = without_blocks(weights, self.blocks)
            if self.config.tie_word_embeddings:  # the head is the embedding
                kept = ((name, w) for name, w in kept if not name.startswith("lm_head."))
            return AutoWeightsLoader(self).load_weights(kept)

    return TierQwen3MoeForCausalLM


def _kimi_k3() -> type[nn.Module]:
    from vllm.models.kimi_k3 import KimiK3ForConditionalGeneration
    from vllm.platforms import current_platform

    # The decoder stack's module, and the MoE block's class name in it, per platform.
    stack = ("vllm.models.kimi_k3.amd.linear" if current_platform.is_rocm()
             else "vllm.models.kimi_k3.nvidia.model")

    class TierKimiK3ForConditionalGeneration(KimiK3ForConditionalGeneration):
        """Kimi-K3 (vision tower, KDA and MLA attention in vLLM) with its MoE blocks on the tier."""

        def __init__(self, *, vllm_config: Any, prefix: str = ""):
            with tier_blocks([(stack, "KimiMoE")]) as built:
                super().__init__(vllm_config=vllm_config, prefix=prefix)
            self.blocks = list(built)
            self.settings = open_tier(vllm_config, self.blocks)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
            # The blocks' prefixes are the module tree's (language_model.model.layers.N.block_sparse_moe);
            # a K3 checkpoint names them language_model.layers.N.block_sparse_moe, which the native
            # loader maps onto the tree: skip any name holding a block's "layers.N.<block>." part.
            mine = [".layers." + b.prefix.split(".layers.", 1)[-1] + "." for b in self.blocks]
            kept = ((name, w) for name, w in weights if not any(m in "." + name for m in mine))
            return super().load_weights(kept)

    return TierKimiK3ForConditionalGeneration


def __getattr__(name: str) -> type[nn.Module]:
    # vLLM imports an alias's class by name; build it on first use (vLLM is imported then).
    builders = {"TierQwen3MoeForCausalLM": _qwen3_moe, "TierKimiK3ForConditionalGeneration": _kimi_k3}
    if name not in builders:
        raise AttributeError(name)
    cls = builders[name]()
    globals()[name] = cls
    return cls
