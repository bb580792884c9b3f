"""MXFP4 experts held packed (issue 8): packed forward == decode-at-load forward at TP 1 and 2 for
every tail on the medium preset, resident bytes per part by hand, per-rank bytes read, the
streamed multi-shard writer, MXFP4 shared experts, layer prefixes and ``hidden_act``.

Legend (medium preset): H 1024, D 512, E 64, K 8, I 384, Is 768 (2 shared experts), P TP size.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_fused_cpu import assert_fused_close  # tests/ is on sys.path (pytest rootdir-relative import)

from moe_runtime import mxfp4
from moe_runtime.activation import GatedActivation
from moe_runtime.checkpoint import INDEX_FILE, CheckpointReader, load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.experts import TorchExperts
from moe_runtime.layer import moe_forward
from moe_runtime.synthetic import preset_config, write_checkpoint
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group
from moe_runtime.tp.plan import TailPlan
from moe_runtime.tp.runner import LatentMoERunner, build_rank_runners
from moe_runtime.tp.sharding import TPShard
from moe_runtime.units import SAFETENSORS_DTYPES, torch_dtype
from moe_runtime.weights import ExpertWeights

LAYER = 1
TOKENS = (1, 37)
DTYPES = (torch.bfloat16, torch.float32)


@pytest.fixture(scope="module")
def medium(tmp_path_factory) -> Path:
    # random codes: fast to write, and any MXFP4 bits serve a packed-vs-decoded comparison
    return write_checkpoint(tmp_path_factory.mktemp("medium"), preset_config("medium"), use_mxfp4=True, seed=2,
                            random_codes=True)


def _decoded(w):
    """The same layer with its experts decoded at load (the pre-issue-8 loader's weights)."""
    ids = torch.arange(w.experts.num_experts)
    return dataclasses.replace(w, experts=ExpertWeights(*w.experts.decode(ids), dtype=w.experts.dtype))


def _input(T: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)


def _rank_packed_vs_decoded(comm: Collectives, ckpt: str) -> dict:
    """bf16: every legal tail x T with packed and decoded experts on this rank; fp32: the
    replicated tail (for the single-device check); plus what loading read and holds."""
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    out: dict = {}
    for dtype in DTYPES:
        for sp in (False, True) if comm.world > 1 and dtype == torch.bfloat16 else (False,):
            plan = TailPlan.single("sequence_parallel" if sp else "replicated", "test")
            packed = build_rank_runners(ckpt, cfg, [LAYER], comm, plan, dtype=dtype)[LAYER]
            decoded = LatentMoERunner(cfg, _decoded(packed.w), comm, plan, packed.shard)
            # the same packed weights through the decode path and (the CPU default) the fused one
            fused = packed.backend
            unfused = TorchExperts(packed.backend.scratch_bytes, packed="decode")
            out[(dtype, "bytes")] = (packed.load_bytes_read, packed.resident_bytes_by_part())
            for tail in packed.legal_tails if dtype == torch.bfloat16 else ("replicated",):
                for T in TOKENS:
                    x = _input(T, cfg.hidden_size, dtype)
                    packed.backend = unfused
                    got = packed.forward(x, tail=tail)
                    packed.backend = fused
                    out[(dtype, tail, T)] = (got, decoded.forward(x, tail=tail), packed.forward(x, tail=tail))
    return out


def _stored_bytes(ckpt: Path) -> dict[str, int]:
    sizes = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for name in h.keys():
                view = h.get_slice(name)
                size = torch_dtype(SAFETENSORS_DTYPES[view.get_dtype()]).itemsize
                sizes[name] = size * torch.Size(view.get_shape()).numel()
    return sizes


def _expected_parts(P: int, dtype: torch.dtype) -> dict[str, int]:
    """Resident bytes per part for the medium preset by hand."""
    H, D, E, I, Is = 1024, 512, 64, 384, 768
    b = torch.empty((), dtype=dtype).element_size()
    I_l, Is_l = I // P, Is // P
    return {
        # gate+up [2*I_l, D] and down [D, I_l]: a nibble per weight plus one scale byte per 32
        "experts_packed": E * (2 * I_l * D + D * I_l) * 17 // 32,
        "experts_dense": 0,
        "experts_backend": 0,
        "shared_experts": 3 * Is_l * H * b,
        "latent_projections": D * H * b + D * 4,  # Wdown + fp32 norm gamma
        "up_projection": H * D * b,
        "router": E * H * 4 + E * 4,
    }


@pytest.mark.parametrize("P", [1, 2])
def test_packed_forward_equals_decoded_forward(medium: Path, P: int) -> None:
    if P == 1:
        results = [_rank_packed_vs_decoded(Collectives(), str(medium))]
    else:
        results = run_local_group(P, _rank_packed_vs_decoded, str(medium), timeout_s=600.0)
    cfg = LatentMoEConfig.from_pretrained(medium)
    stored = _stored_bytes(medium)
    split = sum(v for k, v in stored.items() if ".experts." in k or ".shared_experts." in k)
    tails_seen = set()
    for r, res in enumerate(results):
        for dtype in DTYPES:
            bytes_read, parts = res[(dtype, "bytes")]
            assert parts == _expected_parts(P, dtype), (r, dtype)
            # this rank's slices only: every replicated tensor plus 1/P of each split one
            assert bytes_read == sum(stored.values()) - split + split // P, (r, dtype)
        for key, value in res.items():
            if key[1] == "bytes":
                continue
            got, ref, fused = value
            tails_seen.add(key[1])
            # The decoded weights come from the same mxfp4.decode, bit for bit, and both runs do
            # the same GEMMs on the same rows in the same order (collectives too): exactly equal.
            torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=f"rank {r} {key}")
            # The fused path differs only in the order of fp32 additions (test_fused_cpu derives it)
            assert_fused_close(fused, ref, key[0], f"rank {r} {key}")
    expected_tails = {"replicated", "overlap", "single_allreduce"}  # at P = 1 nothing is sharded
    if P > 1:
        expected_tails |= {"sharded", "sequence_parallel"}
    assert tails_seen == expected_tails
    # and the packed TP result is the single-device layer: fp32 partials summed in another order
    full = load_layer_weights(medium, cfg, LAYER, torch.float32)
    x = _input(37, cfg.hidden_size, torch.float32)
    got = results[0][(torch.float32, "replicated", 37)][0]
    torch.testing.assert_close(got, moe_forward(x, full, cfg), rtol=1e-5, atol=1e-5)


