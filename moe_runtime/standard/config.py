"""Validated configs of the standard MoE families, read from a Hugging Face ``config.json``.

``Qwen3MoeConfig`` (HF ``Qwen3MoeSparseMoeBlock``) and ``DeepseekV3MoeConfig`` (HF
``DeepseekV3MoE``; Kimi-K2 ships this architecture) hold only what one MoE layer needs, under
one interface (``StandardMoEConfig``). Fields absent from the file take the Hugging Face
config class's defaults, which is also what vLLM reads (it loads the HF config class). Two
DeepSeek fields are not HF fields, and there vLLM's default would silently change the math, so
they must be written: ``scoring_func`` (vLLM reads an absent one as ``softmax``) and
``topk_method`` (vLLM adds the correction bias only for ``noaux_tc``). No torch here.

Legend: H hidden_size, I moe_intermediate_size, E routed experts, K experts per token,
G expert groups, Is = I * shared experts.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from ..config import read_config_json
from ..units import check_dtype

QWEN3_MOE, DEEPSEEK_V3 = "qwen3_moe", "deepseek_v3"
# How config.json names each family: its architectures, then its model_type.
ARCHITECTURES = {"Qwen3MoeForCausalLM": QWEN3_MOE, "DeepseekV3ForCausalLM": DEEPSEEK_V3}
MODEL_TYPES = {"qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3, "kimi_k2": DEEPSEEK_V3}


@dataclass(frozen=True)
class RouterSpec:
    """What ``router.route`` reads (its ``RouterConfig``), in the latent layer's names."""

    num_experts_per_token: int
    moe_router_activation_func: str  # "softmax" | "sigmoid"
    moe_renormalize: bool
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1

    @property
    def grouped(self) -> bool:
        return self.num_expert_group > 1


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"config field {name} must be {kind}, got {value!r}")


