"""Checkpoint loader (DESIGN §3): layouts, per-layer reads, and clear errors on bad files."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_runtime.checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointReader, load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.synthetic import PRESETS
from moe_runtime.tp.sharding import TPShard
from moe_runtime.units import SAFETENSORS_DTYPES, torch_dtype

REPO = Path(__file__).resolve().parents[1]
K3 = "language_model.layers.{i}.block_sparse_moe."
TEXT = "model.layers.{i}.block_sparse_moe."


def raises(*fragments: str):
    return pytest.raises(ValueError, match=".*".join(re.escape(f) for f in fragments))


def assert_same_weights(a, b) -> None:
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_single_file(ckpt: Path, edit) -> None:
    """Load every tensor of model.safetensors, let ``edit`` change the dict, save it back."""
    path = ckpt / SINGLE_FILE
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def layer_bytes(ckpt: Path, prefix: str) -> tuple[int, int]:
    """(bytes of the tensors under ``prefix``, bytes of all tensors) in a checkpoint."""
    files = sorted(ckpt.glob("*.safetensors"))
    mine = total = 0
    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                n = f.get_slice(name)
                shape, dtype = n.get_shape(), n.get_dtype()
                size = torch_dtype(SAFETENSORS_DTYPES[dtype]).itemsize
                nbytes = size * int(torch.tensor(shape).prod().item()) if shape else size
                total += nbytes
                if name.startswith(prefix):
                    mine += nbytes
    return mine, total


# --- layouts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mxfp4", [False, True])
def test_single_file_and_index_load_the_same_weights(make_ckpt, mxfp4: bool) -> None:
    indexed = make_ckpt(mxfp4=mxfp4)
    single = make_ckpt(mxfp4=mxfp4, single_file=True)
    assert (indexed / INDEX_FILE).is_file() and not (indexed / SINGLE_FILE).exists()
    assert (single / SINGLE_FILE).is_file() and not (single / INDEX_FILE).exists()
    cfg = LatentMoEConfig.from_pretrained(indexed)
    for layer in cfg.moe_layers:
        assert_same_weights(load_layer_weights(indexed, cfg, layer), load_layer_weights(single, cfg, layer))


def test_both_prefixes(make_ckpt) -> None:
    k3 = make_ckpt()
    text = make_ckpt(text_only=True)
    assert "text_config" not in json.loads((text / "config.json").read_text())
    assert CheckpointReader(k3).layer_prefix(1) == K3.format(i=1)
    assert CheckpointReader(text).layer_prefix(2) == TEXT.format(i=2)
    cfg = LatentMoEConfig.from_pretrained(text)
    assert cfg == LatentMoEConfig.from_pretrained(k3)
    assert_same_weights(load_layer_weights(k3, cfg, 2), load_layer_weights(text, cfg, 2))


def test_loaded_shapes_and_dtypes(tiny_ckpt: Path) -> None:
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    H, D, E, I, Is = 128, 64, 8, 64, 64
    for dtype in (torch.float32, torch.bfloat16):
        w = load_layer_weights(tiny_ckpt, cfg, 1, dtype=dtype)
        assert w.shapes() == {
            "gate_EH": (E, H), "bias_E": (E,), "down_DH": (D, H), "norm_D": (D,), "up_HD": (H, D),
            "experts.w13": (E, 2 * I, D), "experts.w2": (E, D, I),
            "shared_gate_SH": (Is, H), "shared_up_SH": (Is, H), "shared_down_HS": (H, Is),
        }
        # the router and the norm weight stay fp32; everything else is in the requested dtype
        assert w.gate_EH.dtype == w.bias_E.dtype == w.norm_D.dtype == torch.float32
        assert w.dtype == w.experts.w13.dtype == w.shared_down_HS.dtype == dtype


def test_w13_stacks_gate_rows_over_up_rows(tiny_ckpt: Path) -> None:
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    w = load_layer_weights(tiny_ckpt, cfg, 2, dtype=torch.bfloat16)
    reader = CheckpointReader(tiny_ckpt)
    p = K3.format(i=2)
    torch.testing.assert_close(w.experts.w13[5, :64], reader.read(p + "experts.5.w1.weight"), rtol=0, atol=0)
    torch.testing.assert_close(w.experts.w13[5, 64:], reader.read(p + "experts.5.w3.weight"), rtol=0, atol=0)
    torch.testing.assert_close(w.experts.w2[5], reader.read(p + "experts.5.w2.weight"), rtol=0, atol=0)


def test_optional_tensors_absent(make_ckpt) -> None:
    ckpt = make_ckpt(num_shared_experts=0, latent_moe_use_norm=False)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    w = load_layer_weights(ckpt, cfg, 1)
    assert w.norm_D is None and not w.has_shared and w.shared_down_HS is None


def test_mxfp4_checkpoint_decodes_experts(make_ckpt) -> None:
    ckpt = make_ckpt(mxfp4=True)
    reader = CheckpointReader(ckpt)
    p = K3.format(i=1)
    assert p + "experts.0.w1.weight_packed" in reader and p + "experts.0.w1.weight" not in reader
    assert reader.shape(p + "experts.0.w2.weight_packed") == (64, 32)
    assert reader.shape(p + "experts.0.w2.weight_scale") == (64, 2)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    w = load_layer_weights(ckpt, cfg, 1)
    dense = load_layer_weights(make_ckpt(), cfg, 1)
    # the experts stay packed in memory: 4-bit nibbles + one E8M0 byte per 32
    assert w.experts.packed and w.experts.w13.dtype == torch.uint8 and w.experts.w13.shape == (8, 128, 32)
    assert w.experts.w13_scale.shape == (8, 128, 2) and w.experts.w2_scale.shape == (8, 64, 2)
    # same seed, so the MXFP4 experts are the dense ones up to FP4 rounding (<= amax/12 or |x|/4)
    w13 = w.experts.decode(torch.arange(8))[0]
    assert w13.shape == dense.experts.w13.shape
    err = (w13 - dense.experts.w13.float()).abs()
    assert (err <= dense.experts.w13.float().abs() / 4 + dense.experts.w13.float().abs().amax() / 12).all()
    assert torch.equal(w.gate_EH, dense.gate_EH)  # non-expert tensors stay dense


# --- read only what is needed -----------------------------------------------------------------


@pytest.mark.parametrize("single_file", [False, True])
def test_reading_a_layer_reads_only_that_layer(make_ckpt, single_file: bool) -> None:
    ckpt = make_ckpt(single_file=single_file, num_hidden_layers=5)  # MoE layers 1..4
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    mine, total = layer_bytes(ckpt, K3.format(i=1))
    reader = CheckpointReader(ckpt)
    load_layer_weights(reader, cfg, 1)
    # every tensor of layer 1 is read once, in full, and nothing else: a quarter of the file(s)
    assert reader.bytes_read == mine
    assert reader.bytes_read <= total / 4 + 1
    reader2 = CheckpointReader(ckpt)
    load_layer_weights(reader2, cfg, 3)
    assert reader2.bytes_read == mine  # every layer has the same size


@pytest.mark.parametrize("mxfp4", [False, True])
def test_tp_shard_reads_only_its_slices(make_ckpt, mxfp4: bool) -> None:
    ckpt = make_ckpt(mxfp4=mxfp4)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    full_reader = CheckpointReader(ckpt)
    full = load_layer_weights(full_reader, cfg, 1)
    readers = [CheckpointReader(ckpt) for _ in range(2)]
    shards = [load_layer_weights(readers[r], cfg, 1, shard=TPShard(r, 2)) for r in range(2)]
    I = cfg.moe_intermediate_size
    # the two ranks' slices stitch back into the full tensors (DESIGN §4 table)
    w1 = torch.cat([s.experts.w13[:, : I // 2] for s in shards], 1)
    w3 = torch.cat([s.experts.w13[:, I // 2 :] for s in shards], 1)
    assert torch.equal(torch.cat([w1, w3], 1), full.experts.w13)
    assert torch.equal(torch.cat([s.experts.w2 for s in shards], 2), full.experts.w2)
    if mxfp4:  # packed slices fall on byte and 32-block boundaries: nibbles and scales stitch alike
        s1 = torch.cat([s.experts.w13_scale[:, : I // 2] for s in shards], 1)
        s3 = torch.cat([s.experts.w13_scale[:, I // 2 :] for s in shards], 1)
        assert torch.equal(torch.cat([s1, s3], 1), full.experts.w13_scale)
        assert torch.equal(torch.cat([s.experts.w2_scale for s in shards], 2), full.experts.w2_scale)
    assert torch.equal(torch.cat([s.shared_down_HS for s in shards], 1), full.shared_down_HS)
    assert torch.equal(shards[1].gate_EH, full.gate_EH)
    # each rank reads the replicated tensors plus exactly half of the split ones' bytes on disk
    # (bf16 on disk: 2 bytes per element; MXFP4 experts: their packed bytes as held)
    shared_elems = sum(t.numel() for t in (full.shared_gate_SH, full.shared_up_SH, full.shared_down_HS))
    expert_disk_bytes = full.experts.nbytes() if mxfp4 else full.experts.nbytes() // 2  # loaded as fp32
    split_bytes = expert_disk_bytes + shared_elems * 2
    assert readers[0].bytes_read == readers[1].bytes_read
    assert full_reader.bytes_read - readers[0].bytes_read == split_bytes // 2


# --- the fast reader equals a straightforward load -------------------------------------------


def reference_layer(ckpt: Path, cfg: LatentMoEConfig, layer: int, dtype: torch.dtype, shard: TPShard) -> dict:
    """A rank's tensors the plain way: every file through safetensors' ``load_file``, then the
    DESIGN §4 table applied with ``narrow`` and ``torch.stack`` (none of the loader's reads)."""
    t: dict[str, torch.Tensor] = {}
    for path in ckpt.glob("*.safetensors"):
        t.update(load_file(path))
    p, E = K3.format(i=layer), cfg.num_experts

    def part(x: torch.Tensor, dim: int | None) -> torch.Tensor:
        if dim is None:
            return x
        n = x.shape[dim] // shard.world
        return x.narrow(dim, shard.rank * n, n)

    out = {
        "gate_EH": t[p + "gate.weight"].float(), "bias_E": t[p + "gate.e_score_correction_bias"].float(),
        "down_DH": t[p + "routed_expert_down_proj.weight"].to(dtype),
        "norm_D": t[p + "routed_expert_norm.weight"].float(),
        "up_HD": part(t[p + "routed_expert_up_proj.weight"], 0 if shard.preshard_up_proj else None).to(dtype),
        "shared_gate_SH": part(t[p + "shared_experts.gate_proj.weight"], 0).to(dtype),
        "shared_up_SH": part(t[p + "shared_experts.up_proj.weight"], 0).to(dtype),
        "shared_down_HS": part(t[p + "shared_experts.down_proj.weight"], 1).to(dtype),
    }
    packed = p + "experts.0.w1.weight_packed" in t
    for suffix, key in ((".weight_packed", ""), (".weight_scale", "_scale")) if packed else ((".weight", ""),):
        def w(e: int, which: str, dim: int, suffix: str = suffix) -> torch.Tensor:
            return part(t[f"{p}experts.{e}.{which}{suffix}"], dim)

        w13 = torch.stack([torch.cat([w(e, "w1", 0), w(e, "w3", 0)]) for e in range(E)])
        w2 = torch.stack([w(e, "w2", 1) for e in range(E)])
        out[f"experts.w13{key}"], out[f"experts.w2{key}"] = (w13, w2) if packed else (w13.to(dtype), w2.to(dtype))
    return out


@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize(("world", "preshard"), [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_tensors_equal_a_plain_load(make_ckpt, monkeypatch, mxfp4: bool, world: int, preshard: bool,
                                           dtype: torch.dtype) -> None:
    from moe_runtime import checkpoint

    ckpt = make_ckpt(mxfp4=mxfp4)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    for rank in range(world):
        shard = TPShard(rank, world, preshard)
        expected = reference_layer(ckpt, cfg, 1, dtype, shard)
        for threads in (1, 3):
            got = load_layer_weights(ckpt, cfg, 1, dtype, shard, threads=threads).tensors()
            assert got.keys() == expected.keys()
            for name, t in got.items():
                assert t.dtype == expected[name].dtype and torch.equal(t, expected[name]), (name, threads)
                # no strided view of the file: every tensor is as a GEMM wants it
                assert t.is_contiguous(), name
        # tiny chunks: many of them over 3 threads
        monkeypatch.setattr(checkpoint, "MIN_CHUNK_BYTES", 1)
        monkeypatch.setattr(checkpoint, "READAHEAD_BYTES", 512)
        got = load_layer_weights(ckpt, cfg, 1, dtype, shard, threads=3).tensors()
        assert all(torch.equal(t, expected[name]) for name, t in got.items())
        monkeypatch.undo()


def test_reads_the_same_where_the_os_lacks_preadv(make_ckpt, monkeypatch) -> None:
    ckpt = make_ckpt(mxfp4=True)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    expected = reference_layer(ckpt, cfg, 1, torch.bfloat16, TPShard(1, 2))
    monkeypatch.delattr(os, "preadv", raising=False)
    got = load_layer_weights(ckpt, cfg, 1, torch.bfloat16, TPShard(1, 2), threads=2).tensors()
    assert all(torch.equal(t, expected[name]) for name, t in got.items())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the mappings from /proc (Linux)")
def test_dense_slices_in_the_file_dtype_are_views_of_the_file(tiny_ckpt: Path) -> None:
    """Replicated and row-split tensors already in the compute dtype share the file's pages (a
    private mapping, populated at load); column slices and converted tensors are copies."""
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    w = load_layer_weights(tiny_ckpt, cfg, 1, torch.bfloat16, TPShard(1, 2))
    path = tiny_ckpt / "model-layer-00001.safetensors"
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if str(path) in line]

    def mapped(t: torch.Tensor) -> bool:
        return any(int(m[0].split("-")[0], 16) <= t.data_ptr() < int(m[0].split("-")[1], 16) for m in maps)

    assert maps and all(mapped(t) for t in (w.down_DH, w.up_HD, w.shared_gate_SH, w.shared_up_SH, w.gate_EH))
    assert not any(mapped(t) for t in (w.shared_down_HS, w.norm_D, w.experts.w13, w.experts.w2))
    before = w.up_HD.clone()
    w.up_HD.add_(1)  # a private mapping: the file never changes
    assert torch.equal(load_layer_weights(tiny_ckpt, cfg, 1, torch.bfloat16).up_HD, before)


def test_read_into_checks_the_destination(tiny_ckpt: Path) -> None:
    reader = CheckpointReader(tiny_ckpt)
    name = K3.format(i=1) + "shared_experts.down_proj.weight"  # bf16 [128, 64]
    with raises(name, "cannot read a BF16 [128, 32] slice into a torch.float32 [128, 32] tensor"):
        reader.read_into(torch.empty(128, 32), name, 1, 0, 32)
    with raises("non-contiguous"):
        reader.read_into(torch.empty(32, 128, dtype=torch.bfloat16).t(), name, 1, 32, 64)
    out = torch.empty(128, 32, dtype=torch.bfloat16)
    reader.read_into(out, name, 1, 32, 64)
    assert torch.equal(out, load_file(tiny_ckpt / "model-layer-00001.safetensors")[name][:, 32:64])


# --- broken checkpoints -----------------------------------------------------------------------


def test_missing_expert_tensor(make_ckpt, tmp_path: Path) -> None:
    ckpt = copy_ckpt(make_ckpt(single_file=True), tmp_path / "ckpt")
    name = K3.format(i=1) + "experts.3.w2.weight"
    rewrite_single_file(ckpt, lambda t: t.pop(name))
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    with raises("checkpoint has neither", name, "experts.3.w2.weight_packed"):
        load_layer_weights(ckpt, cfg, 1)
    load_layer_weights(ckpt, cfg, 2)  # the other layer is intact


@pytest.mark.parametrize(
    "suffix", ["gate.e_score_correction_bias", "routed_expert_norm.weight", "routed_expert_up_proj.weight",
               "shared_experts.down_proj.weight"],
)
def test_missing_dense_tensor(make_ckpt, tmp_path: Path, suffix: str) -> None:
    ckpt = copy_ckpt(make_ckpt(single_file=True), tmp_path / "ckpt")
    name = K3.format(i=2) + suffix
    rewrite_single_file(ckpt, lambda t: t.pop(name))
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    # shared experts may be dense or MXFP4, so their message names both spellings
    with raises("has neither" if suffix.startswith("shared") else "has no tensor", f"'{name}'"):
        load_layer_weights(ckpt, cfg, 2)


def test_missing_router_means_missing_layer(make_ckpt, tmp_path: Path) -> None:
    ckpt = copy_ckpt(make_ckpt(single_file=True), tmp_path / "ckpt")
    rewrite_single_file(ckpt, lambda t: t.pop(K3.format(i=1) + "gate.weight"))
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    with raises("has no tensors for layer 1", K3.format(i=1) + "gate.weight", TEXT.format(i=1) + "gate.weight"):
        load_layer_weights(ckpt, cfg, 1)


@pytest.mark.parametrize(
    ("suffix", "bad_shape", "expected"),
    [
        ("routed_expert_down_proj.weight", (64, 127), (64, 128)),
        ("gate.e_score_correction_bias", (9,), (8,)),
        ("experts.7.w1.weight", (64, 65), (64, 64)),
        ("shared_experts.gate_proj.weight", (128, 64), (64, 128)),
    ],
)
def test_wrong_shape(make_ckpt, tmp_path: Path, suffix: str, bad_shape, expected) -> None:
    ckpt = copy_ckpt(make_ckpt(single_file=True), tmp_path / "ckpt")
    name = K3.format(i=1) + suffix

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.zeros(bad_shape, dtype=t[name].dtype)

    rewrite_single_file(ckpt, edit)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    with raises(f"tensor '{name}' has shape {tuple(bad_shape)}, expected {tuple(expected)}"):
        load_layer_weights(ckpt, cfg, 1)


def test_wrong_mxfp4_scale_shape(make_ckpt, tmp_path: Path) -> None:
    ckpt = copy_ckpt(make_ckpt(single_file=True, mxfp4=True), tmp_path / "ckpt")
    name = K3.format(i=1) + "experts.2.w2.weight_scale"
    rewrite_single_file(ckpt, lambda t: t.__setitem__(name, torch.zeros(64, 4, dtype=torch.uint8)))
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    with raises(f"tensor '{name}' has shape (64, 4), expected (64, 2)"):
        load_layer_weights(ckpt, cfg, 1)


def test_index_points_to_missing_file(make_ckpt, tmp_path: Path) -> None:
    ckpt = copy_ckpt(make_ckpt(), tmp_path / "ckpt")
    (ckpt / "model-layer-00002.safetensors").unlink()
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    load_layer_weights(ckpt, cfg, 1)  # layer 1 lives in another file
    with raises("is mapped to model-layer-00002.safetensors, which does not exist"):
        load_layer_weights(ckpt, cfg, 2)


def test_index_names_a_file_that_was_never_written(make_ckpt, tmp_path: Path) -> None:
    ckpt = copy_ckpt(make_ckpt(), tmp_path / "ckpt")
    index = json.loads((ckpt / INDEX_FILE).read_text())
    name = K3.format(i=1) + "routed_expert_up_proj.weight"
    index["weight_map"][name] = "model-extra.safetensors"
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    with raises(f"tensor '{name}' is mapped to model-extra.safetensors, which does not exist"):
        load_layer_weights(ckpt, cfg, 1)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', "[1, 2]"])
def test_corrupt_index(make_ckpt, tmp_path: Path, text: str) -> None:
    ckpt = copy_ckpt(make_ckpt(), tmp_path / "ckpt")
    (ckpt / INDEX_FILE).write_text(text)
    with raises(INDEX_FILE, "is not a valid safetensors index"):
        CheckpointReader(ckpt)


@pytest.mark.parametrize("cut", ["header", "data"])
def test_truncated_safetensors_file(make_ckpt, tmp_path: Path, cut: str) -> None:
    ckpt = copy_ckpt(make_ckpt(single_file=True), tmp_path / "ckpt")
    path = ckpt / SINGLE_FILE
    raw = path.read_bytes()
    path.write_bytes(raw[:20] if cut == "header" else raw[:-100])
    with raises(f"cannot open {path}: not a readable safetensors file",
                "does not fit" if cut == "header" else "lie outside the file's data"):
        CheckpointReader(ckpt)


def test_no_weights_at_all(tmp_path: Path) -> None:
    with raises("holds neither model.safetensors nor model.safetensors.index.json"):
        CheckpointReader(tmp_path)


def test_unknown_and_dense_layers(tiny_ckpt: Path) -> None:
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    with raises("unknown layer 7", "0..2"):
        load_layer_weights(tiny_ckpt, cfg, 7)
    with raises("layer 0 is not a MoE layer", "MoE layers: [1, 2]"):
        load_layer_weights(tiny_ckpt, cfg, 0)


def test_layer_in_config_but_not_in_checkpoint(tiny_ckpt: Path) -> None:
    cfg = LatentMoEConfig.from_dict({**PRESETS["tiny"], "num_hidden_layers": 4})
    with raises("has no tensors for layer 3"):
        load_layer_weights(tiny_ckpt, cfg, 3)


def test_shard_that_does_not_divide(tiny_ckpt: Path) -> None:
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    with raises("cannot be split across TP size 3", "64 % 3 = 1"):
        load_layer_weights(tiny_ckpt, cfg, 1, shard=TPShard(0, 3))


# --- scripts/make_checkpoint.py ---------------------------------------------------------------


def make_checkpoint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_checkpoint.py"), *args],
        capture_output=True, text=True, timeout=120, check=False,
    )


def test_cli_tiny_mxfp4(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    proc = make_checkpoint("--preset", "tiny", "--out", str(out), "--mxfp4", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert "wrote tiny checkpoint" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model-layer-00001.safetensors", "model-layer-00002.safetensors", INDEX_FILE,
    ]
    reader = CheckpointReader(out)
    assert K3.format(i=2) + "experts.7.w3.weight_packed" in reader
    assert K3.format(i=2) + "experts.7.w3.weight_scale" in reader
    assert K3.format(i=2) + "experts.7.w3.weight" not in reader
    cfg = LatentMoEConfig.from_pretrained(out)
    w = load_layer_weights(reader, cfg, 2)
    assert w.experts.packed and (w.experts.num_experts, w.experts.intermediate_size, w.experts.latent_size) == (8, 64, 64)


def test_cli_config_only_kimi_k3(tmp_path: Path) -> None:
    out = tmp_path / "k3"
    proc = make_checkpoint("--preset", "kimi-k3", "--out", str(out), "--config-only")
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in out.iterdir()] == ["config.json"]
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert (text["hidden_size"], text["routed_expert_hidden_size"], text["num_experts"],
            text["num_experts_per_token"], text["moe_intermediate_size"], text["num_shared_experts"],
            text["num_hidden_layers"]) == (7168, 3584, 896, 16, 3072, 2, 93)
    assert (text["use_grouped_topk"], text["num_expert_group"], text["topk_group"]) == (True, 1, 1)
    assert text["hidden_act"] == "situ"
    cfg = LatentMoEConfig.from_pretrained(out)
    assert cfg.moe_layers[0] == 1 and len(cfg.moe_layers) == 92  # layer 0 dense, 92 MoE
    assert cfg.uses_situ and not cfg.grouped  # one group: grouped top-k is plain top-k


def test_cli_rejects_config_without_moe_layer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # argument errors need no subprocess: run the script's main() in this process
    spec = importlib.util.spec_from_file_location("make_checkpoint", REPO / "scripts" / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as info:
        module.main(["--preset", "tiny", "--out", str(tmp_path / "x"), "--layers", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "no MoE layer" in err and "num_hidden_layers=1" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("text", ['{"weight_map": [1, 2]}', '{"weight_map": null}', '{"weight_map": {"a": 5}}'])
def test_index_weight_map_of_the_wrong_type(tmp_path: Path, text: str) -> None:
    (tmp_path / INDEX_FILE).write_text(text)
    with raises(INDEX_FILE, "is not a valid safetensors index"):
        CheckpointReader(tmp_path)
