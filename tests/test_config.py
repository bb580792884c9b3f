"""LatentMoEConfig: where fields are read from, which layers are MoE, and every illegal case."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from moe_runtime.config import LatentMoEConfig
from moe_runtime.synthetic import PRESETS

BASE = {
    "hidden_size": 128,
    "routed_expert_hidden_size": 64,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
}


def cfg(**overrides) -> LatentMoEConfig:
    return LatentMoEConfig.from_dict({**BASE, **overrides})


def raises(*fragments: str):
    """pytest.raises(ValueError) whose message must contain every fragment, in order."""
    return pytest.raises(ValueError, match=".*".join(re.escape(f) for f in fragments))


# --- where the fields come from ---------------------------------------------------------------


def test_top_level_fields() -> None:
    c = cfg(num_shared_experts=2, moe_router_activation_func="softmax")
    assert (c.hidden_size, c.routed_expert_hidden_size, c.num_experts) == (128, 64, 8)
    assert c.num_shared_experts == 2 and c.shared_intermediate_size == 128
    assert c.moe_router_activation_func == "softmax"


def test_text_config_is_read_and_wins_over_top_level() -> None:
    raw = {
        "model_type": "kimi_k3",
        "hidden_size": 999,  # a vision/top-level value that the text config overrides
        "vision_config": {"hidden_size": 1152},
        "text_config": {**BASE, "routed_scaling_factor": 2, "rms_norm_eps": 1e-6},
    }
    c = LatentMoEConfig.from_dict(raw)
    assert c.hidden_size == 128
    # ints from JSON become floats for the float fields
    assert c.routed_scaling_factor == 2.0 and isinstance(c.routed_scaling_factor, float)
    assert c.rms_norm_eps == 1e-6


def test_top_level_fields_fill_in_what_text_config_lacks() -> None:
    text = dict(BASE)
    del text["num_hidden_layers"]
    c = LatentMoEConfig.from_dict({"num_hidden_layers": 5, "text_config": text})
    assert c.num_hidden_layers == 5


def test_defaults_and_unknown_keys_ignored() -> None:
    c = LatentMoEConfig.from_dict({**BASE, "architectures": ["X"], "vocab_size": 100,
                                   "activation_situ_beta": None, "num_shared_experts": None})
    assert c.num_shared_experts == 0 and c.routed_scaling_factor == 1.0
    assert c.moe_router_activation_func == "sigmoid" and c.moe_renormalize
    assert not c.uses_situ and c.hidden_act == "silu"
    assert LatentMoEConfig.from_dict(c.to_dict()) == c


def test_every_preset_validates_with_real_k3_dims() -> None:
    for raw in PRESETS.values():
        LatentMoEConfig.from_dict(raw)
    k3 = LatentMoEConfig.from_dict(PRESETS["kimi-k3"])
    assert (k3.hidden_size, k3.routed_expert_hidden_size, k3.num_experts, k3.num_experts_per_token,
            k3.moe_intermediate_size, k3.shared_intermediate_size) == (7168, 3584, 896, 16, 3072, 6144)
    assert k3.moe_layers == list(range(1, 93))  # 93 layers: layer 0 dense, 92 MoE
    assert k3.uses_situ and k3.activation_situ_beta == 4.0 and k3.activation_situ_linear_beta == 25.0


def test_from_pretrained_reads_generated_checkpoint(tiny_ckpt: Path) -> None:
    c = LatentMoEConfig.from_pretrained(tiny_ckpt)
    assert c == LatentMoEConfig.from_dict(PRESETS["tiny"])
    assert "text_config" in json.loads((tiny_ckpt / "config.json").read_text())


# --- MoE layers -------------------------------------------------------------------------------


def test_is_moe_layer_and_moe_layers() -> None:
    c = cfg()
    assert c.moe_layers == [1, 2]
    assert [c.is_moe_layer(i) for i in (-1, 0, 1, 2, 3)] == [False, False, True, True, False]
    c = cfg(num_hidden_layers=9, first_k_dense_replace=3, moe_layer_freq=2)
    assert c.moe_layers == [4, 6, 8]
    assert not c.is_moe_layer(3) and not c.is_moe_layer(5) and c.is_moe_layer(8)
    assert cfg(first_k_dense_replace=0).moe_layers == [0, 1, 2]


def test_check_moe_layer() -> None:
    c = cfg()
    c.check_moe_layer(1)
    c.check_moe_layer(2)
    with raises("layer 0 is not a MoE layer", "first_k_dense_replace=1", "moe_layer_freq=1", "[1, 2]"):
        c.check_moe_layer(0)
    with raises("unknown layer 3", "0..2"):
        c.check_moe_layer(3)
    with raises("unknown layer -1", "0..2"):
        c.check_moe_layer(-1)
    with raises("layer must be an integer", "'1'"):
        c.check_moe_layer("1")
    with raises("layer must be an integer", "True"):
        c.check_moe_layer(True)
    c = cfg(num_hidden_layers=6, moe_layer_freq=2)
    with raises("layer 3 is not a MoE layer", "moe_layer_freq=2", "[2, 4]"):
        c.check_moe_layer(3)


# --- illegal configs --------------------------------------------------------------------------


def test_missing_required_fields_are_named() -> None:
    raw = dict(BASE)
    del raw["hidden_size"]
    del raw["moe_intermediate_size"]
    with raises("lacks required field(s)", "hidden_size", "moe_intermediate_size"):
        LatentMoEConfig.from_dict(raw)
    with raises("lacks required field(s)", "num_experts_per_token"):
        LatentMoEConfig.from_dict({"text_config": {k: v for k, v in BASE.items() if k != "num_experts_per_token"}})


@pytest.mark.parametrize(
    "field",
    ["hidden_size", "routed_expert_hidden_size", "num_experts", "num_experts_per_token",
     "moe_intermediate_size", "num_hidden_layers", "moe_layer_freq", "num_expert_group", "topk_group"],
)
@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_sizes_must_be_positive_integers(field: str, bad) -> None:
    with raises(f"{field} must be a positive integer, got {bad!r}"):
        cfg(**{field: bad})


@pytest.mark.parametrize("field", ["num_shared_experts", "first_k_dense_replace"])
def test_counts_must_be_non_negative_integers(field: str) -> None:
    with raises(f"{field} must be an integer >= 0, got -1"):
        cfg(**{field: -1})


def test_k_greater_than_e() -> None:
    with raises("num_experts_per_token (9) > num_experts (8)"):
        cfg(num_experts_per_token=9)


def test_unknown_router_function() -> None:
    with raises("moe_router_activation_func 'relu'", "sigmoid", "softmax"):
        cfg(moe_router_activation_func="relu")


def test_unknown_activation() -> None:
    with raises("hidden_act 'gelu'", "situ", "silu"):
        cfg(hidden_act="gelu")


def test_situ_needs_beta() -> None:
    with raises("hidden_act 'situ' needs activation_situ_beta"):
        cfg(hidden_act="situ")
    c = cfg(hidden_act="situ", activation_situ_beta=4.0)  # beta_lin is optional
    assert c.uses_situ and c.activation_situ_linear_beta is None


@pytest.mark.parametrize("field", ["activation_situ_beta", "activation_situ_linear_beta"])
def test_betas_must_be_positive(field: str) -> None:
    with raises(f"{field} must be > 0 when set, got 0.0"):
        cfg(**{"hidden_act": "situ", "activation_situ_beta": 4.0, field: 0.0})


def test_eps_scaling_and_dtype() -> None:
    with raises("rms_norm_eps must be > 0, got 0.0"):
        cfg(rms_norm_eps=0.0)
    with raises("routed_scaling_factor must be > 0, got -1.0"):
        cfg(routed_scaling_factor=-1)
    with raises("torch_dtype 'float8'", "float32", "bfloat16"):
        cfg(torch_dtype="float8")


def test_groups_must_divide_experts() -> None:
    with raises("num_experts (8) is not divisible by num_expert_group (3): 8 % 3 = 2"):
        cfg(use_grouped_topk=True, num_expert_group=3, topk_group=1)


def test_topk_group_at_most_groups() -> None:
    with raises("topk_group (5) > num_expert_group (4)"):
        cfg(use_grouped_topk=True, num_expert_group=4, topk_group=5)


def test_k_at_most_experts_in_kept_groups() -> None:
    # 8 experts in 4 groups = 2 per group; keeping 1 group leaves 2 candidates for k = 3.
    with raises("num_experts_per_token (3) > topk_group (1) * experts per group (2) = 2"):
        cfg(use_grouped_topk=True, num_expert_group=4, topk_group=1, num_experts_per_token=3)
    c = cfg(use_grouped_topk=True, num_expert_group=4, topk_group=2, num_experts_per_token=4)
    assert c.grouped


def test_group_fields_ignored_when_grouping_is_off() -> None:
    # DESIGN §2: grouped top-k is honoured when groups > 1 and use_grouped_topk is set.
    assert not cfg(use_grouped_topk=False, num_expert_group=3, topk_group=1).grouped
    assert not cfg(use_grouped_topk=True, num_expert_group=1, topk_group=1).grouped


def test_no_moe_layer_at_all() -> None:
    with raises("no MoE layer", "num_hidden_layers=3", "first_k_dense_replace=3", "moe_layer_freq=1"):
        cfg(first_k_dense_replace=3)


def test_config_is_frozen() -> None:
    c = cfg()
    with pytest.raises(AttributeError):
        c.hidden_size = 3  # type: ignore[misc]
    assert asdict(c)["hidden_size"] == 128


# --- from_pretrained failures -----------------------------------------------------------------


def test_from_pretrained_missing_config(tmp_path: Path) -> None:
    with raises("no config.json in checkpoint folder", str(tmp_path)):
        LatentMoEConfig.from_pretrained(tmp_path)


def test_from_pretrained_malformed_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 128,')
    with raises("config.json is not valid JSON"):
        LatentMoEConfig.from_pretrained(tmp_path)


def test_from_pretrained_json_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2, 3]")
    with raises("config.json must hold a JSON object"):
        LatentMoEConfig.from_pretrained(tmp_path)


def test_from_pretrained_invalid_values(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {**BASE, "num_experts_per_token": 12}}))
    with raises("num_experts_per_token (12) > num_experts (8)"):
        LatentMoEConfig.from_pretrained(tmp_path)


# --- values of the wrong type ----


@pytest.mark.parametrize("field", ["rms_norm_eps", "routed_scaling_factor", "activation_situ_beta"])
def test_non_numeric_float_fields(field: str) -> None:
    with raises(field):
        cfg(**{field: "2"})


@pytest.mark.parametrize("field", ["moe_renormalize", "latent_moe_use_norm", "use_grouped_topk"])
def test_non_boolean_flags(field: str) -> None:
    with raises(field):
        cfg(**{field: "false"})


@pytest.mark.parametrize("field", ["rms_norm_eps", "routed_scaling_factor", "activation_situ_beta"])
def test_non_finite_float_fields(field: str) -> None:
    with raises(field):
        cfg(**{field: float("inf")})
