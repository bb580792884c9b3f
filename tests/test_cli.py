"""`python -m moe_runtime forward`: single device, every tail at --tp 2, --explain, errors."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_runtime.checkpoint import load_layer_weights
from moe_runtime.cli import forward_times_line
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import moe_forward
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group

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


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``main(["forward", *args])`` in this process: its exit status, stdout and stderr (no
    interpreter to start; the ranks of --tp 2 are still spawned processes). The command line
    itself runs as a subprocess in test_single_device_matches_reference, at --tp 2 in
    test_repeat_prints_first_and_median, and in one error case."""
    from moe_runtime.cli import main

    code = main(["forward", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


# The TP ranks sum fp32 partials in another order than the single device: ~1e-6 relative.
@pytest.mark.parametrize("flags", [
    ["--tail", "replicated"], ["--tail", "overlap"], ["--tail", "sharded"], ["--tail", "single_allreduce"],
    ["--sequence-parallel"], ["--preshard-up-proj", "--tail", "sharded"],
])
def test_tp2_every_tail(tiny_ckpt, io, flags, capsys):
    d, ref = io
    out = d / f"o_{'_'.join(f.strip('-') for f in flags)}.safetensors"
    code, stdout, err = in_process(capsys, "--checkpoint", tiny_ckpt, "--layer", 2, "--input", d / "in.safetensors",
                                   "--output", out, "--tp", 2, *flags)
    assert code == 0, err
    assert "TP 2" in stdout
    torch.testing.assert_close(load_file(out)["output"], ref, rtol=1e-5, atol=1e-5)


def test_explain_prints_decision_without_running(tiny_ckpt, capsys):
    code, out, err = in_process(capsys, "--checkpoint", tiny_ckpt, "--layer", 1, "--tp", 2, "--explain")
    assert code == 0, err
    assert "tail plan: T in [1, inf] -> sharded" in out
    code, out, err = in_process(capsys, "--checkpoint", tiny_ckpt, "--layer", 1, "--tp", 1, "--explain")
    assert code == 0 and "TP size is 1" in out and "-> replicated" in out


def test_errors(tiny_ckpt, tmp_path, capsys):
    good = tmp_path / "in.safetensors"
    save_file({"hidden_states": torch.randn(4, 128)}, good)
    out = tmp_path / "o.safetensors"
    bad = tmp_path / "bad.safetensors"
    save_file({"other": torch.randn(4, 128)}, bad)
    res = cli("--checkpoint", tiny_ckpt, "--layer", 1, "--input", bad, "--output", out)  # as a user runs it
    assert res.returncode == 2 and "has no tensor 'hidden_states'" in res.stderr, res.stderr
    cases = {
        "must have shape [T, 128]": {"hidden_states": torch.randn(4, 64)},
        "NaN or Inf": {"hidden_states": torch.full((4, 128), float("nan"))},
        "no tokens": {"hidden_states": torch.randn(0, 128)},
    }
    for message, tensors in cases.items():
        save_file(tensors, bad)
        code, _, err = in_process(capsys, "--checkpoint", tiny_ckpt, "--layer", 1, "--input", bad, "--output", out)
        assert code == 2 and message in err, (message, err)
    code, _, err = in_process(capsys, "--checkpoint", tiny_ckpt, "--layer", 0, "--input", good, "--output", out)
    assert code == 2 and "layer 0 is not a MoE layer" in err
    code, _, err = in_process(capsys, "--checkpoint", tiny_ckpt, "--layer", 1, "--input", good, "--output", out,
                           "--tail", "sharded")
    assert code == 2 and "TP size is 1" in err
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    code, _, err = in_process(capsys, "--checkpoint", tiny_ckpt, "--layer", 1, "--input", tmp_path / "junk.safetensors",
                           "--output", out)
    assert code == 2 and "not a readable safetensors file" in err
    assert not out.exists()  # no error wrote an output


def test_repeat_prints_first_and_median(tiny_ckpt, io, tmp_path, capsys):
    d, ref = io
    out = tmp_path / "o.safetensors"
    res = cli("--checkpoint", tiny_ckpt, "--layer", 2, "--input", d / "in.safetensors", "--output", out,
              "--repeat", 3, "--tp", 2)
    assert res.returncode == 0, res.stderr
    line = [s for s in res.stdout.splitlines() if s.startswith("forward ms:")]
    assert len(line) == 1 and re.fullmatch(r"forward ms: first [\d.]+, median [\d.]+ over 3", line[0]), res.stdout
    torch.testing.assert_close(load_file(out)["output"], ref, rtol=1e-5, atol=1e-5)  # as test_tp2_every_tail
    code, _, err = in_process(capsys, "--checkpoint", tiny_ckpt, "--layer", 2, "--input", d / "in.safetensors",
                           "--output", out, "--repeat", 0)
    assert code == 2 and "--repeat must be at least 1, got 0" in err


def test_forward_times_line() -> None:
    assert forward_times_line([0.5, 0.1, 0.2, 0.3]) == "forward ms: first 500.00, median 250.00 over 4"


def _slow_rank_loads_then_reduces(comm: Collectives, delay_s: float) -> float:
    if comm.rank == 1:
        time.sleep(delay_s)  # the scenario, not a wait: a rank that loads more slowly than its peer
    comm.loaded()
    t = torch.ones(1)
    comm.all_reduce(t)
    return float(t)


def test_collective_timeout_starts_after_load() -> None:
    # rank 1 "loads" 3 s longer than rank 0, the collective timeout is 1 s: the first collective
    # after load must not expire (the wait for the peer's load is under the run timeout).
    res = run_local_group(2, _slow_rank_loads_then_reduces, 3.0, timeout_s=120, collective_timeout_s=1.0)
    assert res == [2.0, 2.0]


def test_random_input_is_seeded_hidden_states_in_the_layer_dtype(tiny_ckpt, tmp_path, capsys):
    from moe_runtime.cli import main, random_input

    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    x = random_input(5, cfg, torch.bfloat16, seed=7)
    assert x.shape == (5, 128) and x.dtype == torch.bfloat16
    assert torch.equal(x, random_input(5, cfg, torch.bfloat16, seed=7))  # seeded
    assert not torch.equal(x, random_input(5, cfg, torch.bfloat16, seed=8))
    # The CLI runs exactly that input (no input file needed): same output as the reference on it.
    out = tmp_path / "o.safetensors"
    assert main(["forward", "--checkpoint", str(tiny_ckpt), "--layer", "2", "--random-input", "5",
                 "--seed", "7", "--output", str(out)]) == 0
    x32 = random_input(5, cfg, torch.float32, seed=7)
    ref = moe_forward(x32, load_layer_weights(tiny_ckpt, cfg, 2), cfg)
    torch.testing.assert_close(load_file(out)["output"], ref, rtol=1e-5, atol=1e-5)
    assert "layer 2: 5 tokens x 128" in capsys.readouterr().out
    # Bad counts and both sources at once are refused.
    assert main(["forward", "--checkpoint", str(tiny_ckpt), "--layer", "2", "--random-input", "0",
                 "--output", str(out)]) == 2
    assert "--random-input needs a positive token count, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["forward", "--checkpoint", str(tiny_ckpt), "--layer", "2", "--random-input", "2",
              "--input", str(out), "--output", str(out)])
    assert "not allowed with argument" in capsys.readouterr().err


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