@dataclass(frozen=True)
class StandardMoEConfig:
    """Fields both families share. ``num_experts`` is Qwen3's ``num_experts`` or DeepSeek's
    ``n_routed_experts``; ``dtype`` is the file's ``dtype`` (``torch_dtype`` before
    transformers 5), None when absent."""

    family: ClassVar[str]
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int
    norm_topk_prob: bool
    hidden_act: str = "silu"
    dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                     "num_hidden_layers"):
            _check_int(name, getattr(self, name), 1)
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"config field norm_topk_prob must be true or false, got "
                             f"{self.norm_topk_prob!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported: these MoE layers run "
                             "SiLU experts")
        if self.dtype is not None:
            check_dtype(self.dtype)
        E, K = self.num_experts, self.num_experts_per_tok
        if K > E:
            raise ValueError(f"num_experts_per_tok ({K}) > number of routed experts ({E})")

    def _check_has_moe_layer(self, rule: str) -> None:
        if not self.moe_layers:
            raise ValueError(f"no MoE layer among num_hidden_layers={self.num_hidden_layers}: {rule}")

    # -- what the layer reads -------------------------------------------------------------
    @property
    def num_shared_experts(self) -> int:
        return 0

    @property
    def shared_intermediate_size(self) -> int:
        """Is: the one MLP the shared experts make together (0: none)."""
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def has_correction_bias(self) -> bool:
        """Whether the router reads ``gate.e_score_correction_bias``."""
        return False

    @property
    def router(self) -> RouterSpec:
        raise NotImplementedError

    def is_moe_layer(self, layer: int) -> bool:
        raise NotImplementedError

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def check_moe_layer(self, layer: int) -> None:
        """Raise ValueError naming why ``layer`` is not a MoE layer of this model."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.num_hidden_layers:
            raise ValueError(f"unknown layer {layer}: the model has layers 0..{self.num_hidden_layers - 1}")
        if not self.is_moe_layer(layer):
            raise ValueError(f"layer {layer} is not a MoE layer (a dense layer of this {self.family} model); "
                             f"MoE layers: {self.moe_layers}")

    # -- reading --------------------------------------------------------------------------
    # field -> the config.json names it is read from, first found wins (default: its own name);
    # dtype is read from "dtype" (transformers 5) or "torch_dtype"
    JSON_NAMES: ClassVar[dict[str, tuple[str, ...]]] = {"dtype": ("dtype", "torch_dtype")}
    # fields where a null means something (elsewhere a null is an absent field: the default)
    NULLABLE: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StandardMoEConfig:
        """Build from a config.json dict (text fields may sit under ``text_config``)."""
        text = dict(raw)
        if isinstance(raw.get("text_config"), dict):
            text.update(raw["text_config"])
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            names = cls.JSON_NAMES.get(f.name, (f.name,))
            value = next((text[n] for n in names if text.get(n) is not None), None)
            if value is not None or (f.name in cls.NULLABLE and any(n in text for n in names)):
                kwargs[f.name] = value
            elif f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"config.json of a {cls.family} model lacks required field "
                                 f"{' or '.join(names)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class Qwen3MoeConfig(StandardMoEConfig):
    """Qwen3-MoE: softmax over all experts, top-k, renormalised when ``norm_topk_prob`` (HF
    default false), no shared expert. Layer ``i`` is MoE iff ``i not in mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0``."""

    family: ClassVar[str] = QWEN3_MOE
    # transformers 5 writes num_local_experts (its attribute map), the Qwen3 releases num_experts
    JSON_NAMES: ClassVar[dict[str, tuple[str, ...]]] = {**StandardMoEConfig.JSON_NAMES,
                                                        "num_experts": ("num_experts", "num_local_experts")}
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.mlp_only_layers, list):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        super().__post_init__()
        _check_int("decoder_sparse_step", self.decoder_sparse_step, 1)
        L = self.num_hidden_layers
        if not isinstance(self.mlp_only_layers, tuple) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < L for i in self.mlp_only_layers
        ):
            raise ValueError(f"mlp_only_layers must list layer indices in 0..{L - 1}, got "
                             f"{self.mlp_only_layers!r}")
        self._check_has_moe_layer(
            f"layer i is MoE iff i not in mlp_only_layers={list(self.mlp_only_layers)} and "
            f"(i + 1) % decoder_sparse_step ({self.decoder_sparse_step}) == 0"
        )

    @property
    def router(self) -> RouterSpec:
        return RouterSpec(self.num_experts_per_tok, "softmax", self.norm_topk_prob)

    def is_moe_layer(self, layer: int) -> bool:
        return (0 <= layer < self.num_hidden_layers and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True)
class DeepseekV3MoeConfig(StandardMoEConfig):
    """DeepSeek-V3 / Kimi-K2: sigmoid scores; experts chosen by ``score + e_score_correction_bias``
    inside the ``topk_group`` best of ``n_group`` groups (a group's score: the sum of its top-2
    biased scores); weights are the unbiased scores, renormalised when ``norm_topk_prob``, times
    ``routed_scaling_factor``; ``n_shared_experts`` shared experts as one MLP of width Is.

    Layer ``i`` is MoE iff ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0`` (vLLM's
    rule; HF's DeepseekV3 reads no ``moe_layer_freq``, the same at the usual 1)."""

    family: ClassVar[str] = DEEPSEEK_V3
    JSON_NAMES: ClassVar[dict[str, tuple[str, ...]]] = {**StandardMoEConfig.JSON_NAMES,
                                                        "num_experts": ("n_routed_experts",)}
    NULLABLE: ClassVar[tuple[str, ...]] = ("n_shared_experts",)  # null: no shared experts (vLLM)
    norm_topk_prob: bool = True
    n_shared_experts: int | None = 1
    routed_scaling_factor: float = 2.5
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    scoring_func: str | None = None
    topk_method: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_shared_experts is not None:
            _check_int("n_shared_experts", self.n_shared_experts, 0)
        for name in ("n_group", "topk_group", "moe_layer_freq"):
            _check_int(name, getattr(self, name), 1)
        _check_int("first_k_dense_replace", self.first_k_dense_replace, 0)
        scale = self.routed_scaling_factor
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not (math.isfinite(scale)
                                                                                 and scale > 0):
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {scale!r}")
        for name, want, why in (
            ("scoring_func", "sigmoid", "vLLM reads an absent scoring_func as 'softmax'"),
            ("topk_method", "noaux_tc", "vLLM applies e_score_correction_bias only under 'noaux_tc'"),
        ):
            if getattr(self, name) != want:
                raise ValueError(f"{name} is {getattr(self, name)!r}: DeepSeek-V3 routing needs it written "
                                 f"as {want!r} in config.json ({why})")
        E, G, TG, K = self.num_experts, self.n_group, self.topk_group, self.num_experts_per_tok
        if E % G:
            raise ValueError(f"n_routed_experts ({E}) is not divisible by n_group ({G}): {E} % {G} = {E % G}")
        if E // G < 2:
            raise ValueError(f"n_routed_experts / n_group = {E} / {G} = {E // G} expert per group: a group's "
                             "score is the sum of its top 2 experts' scores, so each group needs at least 2")
        if TG > G:
            raise ValueError(f"topk_group ({TG}) > n_group ({G})")
        if K > TG * (E // G):
            raise ValueError(f"num_experts_per_tok ({K}) > topk_group ({TG}) * experts per group "
                             f"({E} / {G} = {E // G}) = {TG * (E // G)}")
        self._check_has_moe_layer(
            f"layer i is MoE iff i >= first_k_dense_replace ({self.first_k_dense_replace}) and "
            f"i % moe_layer_freq ({self.moe_layer_freq}) == 0"
        )

    @property
    def num_shared_experts(self) -> int:
        return self.n_shared_experts or 0

    @property
    def has_correction_bias(self) -> bool:
        return True

    @property
    def router(self) -> RouterSpec:
        return RouterSpec(self.num_experts_per_tok, "sigmoid", self.norm_topk_prob,
                          float(self.routed_scaling_factor), self.n_group, self.topk_group)

    def is_moe_layer(self, layer: int) -> bool:
        return (0 <= layer < self.num_hidden_layers and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)


FAMILIES: dict[str, type[StandardMoEConfig]] = {QWEN3_MOE: Qwen3MoeConfig, DEEPSEEK_V3: DeepseekV3MoeConfig}


def family_of(raw: dict[str, Any]) -> str:
    """The family a config.json dict describes, by ``architectures`` then ``model_type``."""
    for arch in raw.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if raw.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[raw["model_type"]]
    raise ValueError(
        f"config.json describes architectures={raw.get('architectures')!r}, model_type="
        f"{raw.get('model_type')!r}: not a standard MoE family here (architectures "
        f"{sorted(ARCHITECTURES)}, model types {sorted(MODEL_TYPES)})"
    )


def config_from_dict(raw: dict[str, Any]) -> StandardMoEConfig:
    return FAMILIES[family_of(raw)].from_dict(raw)


def load_standard_config(folder: str | Path) -> StandardMoEConfig:
    """The MoE config of the model in ``folder`` (its ``config.json``)."""
    return config_from_dict(read_config_json(folder))
