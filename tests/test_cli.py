"""`python -m moe_runtime forward`: single device, every tail at --tp 2, --explain, errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_runtime.checkpoint import load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import moe_forward

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_runtime", "forward", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def io(tiny_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    x = torch.randn(33, 128, generator=torch.Generator().manual_seed(3))
    save_file({"hidden_states": x}, d / "in.safetensors")
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    ref = moe_forward(x, load_layer_weights(tiny_ckpt, cfg, 2), cfg)
    return d, ref


def test_single_device_matches_reference(tiny_ckpt, io):
    d, ref = io
    res = cli("--checkpoint", tiny_ckpt, "--layer", 2, "--input", d / "in.safetensors", "--output", d / "o1.safetensors")
    assert res.returncode == 0, res.stderr
    assert "single device" in res.stdout
    # Same math; another process may block its GEMMs differently (thread count): ~1e-7 relative.
    torch.testing.assert_close(load_file(d / "o1.safetensors")["output"], ref, rtol=1e-5, atol=1e-5)


# The TP ranks sum fp32 partials in another order than the single device: ~1e-6 relative.
@pytest.mark.parametrize("flags", [
    ["--tail", "replicated"], ["--tail", "overlap"], ["--tail", "sharded"], ["--tail", "single_allreduce"],
    ["--sequence-parallel"], ["--preshard-up-proj", "--tail", "sharded"],
])
def test_tp2_every_tail(tiny_ckpt, io, flags):
    d, ref = io
    out = d / f"o_{'_'.join(f.strip('-') for f in flags)}.safetensors"
    res = cli("--checkpoint", tiny_ckpt, "--layer", 2, "--input", d / "in.safetensors", "--output", out, "--tp", 2, *flags)
    assert res.returncode == 0, res.stderr
    assert "TP 2" in res.stdout
    torch.testing.assert_close(load_file(out)["output"], ref, rtol=1e-5, atol=1e-5)


def test_explain_prints_decision_without_running(tiny_ckpt):
    res = cli("--checkpoint", tiny_ckpt, "--layer", 1, "--tp", 2, "--explain")
    assert res.returncode == 0, res.stderr
    assert "tail plan: T in [1, inf] -> sharded" in res.stdout
    res = cli("--checkpoint", tiny_ckpt, "--layer", 1, "--tp", 1, "--explain")
    assert "TP size is 1" in res.stdout and "-> replicated" in res.stdout


def test_errors(tiny_ckpt, tmp_path):
    good = tmp_path / "in.safetensors"
    save_file({"hidden_states": torch.randn(4, 128)}, good)
    cases = {
        "has no tensor 'hidden_states'": {"other": torch.randn(4, 128)},
        "must have shape [T, 128]": {"hidden_states": torch.randn(4, 64)},
        "NaN or Inf": {"hidden_states": torch.full((4, 128), float("nan"))},
        "no tokens": {"hidden_states": torch.randn(0, 128)},
    }
    for message, tensors in cases.items():
        path = tmp_path / "bad.safetensors"
        save_file(tensors, path)
        res = cli("--checkpoint", tiny_ckpt, "--layer", 1, "--input", path, "--output", tmp_path / "o.safetensors")
        assert res.returncode == 2 and message in res.stderr, (message, res.stderr)
    res = cli("--checkpoint", tiny_ckpt, "--layer", 0, "--input", good, "--output", tmp_path / "o.safetensors")
    assert res.returncode == 2 and "layer 0 is not a MoE layer" in res.stderr
    res = cli("--checkpoint", tiny_ckpt, "--layer", 1, "--input", good, "--output", tmp_path / "o.safetensors",
              "--tail", "sharded")
    assert res.returncode == 2 and "TP size is 1" in res.stderr
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    res = cli("--checkpoint", tiny_ckpt, "--layer", 1, "--input", tmp_path / "junk.safetensors",
              "--output", tmp_path / "o.safetensors")
    assert res.returncode == 2 and "not a readable safetensors file" in res.stderr


def test_mxfp4_scale_rule_flag(make_ckpt, tmp_path, capsys):
    """``--mxfp4-scale-rule`` reaches the W4A4 experts (single device, in process), defaults to
    the production rule ``even``, and is refused where nothing quantises MXFP4 activations."""
    from moe_runtime import mxfp4
    from moe_runtime.cli import main

    ckpt = str(make_ckpt(mxfp4=True))
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    x = torch.randn(33, 128, generator=torch.Generator().manual_seed(4))
    save_file({"hidden_states": x}, tmp_path / "in.safetensors")
    w = load_layer_weights(ckpt, cfg, 1)
    outs = {}
    for rule in (None, "even", "floor"):
        out = tmp_path / f"o_{rule}.safetensors"
        flags = [] if rule is None else ["--mxfp4-scale-rule", rule]
        rc = main(["forward", "--checkpoint", ckpt, "--layer", "1", "--input", str(tmp_path / "in.safetensors"),
                   "--output", str(out), "--experts-activation-quant", "mxfp4", *flags])
        assert rc == 0, capsys.readouterr().err
        outs[rule] = load_file(out)["output"]
    for rule in ("even", "floor"):
        ref = moe_forward(x, w, cfg, act_quant=lambda t, rule=rule: mxfp4.quantize_dequantize(t, rule))
        # the same math in the same process: only GEMM blocking over other row counts differs
        torch.testing.assert_close(outs[rule], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(outs[None], outs["even"]) and not torch.equal(outs["even"], outs["floor"])
    rc = main(["forward", "--checkpoint", ckpt, "--layer", "1", "--input", str(tmp_path / "in.safetensors"),
               "--output", str(tmp_path / "x.safetensors"), "--mxfp4-scale-rule", "floor"])
    assert rc == 2 and "mxfp4_scale_rule 'floor' would have no effect" in capsys.readouterr().err
