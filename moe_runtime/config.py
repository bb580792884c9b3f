"""Validated latent-MoE model config, read from a Kimi-K3-style ``config.json``."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .units import DTYPES

ROUTER_FUNCS = ("sigmoid", "softmax")
ACTIVATIONS = ("situ", "silu")

_REQUIRED = (
    "hidden_size",
    "routed_expert_hidden_size",
    "num_experts",
    "num_experts_per_token",
    "moe_intermediate_size",
    "num_hidden_layers",
)


@dataclass(frozen=True)
class LatentMoEConfig:
    """The fields of DESIGN §3 that the MoE layer needs.

    Legend used across the package: T tokens, H hidden_size, D routed_expert_hidden_size
    (latent), E num_experts, K num_experts_per_token, I moe_intermediate_size,
    Is = I * num_shared_experts.
    """

    hidden_size: int
    routed_expert_hidden_size: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    use_grouped_topk: bool = False
    num_expert_group: int = 1
    topk_group: int = 1
    latent_moe_use_norm: bool = True
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in (*_REQUIRED, "moe_layer_freq", "num_expert_group", "topk_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        for name in ("num_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"config field {name} must be an integer >= 0, got {value!r}")
        for name in ("moe_renormalize", "use_grouped_topk", "latent_moe_use_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"config field {name} must be true or false, got {getattr(self, name)!r}")
        for name in (
            "routed_scaling_factor",
            "rms_norm_eps",
            "activation_situ_beta",
            "activation_situ_linear_beta",
        ):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            ):
                raise ValueError(f"config field {name} must be a finite number, got {value!r}")
        for name in ("moe_router_activation_func", "hidden_act", "torch_dtype"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"config field {name} must be a string, got {getattr(self, name)!r}")
        E, K = self.num_experts, self.num_experts_per_token
        if K > E:
            raise ValueError(f"num_experts_per_token ({K}) > num_experts ({E})")
        if self.moe_router_activation_func not in ROUTER_FUNCS:
            raise ValueError(
                f"moe_router_activation_func {self.moe_router_activation_func!r} is not one of {ROUTER_FUNCS}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not one of {ACTIVATIONS}")
        if self.hidden_act == "situ" and self.activation_situ_beta is None:
            raise ValueError("hidden_act 'situ' needs activation_situ_beta, which is missing")
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"config field {name} must be > 0 when set, got {value!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}")
        if self.torch_dtype not in DTYPES:
            raise ValueError(f"torch_dtype {self.torch_dtype!r} is not one of {list(DTYPES)}")
        if self.grouped:
            G, TG = self.num_expert_group, self.topk_group
            if E % G:
                raise ValueError(
                    f"num_experts ({E}) is not divisible by num_expert_group ({G}): {E} % {G} = {E % G}"
                )
            if TG > G:
                raise ValueError(f"topk_group ({TG}) > num_expert_group ({G})")
            if K > TG * (E // G):
                raise ValueError(
                    f"num_experts_per_token ({K}) > topk_group ({TG}) * experts per group "
                    f"({E // G}) = {TG * (E // G)}"
                )
        if not self.moe_layers:
            raise ValueError(
                f"no MoE layer: num_hidden_layers={self.num_hidden_layers}, "
                f"first_k_dense_replace={self.first_k_dense_replace}, "
                f"moe_layer_freq={self.moe_layer_freq}"
            )

    @property
    def grouped(self) -> bool:
        """Grouped top-k is in force (DESIGN §2: honoured when groups > 1)."""
        return self.use_grouped_topk and self.num_expert_group > 1

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def uses_situ(self) -> bool:
        """SiTU follows ``hidden_act`` as vLLM does: beta fields alone do not switch it on."""
        return self.hidden_act == "situ"

    def is_moe_layer(self, layer: int) -> bool:
        return (
            0 <= layer < self.num_hidden_layers
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def check_moe_layer(self, layer: int) -> None:
        """Raise ValueError naming why ``layer`` is not a servable MoE layer."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.num_hidden_layers:
            raise ValueError(f"unknown layer {layer}: the model has layers 0..{self.num_hidden_layers - 1}")
        if not self.is_moe_layer(layer):
            raise ValueError(
                f"layer {layer} is not a MoE layer (first_k_dense_replace="
                f"{self.first_k_dense_replace}, moe_layer_freq={self.moe_layer_freq}); "
                f"MoE layers: {self.moe_layers}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LatentMoEConfig:
        """Build from a config.json dict; text fields may sit under ``text_config``."""
        text = dict(raw)
        if isinstance(raw.get("text_config"), dict):
            text.update(raw["text_config"])
        missing = [name for name in _REQUIRED if name not in text]
        if missing:
            raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in text.items() if k in known and v is not None}
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            kwargs[name] = text.get(name)
        for name in ("routed_scaling_factor", "rms_norm_eps"):
            if name in kwargs and isinstance(kwargs[name], int | float):
                kwargs[name] = float(kwargs[name])
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, checkpoint: str | Path) -> LatentMoEConfig:
        return cls.from_dict(read_config_json(checkpoint, "checkpoint folder"))


def read_config_json(folder: str | Path, what: str = "model folder") -> dict[str, Any]:
    """The JSON object in ``folder``'s ``config.json`` (ValueError naming the file otherwise)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {what} {str(folder)!r}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return raw
