"""The disaggregated decoder (examples/afd.py): in process against itself, then through a real
local Serve app against the same model with ``moe_forward`` in process.

Tolerances (float32 everywhere; logits are O(1..10)):
* in process, the same math in another order (a row alone vs in a padded batch, the KV cache vs
  a full recompute, one micro-batch vs several): only the summation order of the GEMMs and of
  attention's softmax changes, a few fp32 ulps per op; measured <= 4e-6 on the logits, so
  ``1e-4`` leaves a ~25x margin.
* through the tier: the TP-2 group sums the experts' partial products in another order (DESIGN
  §4; a few ulps per MoE layer, as tests/test_serve.py), then the later layers and the LM head
  carry that on; ``1e-4`` again. Greedy tokens must be identical: the smallest top-1/top-2 logit
  gap of these prompts is ~1e-3, ten times the tolerance.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TEST_APP
from ray import serve
from waiting import wait_until

from deployments.app import build_app
from deployments.config.timeouts import EVENTS_PUSH_S
from examples.afd import Decoder, LocalMoE, RemoteMoE, split_rows, tier_busy
from examples.synthetic_decoder import write_decoder
from moe_runtime.synthetic import preset_config, write_checkpoint

TOL = {"rtol": 1e-4, "atol": 1e-4}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [100]]
NEW_TOKENS = 5
APP = "afd_test"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # Tiny matmuls: a second OpenMP thread only spins against the tier's ranks and other work on
    # a small shared machine (this module: 162 s with torch's default threads, 68 s with one).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = write_checkpoint(tmp_path_factory.mktemp("afd"), preset_config("tiny"), seed=1)
    write_decoder(root, seed=1)
    return root


@pytest.fixture(scope="module")
def local(ckpt):
    """The whole model in this process; its greedy output is the reference."""
    model = Decoder(ckpt, LocalMoE(ckpt))
    return model, model.generate(PROMPTS, NEW_TOKENS)


def test_rows_are_independent_of_padding_and_micro_batches(local):
    model, ref = local
    for b, prompt in enumerate(PROMPTS):
        alone = model.generate([prompt], NEW_TOKENS)
        assert torch.equal(alone.tokens[0], ref.tokens[b])
        torch.testing.assert_close(alone.logits[0], ref.logits[b], **TOL)
    for m in (2, 4):
        out = model.generate(PROMPTS, NEW_TOKENS, micro_batches=m)
        assert torch.equal(out.tokens, ref.tokens)
        torch.testing.assert_close(out.logits, ref.logits, **TOL)


def test_kv_cache_matches_a_full_recompute(local):
    model, ref = local
    for b, prompt in enumerate(PROMPTS):
        # Prefill the prompt plus all but the last generated token: its logits are the last step's.
        again = model.generate([prompt + ref.tokens[b, :-1].tolist()], 1)
        torch.testing.assert_close(again.logits[0, 0], ref.logits[b, -1], **TOL)


def test_the_moe_layers_change_the_output(ckpt, local):
    # Guards the comparisons above against a decoder that skipped its MoE layers.
    _, ref = local

    class Zero(LocalMoE):
        async def __call__(self, x_TH, layer):
            return torch.zeros_like(x_TH)

    out = Decoder(ckpt, Zero(ckpt)).generate(PROMPTS, NEW_TOKENS)
    assert (out.logits[:, 0] - ref.logits[:, 0]).abs().max() > 1e-2


def test_split_rows():
    assert split_rows(5, 2) == [slice(0, 2), slice(2, 5)]
    assert [s.stop - s.start for s in split_rows(32, 4)] == [8] * 4


@pytest.mark.parametrize(
    "prompts, new, m, message",
    [
        ([], 2, 1, "prompts is empty"),
        ([[1], []], 2, 1, "prompt 1 is empty"),
        ([[1, 512]], 2, 1, "outside 0..511"),
        ([[1]], 0, 1, "max_new_tokens must be >= 1"),
        ([[1], [2]], 2, 3, r"micro_batches must be in 1..2"),
    ],
)
def test_bad_generation_input(local, prompts, new, m, message):
    with pytest.raises(ValueError, match=message):
        local[0].generate(prompts, new, micro_batches=m)


def test_config_and_layer_errors(ckpt, tmp_path):
    bare = write_checkpoint(tmp_path / "bare", preset_config("tiny"), seed=1)
    with pytest.raises(ValueError, match="lacks decoder field"):
        Decoder(bare, LocalMoE(bare))
    with pytest.raises(ValueError, match=r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        write_decoder(bare, num_key_value_heads=3)
    with pytest.raises(ValueError, match="decoder field head_dim must be a positive integer, got 31.5"):
        write_decoder(bare, head_dim=31.5)
    partial = LocalMoE(ckpt)
    partial.layers = frozenset({1})
    with pytest.raises(ValueError, match=r"MoE layer\(s\) \[2\] of the model are not served"):
        Decoder(ckpt, partial)


def test_decoder_file_joins_a_single_file_checkpoint(tmp_path):
    root = write_checkpoint(tmp_path / "one", preset_config("tiny"), seed=1, single_file=True, text_only=True)
    write_decoder(root, seed=1)
    weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map["model.layers.1.block_sparse_moe.gate.weight"] == "model.safetensors"
    assert weight_map["lm_head.weight"] == "model-decoder.safetensors"
    assert Decoder(root, LocalMoE(root)).generate([[3, 4]], 2).tokens.shape == (1, 2)


def test_make_checkpoint_decoder_flag(tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_checkpoint.py"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), "--preset", "tiny", *args],
                              capture_output=True, text=True, timeout=300)

    assert run("--out", str(tmp_path / "a"), "--decoder").returncode == 0
    text = json.loads((tmp_path / "a" / "config.json").read_text())["text_config"]
    assert (text["vocab_size"], text["num_attention_heads"], text["num_key_value_heads"]) == (512, 4, 2)
    bad = run("--out", str(tmp_path / "b"), "--decoder", "--config-only")
    assert bad.returncode != 0 and "cannot go with --config-only" in bad.stderr


# -- through a real Serve app ------------------------------------------------------------------


@pytest.fixture(scope="module")
def afd_app(ckpt, serve_ports) -> str:
    """Layers split over two deployments (layer 1 on a TP-2 group, layer 2 on TP 1), so the
    decoder must route by layer; float32 so the comparison is tight."""
    common = {"dtype": "float32", "tail": "replicated", "batch_wait_timeout_s": 0.0, "replica_cpus": 0.5}
    serve.run(build_app({"checkpoint": str(ckpt), **TEST_APP, "deployments": [
        {"name": "lo", "tp_size": 2, "layers": [1], **common},
        {"name": "hi", "tp_size": 1, "layers": [2], **common},
    ]}), name=APP, route_prefix="/")
    return APP


@pytest.fixture
def tier(afd_app):
    """The app through lanes (the default), released after the test."""
    with RemoteMoE.connect(afd_app, timeout_s=60.0) as tier:
        yield tier


@pytest.mark.ray
@pytest.mark.slow
def test_generation_through_the_tier_is_exact_for_every_m(ckpt, local, tier):
    _, ref = local
    routes = tier.client.layer_routes()  # the app's routing table, as RemoteMoE's calls use it
    assert (routes.choose(1), routes.choose(2)) == ("lo", "hi")
    before = tier.deployment_statuses()
    model = Decoder(ckpt, tier)
    for m in (1, 2, 4):
        out = model.generate(PROMPTS, NEW_TOKENS, micro_batches=m)
        assert torch.equal(out.tokens, ref.tokens), f"m={m}"
        torch.testing.assert_close(out.logits, ref.logits, **TOL, msg=f"m={m}")
    lanes = tier.lane.status()["deployments"]
    assert {n: (d["path"], d["serve_calls"]) for n, d in lanes.items()} == {"lo": ("session", 0),
                                                                           "hi": ("session", 0)}

    def counted() -> dict | None:  # status() reads rank 0's session counts live
        after = tier.deployment_statuses()
        done = all(n > 0 and s > 0 for n, s in (tier_busy(before[d], after[d]) for d in ("lo", "hi")))
        return after if done else None

    after = wait_until(counted, timeout_s=30, what="the lanes' forwards in both replicas' counters",
                       every_s=EVENTS_PUSH_S / 4)
    for name, layer in (("lo", "1"), ("hi", "2")):
        forwards, busy_s = tier_busy(before[name], after[name])
        assert forwards > 0 and busy_s > 0
        assert list(after[name]["counters"]["by_layer"]) == [layer]  # each layer went to its own group


@pytest.mark.ray
@pytest.mark.slow
def test_decoders_as_one_cohort_are_token_identical(ckpt, local, afd_app):
    """M decoders (Ray actors, prompts of their own) decode as one cohort, every step one step of
    their session; each one's tokens equal the in-process model's on its prompts (M = 1 and 4)."""
    import ray

    from deployments.client import MoEClient
    from examples.afd import DecoderWorker

    model, _ = local
    for M in (1, 4):
        prompts = [PROMPTS[i:] + PROMPTS[:i] for i in range(M)]  # each worker's own batch order
        actors = [ray.remote(DecoderWorker).options(num_cpus=0).remote(str(ckpt), p, NEW_TOKENS)
                  for p in prompts]
        try:
            ray.get([a.__ray_ready__.remote() for a in actors], timeout=120)  # their models loaded
            rows = sum(map(len, PROMPTS))  # the prefill step sends every prompt token's rows
            client = MoEClient(afd_app, timeout_s=60)
            # a loaded machine: wait for the groups (free of the test before) instead of the Serve path
            with client.cohort(actors, max_tokens=rows, wait_s=60, name=f"dec{M}") as cohort:
                steps = [cohort.step([None] * M) for _ in range(NEW_TOKENS)]
                status = cohort.status()
            made = ray.get([a.generation.remote() for a in actors], timeout=60)
        finally:
            for a in actors:
                ray.kill(a)
        assert (status["session_steps"], status["serve_steps"]) == (NEW_TOKENS, 0), status["deployments"]
        for i, (got, p) in enumerate(zip(made, prompts, strict=True)):
            ref = model.generate(p, NEW_TOKENS)
            assert torch.equal(got.tokens, ref.tokens), (M, i)
            torch.testing.assert_close(got.logits, ref.logits, **TOL, msg=f"M={M}, worker {i}")
            assert [s[i] for s in steps] == ref.tokens.T.tolist()  # what each step returned
