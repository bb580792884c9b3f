"""The standard MoE layers (``moe_runtime.standard``: Qwen3-MoE, DeepSeek-V3) against an
independent float64 loop over tokens and slots, their TP shards against the single device, and
their errors.

The oracle reads the model folder the test wrote through the ``safetensors`` package (not our
reader) and the config through the raw ``config.json`` dict (not our config types), and
re-derives each step from the families' definitions: it calls no ``route``, experts backend or
activation of the package. Both sides see bit-identical weights and inputs.

Legend: T tokens, H hidden, E experts, K experts per token, I expert intermediate, G groups.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_runtime.checkpoint import CheckpointReader
from moe_runtime.experts import get_backend
from moe_runtime.router import route
from moe_runtime.standard.config import (
    DeepseekV3MoeConfig,
    Qwen3MoeConfig,
    config_from_dict,
    load_standard_config,
)
from moe_runtime.standard.layer import (
    StandardMoERunner,
    build_standard_runners,
    standard_moe_forward,
    standard_moe_partial,
)
from moe_runtime.standard.synthetic import standard_preset, write_standard_checkpoint
from moe_runtime.standard.weights import load_standard_layer
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group
from moe_runtime.tp.sharding import TPShard

# ------------------------------------------------------------------------------------------
# Tolerances (the arithmetic of tests/test_layer.py, for a layer with fewer stages).
#
# Selection. The layer routes in fp32 on x and the router weights cast to fp32 (exact, also from
# bf16), so it differs from the oracle only by fp32 rounding of z = x·Wg^T: |dz| <= H * u32 *
# sum|x_i g_i| with H = 64, u32 = 2^-24 and sum|x g| ~ 0.8 sqrt(H) ~ 6.4, i.e. <= 2.5e-5; through
# softmax or sigmoid (slope <= 1/4) and the bias add a selection score moves by < 1e-5. A token
# whose K-th and (K+1)-th selection scores (or topk_group-th and next group scores) are closer
# than MARGIN = 1e-4 may pick another expert and is left out (at most 2 % of the tokens, or one).
MARGIN = 1e-4
MAX_SKIPPED_FRACTION = 0.02
# fp32. Each output element is at most 3 chained reductions (gate/up over H = 64, down over
# I = 32 or Is = 64, the combine over K <= 4 slots plus the shared output): each contributes
# <= n u32 sum|a b| ~ 64 * 6e-8 * 8 ~ 3e-5 of the output scale in the worst case, ~sqrt(n) u32 ~
# 5e-7 typically (measured worst over the cases below: 3.3e-6 of rms, 56 u32). rtol = atol / rms
# = 1e-4: 30x the measured worst, while a wrong weight, a missed slot or a wrong routing weight
# is O(1).
FP32_TOL = 1e-4
# bf16 (unit roundoff u = 2^-9). The layer rounds to bf16 at 4 points on the routed path (each
# expert's gate|up GEMM output, the activation, the down GEMM output) and 4 on the shared one,
# then once at the end; the routed combine is fp32. Independent roundings add in quadrature
# through the GEMMs, ~2u/sqrt(3) ~ 1.2u of rms(out) per element, but an element's error scales
# with its intermediates, which exceed rms(out) where routing weights cancel or concentrate: the
# worst element over 511 x 64 measured 21u of rms (qwen T511; DeepSeek 14u). atol = 32u * rms(ref)
# (6 % of rms) plus rtol = 4u for the final rounding: 1.5x the measured worst, while a bug (a
# wrong weight, a missed slot, a wrong scale) is O(rms).
BF16_U = 2.0**-9
BF16_ATOL_IN_U = 32
BF16_RTOL_IN_U = 4


@dataclass
class Oracle:
    out_TH: torch.Tensor  # float64
    margin_T: torch.Tensor  # float64: how far each token's selection is from a tie
    ids: list[list[int]]


def _ranked(values: list[float], candidates: list[int]) -> list[int]:
    return sorted(candidates, key=lambda i: (-values[i], i))


def _silu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    g, u = gate @ x, up @ x
    return down @ (g / (1.0 + torch.exp(-g)) * u)


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder, in float64, through the safetensors package."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update({k: v.to(torch.float64) for k, v in load_file(path).items()})
    return tensors


def oracle_forward(x_TH: torch.Tensor, tensors: dict[str, torch.Tensor], raw: dict, layer: int,
                   router_logits_TE: torch.Tensor | None = None) -> Oracle:
    """One MoE layer, token by token, in float64, from HF tensor names and config.json fields."""
    p = f"model.layers.{layer}.mlp."
    deepseek = raw["model_type"] == "deepseek_v3"
    E = raw["n_routed_experts"] if deepseek else raw["num_experts"]
    K, norm = raw["num_experts_per_tok"], raw["norm_topk_prob"]
    gate = tensors[p + "gate.weight"]
    out = torch.zeros(x_TH.shape[0], x_TH.shape[1], dtype=torch.float64)
    margins = torch.zeros(x_TH.shape[0], dtype=torch.float64)
    all_ids = []
    for t, x in enumerate(x_TH.to(torch.float64)):
        z = router_logits_TE[t].to(torch.float64) if router_logits_TE is not None else gate @ x
        margin = math.inf
        if deepseek:
            s = 1.0 / (1.0 + torch.exp(-z))
            sel = (s + tensors[p + "gate.e_score_correction_bias"]).tolist()
            G, TG = raw["n_group"], raw["topk_group"]
            n = E // G
            group_score = [sum(sorted(sel[g * n:(g + 1) * n], reverse=True)[:2]) for g in range(G)]
            groups = _ranked(group_score, list(range(G)))
            if TG < G:
                margin = group_score[groups[TG - 1]] - group_score[groups[TG]]
            candidates = [g * n + j for g in groups[:TG] for j in range(n)]
        else:
            e = torch.exp(z - z.max())
            s = e / e.sum()
            sel, candidates = s.tolist(), list(range(E))
        order = _ranked(sel, candidates)
        ids = order[:K]
        if K < len(order):
            margin = min(margin, sel[order[K - 1]] - sel[order[K]])
        margins[t] = margin
        all_ids.append(sorted(ids))
        weights = s[ids]
        if norm:
            weights = weights / weights.sum()
        if deepseek:
            weights = weights * raw["routed_scaling_factor"]
        y = torch.zeros_like(x)
        for slot, expert in enumerate(ids):
            q = f"{p}experts.{expert}."
            y += weights[slot] * _silu_mlp(x, tensors[q + "gate_proj.weight"], tensors[q + "up_proj.weight"],
                                           tensors[q + "down_proj.weight"])
        if deepseek and raw["n_shared_experts"]:
            q = p + "shared_experts."
            y += _silu_mlp(x, tensors[q + "gate_proj.weight"], tensors[q + "up_proj.weight"],
                           tensors[q + "down_proj.weight"])
        out[t] = y
    return Oracle(out, margins, all_ids)


def compare(out_TH: torch.Tensor, ref: Oracle, dtype: torch.dtype) -> float:
    """Assert within tolerance on the tokens away from routing ties; return max|err| / rms(ref)."""
    keep = ref.margin_T >= MARGIN
    skipped = int((~keep).sum())
    assert skipped <= max(1.0, MAX_SKIPPED_FRACTION * len(keep)), f"{skipped} tokens near a routing tie"
    if not keep.any():
        pytest.skip("the only token is within MARGIN of a routing tie")
    expected, actual = ref.out_TH[keep], out_TH[keep].to(torch.float64)
    rms = expected.pow(2).mean().sqrt().item()
    if dtype == torch.float32:
        rtol, atol = FP32_TOL, FP32_TOL * rms
    else:
        rtol, atol = BF16_RTOL_IN_U * BF16_U, BF16_ATOL_IN_U * BF16_U * rms
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    return (actual - expected).abs().max().item() / rms


# ------------------------------------------------------------------------------------------
# Model folders

QWEN, DSV3 = "qwen3_moe", "deepseek_v3"
F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    """``folder(family, dtype, single_file=False, **config overrides)`` -> a written model
    folder (cached per arguments)."""
    cache: dict[tuple, Path] = {}

    def make(family: str, dtype: torch.dtype = F32, single_file: bool = False, **overrides) -> Path:
        key = (family, dtype, single_file, tuple(sorted(overrides.items())))
        if key not in cache:
            raw = standard_preset(family, dtype=str(dtype).removeprefix("torch."), **overrides)
            cache[key] = write_standard_checkpoint(tmp_path_factory.mktemp(family), raw, seed=3,
                                                   single_file=single_file)
        return cache[key]

    return make


def raw_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def inputs(T: int, H: int, dtype: torch.dtype, E: int | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(1000 * seed + T)
    x = torch.randn(T, H, generator=gen).to(dtype)
    return x, (None if E is None else torch.randn(T, E, generator=gen) * 2.0)


# (name, family, T, dtype, single file, config overrides, precomputed logits)
UNGROUPED = dict(n_group=1, topk_group=1)
CASES = [
    *[(f"qwen-T{T}", QWEN, T, dt, False, {}, False) for T in (1, 33, 511) for dt in (F32, BF16)],
    ("qwen-no-renorm", QWEN, 511, F32, True, dict(norm_topk_prob=False), False),
    ("qwen-no-renorm", QWEN, 33, BF16, False, dict(norm_topk_prob=False), False),
    ("qwen-k1-logits", QWEN, 33, F32, False, dict(num_experts_per_tok=1), True),
    *[(f"dsv3-T{T}", DSV3, T, dt, False, {}, False) for T in (1, 33, 511) for dt in (F32, BF16)],
    ("dsv3-single-file", DSV3, 33, F32, True, {}, False),
    ("dsv3-ungrouped", DSV3, 511, F32, False, UNGROUPED, False),
    ("dsv3-one-group-of-4", DSV3, 511, F32, False, dict(topk_group=1), False),
    ("dsv3-no-renorm-no-shared", DSV3, 511, F32, False,
     dict(norm_topk_prob=False, n_shared_experts=0, routed_scaling_factor=1.0), False),
    ("dsv3-no-renorm-no-shared", DSV3, 33, BF16, False,
     dict(norm_topk_prob=False, n_shared_experts=None, routed_scaling_factor=1.0), False),
    ("dsv3-logits", DSV3, 33, BF16, False, {}, True),
]


def _case_id(case) -> str:
    name, _, T, dtype, *_ = case
    return f"{name.removesuffix(f'-T{T}')}-T{T}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_forward_matches_float64_oracle(folder, case) -> None:
    _, family, T, dtype, single_file, overrides, with_logits = case
    path = folder(family, dtype, single_file, **overrides)
    cfg = load_standard_config(path)
    layer = cfg.moe_layers[-1]
    w = load_standard_layer(path, cfg, layer, dtype)
    x, logits = inputs(T, cfg.hidden_size, dtype, cfg.num_experts if with_logits else None)
    out = standard_moe_forward(x, w, cfg, "torch", logits)
    assert out.dtype == dtype and out.shape == (T, cfg.hidden_size)
    compare(out, oracle_forward(x, read_folder(path), raw_config(path), layer, logits), dtype)


@pytest.mark.parametrize("family", [QWEN, DSV3])
def test_the_chosen_experts_are_the_oracles(folder, family: str) -> None:
    path = folder(family)
    cfg = load_standard_config(path)
    w = load_standard_layer(path, cfg, cfg.moe_layers[0])
    x, _ = inputs(511, cfg.hidden_size, F32)
    ids_TK, _ = route(x, w.gate_EH, w.bias_E, cfg.router)
    ref = oracle_forward(x, read_folder(path), raw_config(path), cfg.moe_layers[0])
    keep = (ref.margin_T >= MARGIN).tolist()
    ours = [sorted(row) for row in ids_TK.tolist()]
    assert [o for o, k in zip(ours, keep, strict=True) if k] == [r for r, k in zip(ref.ids, keep, strict=True) if k]


def test_bias_and_groups_change_the_choice_and_the_layer_follows(folder) -> None:
    """The correction bias and the group restriction each change some tokens' experts on these
    folders, and the layer matches the oracle with and without them: the cases above exercise
    both rules rather than passing by coincidence."""
    path = folder(DSV3)
    raw, tensors = raw_config(path), read_folder(path)
    layer = 1
    x, _ = inputs(511, raw["hidden_size"], F32)
    grouped = oracle_forward(x, tensors, raw, layer)
    unbiased_tensors = {**tensors, f"model.layers.{layer}.mlp.gate.e_score_correction_bias":
                        torch.zeros(raw["n_routed_experts"], dtype=torch.float64)}
    unbiased = oracle_forward(x, unbiased_tensors, raw, layer)
    ungrouped = oracle_forward(x, tensors, {**raw, **UNGROUPED}, layer)
    assert sum(a != b for a, b in zip(grouped.ids, unbiased.ids, strict=True)) > 50
    assert sum(a != b for a, b in zip(grouped.ids, ungrouped.ids, strict=True)) > 50
    cfg = load_standard_config(path)
    w = load_standard_layer(path, cfg, layer)
    compare(standard_moe_forward(x, w, cfg), grouped, F32)
    w.bias_E.zero_()
    compare(standard_moe_forward(x, w, cfg), unbiased, F32)


# ------------------------------------------------------------------------------------------
# Which layers are MoE


def test_qwen3_moe_layers_follow_sparse_step_and_mlp_only_layers() -> None:
    cfg = config_from_dict(standard_preset(QWEN, num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert isinstance(cfg, Qwen3MoeConfig) and cfg.moe_layers == [1, 5, 7]  # (i + 1) % 2 == 0, minus 3


def test_deepseek_moe_layers_follow_first_k_dense_and_freq() -> None:
    cfg = config_from_dict(standard_preset(DSV3, num_hidden_layers=8, first_k_dense_replace=3, moe_layer_freq=2))
    assert isinstance(cfg, DeepseekV3MoeConfig) and cfg.moe_layers == [4, 6]


def test_kimi_k2_and_transformers_4_names_read_as_deepseek_v3() -> None:
    raw = standard_preset(DSV3)
    del raw["architectures"], raw["dtype"]
    cfg = config_from_dict({**raw, "model_type": "kimi_k2", "torch_dtype": "bfloat16"})
    assert isinstance(cfg, DeepseekV3MoeConfig) and cfg.dtype == "bfloat16"


def test_transformers_5_expert_count_name_reads_as_qwen3_num_experts() -> None:
    raw = standard_preset(QWEN)
    cfg = config_from_dict({**{k: v for k, v in raw.items() if k != "num_experts"}, "num_local_experts": 8})
    assert cfg == config_from_dict(raw)


def test_hf_defaults_fill_absent_fields() -> None:
    raw = {k: v for k, v in standard_preset(DSV3).items()
           if k not in ("norm_topk_prob", "routed_scaling_factor", "n_shared_experts")}
    cfg = config_from_dict({**raw, "n_group": 8, "topk_group": 4, "n_routed_experts": 16})
    assert (cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.num_shared_experts) == (True, 2.5, 1)
    qwen = config_from_dict({k: v for k, v in standard_preset(QWEN).items() if k != "norm_topk_prob"})
    assert qwen.norm_topk_prob is False and qwen.router.moe_renormalize is False


# ------------------------------------------------------------------------------------------
# Tensor parallelism: intermediate-dimension shards, partial sums, one all-reduce


@pytest.mark.parametrize("family", [QWEN, DSV3])
@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_tp_shards_sum_to_the_single_device_output(folder, family: str, P: int, dtype: torch.dtype) -> None:
    """Each rank's partial (its I / P rows of every expert, its Is / P of the shared MLP, the
    router replicated) summed over ranks, as the runner's all-reduce sums them, equals the single
    device's output; a rank reads only its slices. In fp32 the sum differs from one device only
    by the order of fp32 additions (tolerance 1e-5 of rms). In bf16 each rank rounds its own
    partial expert outputs (sums over I / P, which may cancel across ranks) and its partial sum
    (the wire dtype) to bf16, so the sharded result is checked against the oracle with the bf16
    tolerance above, as the single device is."""
    path = folder(family, dtype)
    cfg = load_standard_config(path)
    layer = cfg.moe_layers[-1]
    x, _ = inputs(33, cfg.hidden_size, dtype)
    be = get_backend("torch")
    full = standard_moe_forward(x, load_standard_layer(path, cfg, layer, dtype), cfg)
    total = torch.zeros_like(full)
    for rank in range(P):
        reader = CheckpointReader(path)
        w = load_standard_layer(reader, cfg, layer, dtype, TPShard(rank, P))
        I_local = cfg.moe_intermediate_size // P
        assert w.experts.shapes() == {"w13": (cfg.num_experts, 2 * I_local, cfg.hidden_size),
                                      "w2": (cfg.num_experts, cfg.hidden_size, I_local)}
        assert (0 if w.shared_gate_SH is None else w.shared_gate_SH.shape[0]) == cfg.shared_intermediate_size // P
        whole = CheckpointReader(path)
        load_standard_layer(whole, cfg, layer, dtype)
        replicated = (w.gate_EH.numel() + w.bias_E.numel() * cfg.has_correction_bias) * (4 if dtype == F32 else 2)
        if dtype == F32:  # (bf16 files keep the router in bf16 and the bias in fp32)
            assert reader.bytes_read == replicated + (whole.bytes_read - replicated) // P
        total += standard_moe_partial(x, w, cfg, be).to(dtype)
    if dtype == F32:
        rms = full.double().pow(2).mean().sqrt().item()
        torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5 * rms)
    compare(total, oracle_forward(x, read_folder(path), raw_config(path), layer), dtype)


def _runner_rank(comm: Collectives, path: str, family: str) -> dict:
    cfg = load_standard_config(path)
    runners = build_standard_runners(path, cfg, cfg.moe_layers, comm, dtype=F32)
    comm.loaded()
    x, _ = inputs(33, cfg.hidden_size, F32)
    outs = {layer: runner(x) for layer, runner in runners.items()}
    return {"outs": outs, "all_reduces": comm.counts["all_reduce"]}


@pytest.mark.parametrize("family", [QWEN, DSV3])
def test_runner_on_a_gloo_group_all_reduces_once_per_forward(folder, family: str) -> None:
    path = folder(family)
    cfg = load_standard_config(path)
    results = run_local_group(2, _runner_rank, str(path), family, timeout_s=180.0)
    x, _ = inputs(33, cfg.hidden_size, F32)
    tensors, raw = read_folder(path), raw_config(path)
    for res in results:
        assert res["all_reduces"] == len(cfg.moe_layers)
        for layer, out in res["outs"].items():
            compare(out, oracle_forward(x, tensors, raw, layer), F32)
    for layer in cfg.moe_layers:
        assert torch.equal(results[0]["outs"][layer], results[1]["outs"][layer])


def test_tp_1_runner_is_the_single_device_forward(folder) -> None:
    path = folder(DSV3)
    cfg = load_standard_config(path)
    (runner,) = build_standard_runners(path, cfg, cfg.moe_layers[:1], Collectives(), dtype=F32).values()
    x, _ = inputs(33, cfg.hidden_size, F32)
    assert torch.equal(runner(x), standard_moe_forward(x, runner.w, cfg))
    assert runner.comm.counts["all_reduce"] == 0


# ------------------------------------------------------------------------------------------
# Errors


def raises(*fragments: str):
    return pytest.raises(ValueError, match=".*".join(re.escape(f) for f in fragments))


CONFIG_ERRORS = [
    (QWEN, dict(num_experts_per_tok=9), "num_experts_per_tok (9) > number of routed experts (8)"),
    (QWEN, dict(mlp_only_layers=[0, 1, 2, 3]), "no MoE layer among num_hidden_layers=4",
     ),
    (QWEN, dict(decoder_sparse_step=5), "(i + 1) % decoder_sparse_step (5) == 0"),
    (QWEN, dict(mlp_only_layers=[7]), "mlp_only_layers must list layer indices in 0..3, got (7,)"),
    (QWEN, dict(decoder_sparse_step=0), "decoder_sparse_step must be a positive integer, got 0"),
    (QWEN, dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (QWEN, dict(dtype="float8"), "unknown dtype 'float8'"),
    (QWEN, dict(norm_topk_prob="yes"), "norm_topk_prob must be true or false"),
    (DSV3, dict(n_routed_experts=18), "n_routed_experts (18) is not divisible by n_group (4): 18 % 4 = 2"),
    (DSV3, dict(n_group=16), "n_routed_experts / n_group = 16 / 16 = 1 expert per group"),
    (DSV3, dict(n_group=2, topk_group=3), "topk_group (3) > n_group (2)"),
    (DSV3, dict(topk_group=1, num_experts_per_tok=5),
     "num_experts_per_tok (5) > topk_group (1) * experts per group (16 / 4 = 4) = 4"),
    (DSV3, dict(first_k_dense_replace=3), "i >= first_k_dense_replace (3) and i % moe_layer_freq (1) == 0"),
    (DSV3, dict(scoring_func="softmax"), "scoring_func is 'softmax': DeepSeek-V3 routing needs it written as 'sigmoid'"),
    (DSV3, dict(scoring_func=None), "scoring_func is None"),
    (DSV3, dict(topk_method="greedy"), "topk_method is 'greedy'"),
    (DSV3, dict(routed_scaling_factor=0), "routed_scaling_factor must be a finite number > 0, got 0"),
    (DSV3, dict(n_shared_experts=-1), "n_shared_experts must be an integer >= 0, got -1"),
    (DSV3, dict(n_routed_experts=None), "config.json of a deepseek_v3 model lacks required field n_routed_experts"),
    (QWEN, dict(num_experts=None), "lacks required field num_experts or num_local_experts"),
]


@pytest.mark.parametrize("family, overrides, message", CONFIG_ERRORS,
                         ids=[f"{f}-{next(iter(o))}" for f, o, _ in CONFIG_ERRORS])
def test_illegal_config_names_the_arithmetic(family: str, overrides: dict, message: str) -> None:
    raw = {k: v for k, v in standard_preset(family, **overrides).items() if v is not None}
    with raises(message):
        config_from_dict(raw)


def test_unknown_family_and_bad_folders(tmp_path: Path) -> None:
    with raises("not a standard MoE family here", "Qwen3MoeForCausalLM"):
        config_from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with raises("no config.json in model folder"):
        load_standard_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with raises("must hold a JSON object"):
        load_standard_config(tmp_path)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_tensor_is_named(folder, tmp_path: Path) -> None:
    path = _copy(folder(DSV3), tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.mlp.experts.7.up_proj.weight"]
    del index["weight_map"]["model.layers.2.mlp.gate.e_score_correction_bias"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = load_standard_config(path)
    load_standard_layer(path, cfg, 1)  # the other layer is whole
    with raises("lacks 2 tensor(s) of a deepseek_v3 MoE layer", "model.layers.2.mlp.gate.e_score_correction_bias",
                "model.layers.2.mlp.experts.7.up_proj.weight"):
        load_standard_layer(path, cfg, 2)


def test_misshaped_tensor_is_named(folder, tmp_path: Path) -> None:
    path = _copy(folder(QWEN), tmp_path / "m")
    raw = raw_config(path)
    (path / "config.json").write_text(json.dumps({**raw, "moe_intermediate_size": 16}))
    cfg = load_standard_config(path)
    with raises("tensor 'model.layers.1.mlp.experts.0.gate_proj.weight' has shape (32, 64), expected (16, 64)"):
        load_standard_layer(path, cfg, 1)


def test_layer_and_tp_errors(folder) -> None:
    path = folder(DSV3)
    cfg = load_standard_config(path)
    with raises("layer 0 is not a MoE layer (a dense layer of this deepseek_v3 model); MoE layers: [1, 2]"):
        load_standard_layer(path, cfg, 0)
    with raises("unknown layer 5: the model has layers 0..2"):
        load_standard_layer(path, cfg, 5)
    with raises("TP size 3 does not divide moe_intermediate_size 32: 32 % 3 = 2"):
        load_standard_layer(path, cfg, 1, shard=TPShard(0, 3))
    qwen = config_from_dict(standard_preset(QWEN, mlp_only_layers=[]))
    with raises("has no MoE router for layer 0", "model.layers.0.mlp.gate.weight"):
        load_standard_layer(folder(QWEN), qwen, 0)  # the folder's layer 0 is dense
    with raises("unknown dtype 'float64'"):
        load_standard_layer(path, cfg, 1, torch.float64)


def test_runner_refuses_weights_of_another_tp_size(folder) -> None:
    path = folder(QWEN)
    cfg = load_standard_config(path)
    w = load_standard_layer(path, cfg, 1, shard=TPShard(0, 2))
    with raises("experts (E, I_local, H) are (8, 16, 64), expected (8, 32, 64) for TP 1"):
        StandardMoERunner(cfg, w, Collectives())


@pytest.mark.parametrize("x, logits, message", [
    (torch.zeros(3, 32), None, "hidden_states must have shape [T, 64], got [3, 32]"),
    (torch.zeros(3, 64, dtype=BF16), None, "hidden_states dtype is torch.bfloat16, this layer runs in torch.float32"),
    (torch.zeros(0, 64), None, "hidden_states has no tokens"),
    (torch.full((3, 64), math.nan), None, "hidden_states contains NaN or Inf"),
    (torch.zeros(3, 64), torch.zeros(3, 7), "router_logits must have shape [3, 8]"),
    (torch.zeros(3, 64), torch.zeros(3, 8, dtype=torch.int64), "router_logits must be floating point"),
])
def test_bad_input_is_named(folder, x, logits, message: str) -> None:
    path = folder(QWEN)
    cfg = load_standard_config(path)
    w = load_standard_layer(path, cfg, 1)
    with raises(message):
        standard_moe_forward(x, w, cfg, "torch", logits)
    with raises(message):
        StandardMoERunner(cfg, w, Collectives())(x, logits)