def test_experts_stay_packed_and_decode_only_when_active(medium: Path) -> None:
    cfg = LatentMoEConfig.from_pretrained(medium)
    w = load_layer_weights(medium, cfg, LAYER, torch.bfloat16)
    assert w.experts.packed and w.experts.w13.dtype == torch.uint8
    dense = _decoded(w)
    # what the pre-issue-8 loader held: 16 bits per expert weight instead of 4.25
    assert dense.nbytes_by_part()["experts_dense"] * 17 == w.nbytes_by_part()["experts_packed"] * 64


# -- writer, layouts, activation -------------------------------------------------------------


def test_streamed_multi_shard_writer_round_trips(tmp_path: Path) -> None:
    raw = preset_config("tiny")
    per_layer = write_checkpoint(tmp_path / "per_layer", raw, use_mxfp4=True, seed=4)
    sharded = write_checkpoint(tmp_path / "sharded", raw, use_mxfp4=True, seed=4, shard_bytes=60_000)
    files = sorted(sharded.glob("*.safetensors"))
    assert len(files) >= 4 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((sharded / INDEX_FILE).read_text())
    stored = 0
    for f in files:  # every file is a valid safetensors file (the library parses it)
        tensors = load_file(f)
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        assert sum(sizes) <= 60_000 or len(sizes) == 1  # only a tensor bigger than a shard overflows
        assert all(index["weight_map"][name] == f.name for name in tensors)
        stored += sum(sizes)
    assert index["metadata"]["total_size"] == stored
    cfg = LatentMoEConfig.from_pretrained(sharded)
    for layer in cfg.moe_layers:  # same seed: the very same tensors, whatever the file layout
        a, b = (load_layer_weights(c, cfg, layer).tensors() for c in (per_layer, sharded))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_moe_layers_writes_only_the_first_layers(tmp_path: Path) -> None:
    out = write_checkpoint(tmp_path / "one", preset_config("tiny", num_hidden_layers=4), seed=1,
                           moe_layers=1, shard_bytes=10**9)
    cfg = LatentMoEConfig.from_pretrained(out)
    assert cfg.moe_layers == [1, 2, 3]  # the config still describes the whole model
    load_layer_weights(out, cfg, 1)
    with pytest.raises(ValueError, match="has no tensors for layer 2"):
        load_layer_weights(out, cfg, 2)


