"""vLLM as the tier's attention side: a vLLM plugin whose models send every MoE block to the tier.

Loaded by every vLLM process through the ``vllm.general_plugins`` entry point (``pip install
.[vllm]``); :func:`register` adds the model aliases of :data:`ALIASES`. A model built under an
alias has no gate, expert or shared-expert weights in its MoE blocks: each block is a
:class:`~deployments.vllm_plugin.models.TierMoE`, which hands its input ``[T, H]`` to the tier as
one custom op (``torch.ops.latent_moe.tier_moe``, with a fake for torch.compile) and returns the
layer's output. Where the tier is and which tier layer serves which block come from vLLM's own
``additional_config["latent_moe"]`` (:mod:`~deployments.vllm_plugin.settings`): a session ticket
of the data plane (``deployments.dataplane``; each engine one peer) or, for a reference, a local
checkpoint run in-process with ``moe_runtime``. docs/vllm.md has the commands.

Each engine's tier calls per layer, rows and call latency are among vLLM's own metrics (its
``/metrics``) and answered for an ``LLM`` by :func:`tier_stats` (:mod:`~deployments.vllm_plugin.metrics`).

Needs no Ray: a vLLM process joins a session with the ticket alone.
"""

from __future__ import annotations

from .metrics import tier_stats

__all__ = ["ALIASES", "register", "tier_stats"]

# Alias -> the class that serves it (vLLM imports it lazily, on first use).
ALIASES: dict[str, str] = {
    "LatentMoeQwen3MoeForCausalLM": "deployments.vllm_plugin.models:TierQwen3MoeForCausalLM",
    "LatentMoeDeepseekV3ForCausalLM": "deployments.vllm_plugin.models:TierDeepseekV3ForCausalLM",
    "LatentMoeKimiK3ForConditionalGeneration":
        "deployments.vllm_plugin.models:TierKimiK3ForConditionalGeneration",
}


def register() -> None:
    """vLLM's plugin hook: add the aliases and set up the engine metrics (idempotent; vLLM calls it
    in every process, the front end first)."""
    from vllm import ModelRegistry

    from . import metrics

    metrics.setup()

    known = set(ModelRegistry.get_supported_archs())
    for alias, target in ALIASES.items():
        if alias not in known:
            ModelRegistry.register_model(alias, target)
