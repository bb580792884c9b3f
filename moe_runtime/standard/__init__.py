"""The standard (non-latent) MoE layers of the two families vLLM runs on CPU.

- **Qwen3-MoE** (HF ``Qwen3MoeSparseMoeBlock``): router linear, softmax over all experts,
  top-k, renormalised when ``norm_topk_prob``; SiLU-gated experts; no shared expert.
- **DeepSeek-V3** (HF ``DeepseekV3MoE``; Kimi-K2 uses it): sigmoid scores; the top-k is chosen
  on ``score + e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups
  (a group scores the sum of its top-2 biased scores); weights are the unbiased scores,
  renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``; SiLU experts, plus
  ``n_shared_experts`` shared experts (one MLP of width ``n_shared_experts * I``) added on.

Modules: ``config`` (one validated config type per family, from the model folder's
``config.json``: ``load_standard_config``), ``weights`` (one layer's tensors from the folder's
own safetensors, HF names, this TP rank's slices only: ``load_standard_layer``), ``layer``
(``standard_moe_forward`` on one device; ``StandardMoERunner`` on one rank of a TP group, one
all-reduce per forward; ``build_standard_runners``), ``synthetic`` (tiny random model folders;
``python -m moe_runtime.standard.synthetic --family qwen3_moe --out DIR``).

The math is shared with the latent layer (``router.route``, the experts backends,
``layer.gated_mlp``) and so is the sharding table (``tp.sharding``: experts split along their
intermediate dimension, the router replicated). Tested against an independent float64 loop
(``tests/test_standard_moe.py``) and, in the vLLM lane, against Hugging Face's own blocks.

Served by the same app as the latent layer (``deployments.app``, ``tests/test_standard_serving.py``):
``moe_runtime.families`` tells a folder's kind from its ``config.json``, the ranks build these
runners (which report what a latent runner does: ``tp.served``), and the controller gives them their
one plan (``tp.plan.standard_plan``) and refuses the latent layer's options for them.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "load_standard_config": ".config", "Qwen3MoeConfig": ".config", "DeepseekV3MoeConfig": ".config",
    "StandardMoEConfig": ".config", "load_standard_layer": ".weights", "StandardMoEWeights": ".weights",
    "standard_moe_forward": ".layer", "StandardMoERunner": ".layer", "build_standard_runners": ".layer",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)