def test_random_codes_have_fan_in_std() -> None:
    from moe_runtime.synthetic import random_mxfp4

    for cols in (512, 3584, 3072):
        packed, scale = random_mxfp4(256, cols, torch.Generator().manual_seed(cols))
        w = mxfp4.decode(packed, scale)
        # 256 * cols samples: the std estimate is within ~1% of cols ** -0.5
        assert abs(w.std().item() * cols**0.5 - 1) < 0.03, cols


@pytest.mark.parametrize("prefix", [
    "language_model.layers.{i}.block_sparse_moe.",
    "language_model.model.layers.{i}.block_sparse_moe.",
    "model.layers.{i}.block_sparse_moe.",
])
def test_every_layer_prefix_loads(tmp_path: Path, prefix: str) -> None:
    raw = preset_config("tiny")
    ref = load_layer_weights(write_checkpoint(tmp_path / "ref", raw, seed=5), LatentMoEConfig.from_dict(raw), 2)
    ckpt = write_checkpoint(tmp_path / "ckpt", raw, seed=5, prefix=prefix)
    reader = CheckpointReader(ckpt)
    assert reader.layer_prefix(2) == prefix.format(i=2)
    got = load_layer_weights(reader, LatentMoEConfig.from_pretrained(ckpt), 2)
    assert all(torch.equal(got.tensors()[k], t) for k, t in ref.tensors().items())


@pytest.mark.parametrize("P", [1, 2])
def test_mxfp4_shared_experts_are_decoded_slices(tmp_path: Path, P: int) -> None:
    raw = preset_config("tiny")
    ckpt = write_checkpoint(tmp_path / "ckpt", raw, use_mxfp4=True, shared_mxfp4=True, seed=6)
    cfg = LatentMoEConfig.from_dict(raw)
    reader = CheckpointReader(ckpt)
    p = reader.layer_prefix(1) + "shared_experts."
    assert p + "down_proj.weight_packed" in reader and p + "down_proj.weight" not in reader
    full = {
        name: mxfp4.decode(reader.read(p + name + ".weight_packed"), reader.read(p + name + ".weight_scale"),
                           torch.bfloat16)
        for name in ("gate_proj", "up_proj", "down_proj")
    }
    Is = cfg.shared_intermediate_size
    for r in range(P):
        w = load_layer_weights(ckpt, cfg, 1, torch.bfloat16, TPShard(r, P))
        rows = slice(r * Is // P, (r + 1) * Is // P)
        assert torch.equal(w.shared_gate_SH, full["gate_proj"][rows])
        assert torch.equal(w.shared_up_SH, full["up_proj"][rows])
        assert torch.equal(w.shared_down_HS, full["down_proj"][:, rows])
        # held decoded in the compute dtype and counted as shared experts
        assert w.nbytes_by_part()["shared_experts"] == 3 * (Is // P) * cfg.hidden_size * 2


def test_hidden_act_silu_ignores_beta_fields(tmp_path: Path) -> None:
    silu_raw = preset_config("tiny", hidden_act="silu")  # the preset's beta fields stay present
    assert silu_raw["activation_situ_beta"] == 4.0
    silu, situ = LatentMoEConfig.from_dict(silu_raw), LatentMoEConfig.from_dict(preset_config("tiny"))
    assert GatedActivation.from_config(silu) == GatedActivation()
    assert GatedActivation.from_config(situ) == GatedActivation(4.0, 25.0)
    g = torch.linspace(-30, 30, 61)
    u = torch.linspace(-40, 40, 61)
    torch.testing.assert_close(GatedActivation.from_config(silu)(g, u), torch.nn.functional.silu(g) * u,
                               rtol=0, atol=0)
    ckpt = write_checkpoint(tmp_path / "ckpt", silu_raw, seed=1)
    w = load_layer_weights(ckpt, silu, 1)
    x = _input(9, silu.hidden_size, torch.float32) * 40  # large enough that SiTU's caps bite
    no_beta = dataclasses.replace(silu, activation_situ_beta=None, activation_situ_linear_beta=None)
    torch.testing.assert_close(moe_forward(x, w, silu), moe_forward(x, w, no_beta), rtol=0, atol=0)
    assert not torch.allclose(moe_forward(x, w, silu), moe_forward(x, w, situ))
