"""Which MoE layer family a model folder holds, and its layer config (pure: no torch, no Ray).

- ``latent_moe``: a Kimi-K3-style latent-MoE checkpoint (its ``config.json`` names
  ``routed_expert_hidden_size``, DESIGN §3): :class:`~moe_runtime.config.LatentMoEConfig`, served
  by ``tp.runner`` with the tails of DESIGN §4.
- ``qwen3_moe`` / ``deepseek_v3``: a Hugging Face Qwen3-MoE or DeepSeek-V3 (Kimi-K2) model folder
  (``architectures``, then ``model_type``): ``moe_runtime.standard``'s config, served by
  ``StandardMoERunner`` with its one fixed plan (``tp.plan.standard_plan``).

Anything else is a ValueError naming what the file says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import LatentMoEConfig, read_config_json
from .standard.config import FAMILIES, StandardMoEConfig
from .standard.config import family_of as standard_family_of

LATENT_MOE = "latent_moe"
LayerConfig = LatentMoEConfig | StandardMoEConfig


def family_of(raw: dict[str, Any]) -> str:
    """The layer family a ``config.json`` dict describes: ``latent_moe``, ``qwen3_moe`` or
    ``deepseek_v3`` (ValueError naming its architectures and model type otherwise)."""
    text = dict(raw)
    if isinstance(raw.get("text_config"), dict):
        text.update(raw["text_config"])
    if "routed_expert_hidden_size" in text:
        return LATENT_MOE
    try:
        return standard_family_of(raw)
    except ValueError as e:
        raise ValueError(f"{e}; nor a latent-MoE checkpoint (Kimi-K3 style: it has no "
                         "routed_expert_hidden_size)") from None


def layer_family(folder: str | Path) -> str:
    """The layer family of the model in ``folder`` (its ``config.json``): see :func:`family_of`."""
    return _named(folder, family_of, read_config_json(folder))


def config_from_raw(raw: dict[str, Any]) -> LayerConfig:
    """The validated layer config of a ``config.json`` dict, whichever family it is."""
    family = family_of(raw)
    return LatentMoEConfig.from_dict(raw) if family == LATENT_MOE else FAMILIES[family].from_dict(raw)


def load_layer_config(folder: str | Path) -> LayerConfig:
    """The validated layer config of the model in ``folder``, whichever family it is."""
    return _named(folder, config_from_raw, read_config_json(folder))


def is_standard(cfg: LayerConfig) -> bool:
    """Whether ``cfg`` is a standard (non-latent) MoE layer's: one fixed plan, no tails."""
    return isinstance(cfg, StandardMoEConfig)


def family_name(cfg: LayerConfig) -> str:
    return cfg.family if is_standard(cfg) else LATENT_MOE


def _named(folder: str | Path, read: Any, raw: dict[str, Any]) -> Any:
    try:
        return read(raw)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
