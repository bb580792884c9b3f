"""Serving a Qwen3-MoE or DeepSeek-V3 model folder (``moe_runtime.standard``) with the same app.

One app per family, on a tiny synthetic folder (``moe_runtime.standard.synthetic``, fp32), each
with two deployments over every MoE layer: ``tp1`` (the default) and ``tp2``. Each path -- the
Serve handle, HTTP, a session's peers -- is compared with ``standard_moe_forward`` on the
unsharded weights; the folder's kind is detected from its ``config.json``; a dense or unknown
layer gets the latent app's unknown-layer error; a latent-only option is refused at build time.

Tolerance: fp32 throughout. At TP 1 a rank runs the reference's own ops, but a batch's row count
changes the GEMM blocking, so results may differ by a few fp32 ulps; at TP 2 each rank sums its
16 of the 32 intermediate columns of every expert (and of the shared MLP) and one all-reduce adds
the two partials, a different summation order: again a few ulps of O(1) outputs (the experts'
weights are scaled by 1/sqrt(fan-in)). ``rtol = atol = 1e-5`` is ~10x that, and far below what a
wrong expert, weight or shard would cost (O(0.1)).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import torch
from conftest import TEST_APP
from ray import serve
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from deployments.app import build_app, decide_app
from deployments.client import MoEClient, MoERequestError, SessionTicket, join
from moe_runtime.families import LATENT_MOE, layer_family, load_layer_config
from moe_runtime.standard import load_standard_layer, standard_moe_forward
from moe_runtime.standard.synthetic import standard_preset, write_standard_checkpoint

H = 64  # both presets' hidden_size
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
BOUND_S = 60.0  # any single call, answered or refused
APPS = {"qwen3_moe": "std_qwen", "deepseek_v3": "std_dsv3"}
DEPLOYMENTS = ("tp1", "tp2")
CASES = [(family, dep) for family in APPS for dep in DEPLOYMENTS]


def folder_of(tmp_path_factory: pytest.TempPathFactory, family: str):
    return write_standard_checkpoint(tmp_path_factory.mktemp(family), standard_preset(family), seed=3)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    return {family: folder_of(tmp_path_factory, family) for family in APPS}


@pytest.fixture(scope="module")
def apps(folders, serve_ports) -> dict:
    """Both apps, with their folders' configs and unsharded fp32 weights for the reference."""
    out = {}
    for family, app in APPS.items():
        folder = folders[family]
        args = {
            "checkpoint": str(folder), **TEST_APP, "replica_cpus": 0.25, "max_tokens_per_request": 64,
            "collective_timeout_s": 10.0, "call_margin_s": 10.0, "health_check_period_s": 2.0,
            "graceful_shutdown_timeout_s": 1.0,
            "deployments": [{"name": "tp1", "tp_size": 1}, {"name": "tp2", "tp_size": 2}],
        }
        serve.run(build_app(args), name=app, route_prefix=f"/{app}")
        cfg = load_layer_config(folder)
        out[family] = SimpleNamespace(
            app=app, cfg=cfg, url=f"http://127.0.0.1:{serve_ports.http}/{app}",
            weights={layer: load_standard_layer(folder, cfg, layer) for layer in cfg.moe_layers},
        )
    return out


def rows(T: int, seed: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


def reference(a: SimpleNamespace, x: torch.Tensor, layer: int, logits: torch.Tensor | None = None) -> torch.Tensor:
    return standard_moe_forward(x, a.weights[layer], a.cfg, router_logits_TE=logits)


# -- without Ray: the folder's kind, the controller's decision ------------------------------------


def test_the_folder_says_which_layer_family_it_holds(folders, tiny_ckpt, tmp_path):
    assert {family: layer_family(folder) for family, folder in folders.items()} == {f: f for f in APPS}
    assert layer_family(tiny_ckpt) == LATENT_MOE
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"architectures=\['LlamaForCausalLM'\], model_type='llama'.*nor a "
                                         r"latent-MoE checkpoint"):
        layer_family(tmp_path)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):  # the app refuses it at build time
        decide_app({"checkpoint": str(tmp_path)})


@pytest.mark.parametrize("family", list(APPS))
def test_the_decision_is_the_one_fixed_plan(folders, family):
    _, resolved, (decision,) = decide_app({"checkpoint": str(folders[family]), "tp_size": 2})
    d = decision.to_dict()
    assert d["layer_family"] == family and d["candidates"] == ["standard"] and not d["sharded_legal"]
    assert d["choice"] == "T in [1, inf] -> standard" and d["measure"] is None
    assert d["reason"].startswith(f"{family} MoE layer: one fixed plan (one all-reduce")
    assert "latent layer's tails do not apply" in d["reason"]
    assert resolved[0].hidden_size == H and resolved[0].layers == tuple(load_layer_config(folders[family]).moe_layers)
    _, _, (tp1,) = decide_app({"checkpoint": str(folders[family]), "tp_size": 1})
    assert "TP 1: no collective" in tp1.reason


@pytest.mark.parametrize("option", [{"tail": "sharded"}, {"tail": "single_allreduce"}, {"sequence_parallel": True},
                                    {"preshard_up_proj": True}, {"experts_activation_quant": "mxfp4"},
                                    {"experts_format": "mxfp4"}], ids=lambda o: "-".join(map(str, o.values())))
def test_a_latent_only_option_is_refused(folders, option):
    (name, value), = option.items()
    with pytest.raises(ValueError, match=rf"deployment 'moe': {name}={value!r}: latent-MoE only; .* is a "
                                         r"deepseek_v3 model folder"):
        decide_app({"checkpoint": str(folders["deepseek_v3"]), "tp_size": 2, **option})


def test_a_dense_layer_is_refused_at_build_time(folders):
    with pytest.raises(ValueError, match=r"layer 0 is not a MoE layer \(a dense layer of this deepseek_v3 model\); "
                                         r"MoE layers: \[1, 2\]"):
        decide_app({"checkpoint": str(folders["deepseek_v3"]), "layers": [0]})


# -- served ----------------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("family,deployment", CASES)
def test_status_reports_the_family_its_plan_and_hidden_size(apps, family, deployment):
    a = apps[family]
    st = MoEClient.direct(deployment, a.app, timeout_s=BOUND_S).status()
    assert st["layers"] == a.cfg.moe_layers and st["tp_size"] == int(deployment[-1])
    assert st["controller"]["layer_family"] == family and st["tail_plan"]["describe"] == "T in [1, inf] -> standard"
    assert [w["hidden_size"] for w in st["workers"]] == [H] * st["tp_size"]
    assert all(w["resident_bytes_by_part"]["experts_dense"] > 0 for w in st["workers"])


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("family,deployment", CASES)
def test_handle_and_http_match_the_single_device_forward(apps, family, deployment):
    a = apps[family]
    client = MoEClient(a.app, deployment=deployment, timeout_s=BOUND_S)
    for layer in a.cfg.moe_layers:
        for T in (1, 7):
            x = rows(T, 100 * layer + T)
            torch.testing.assert_close(client.forward(x, layer), reference(a, x, layer), **FP32_TOL)
        x = rows(5, layer)
        logits = rows(5, 50 + layer)[:, : a.cfg.num_experts]  # the caller's router logits are honoured
        torch.testing.assert_close(client.forward(x, layer, router_logits=logits), reference(a, x, layer, logits),
                                   **FP32_TOL)
        r = httpx.post(f"{a.url}/v1/{deployment}/layers/{layer}/forward", content=st_save({"hidden_states": x}),
                       timeout=BOUND_S)
        assert r.status_code == 200, r.text
        torch.testing.assert_close(st_load(r.content)["output"], reference(a, x, layer), **FP32_TOL)
    tails = MoEClient.direct(deployment, a.app, timeout_s=BOUND_S).status()["counters"]["tails"]
    assert set(tails) == {"standard"}, tails  # the one plan ran every forward


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("family,deployment", CASES)
def test_a_sessions_peers_get_the_single_device_forward(apps, family, deployment):
    """Two peers (as separate processes would, from the ticket's JSON) step through every layer;
    each gets the reference on its own rows of the one forward per layer."""
    a = apps[family]
    layers = a.cfg.moe_layers
    with MoEClient(a.app, deployment=deployment, timeout_s=BOUND_S).session(peers=2, max_tokens=4) as session:
        ticket = SessionTicket.from_json(session.ticket.to_json())
        assert {g.hidden_size for g in ticket.groups} == {H} and ticket.layers == tuple(layers)
        peers = [join(ticket, i) for i in range(2)]

        def step(i: int) -> int:
            for layer in layers:
                x = rows(i + 2, 1000 * i + layer)  # 2 and 3 rows: one forward of 5 per layer
                torch.testing.assert_close(peers[i].forward(x, layer), reference(a, x, layer), **FP32_TOL)
            return len(layers)

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(step, range(2))) == [len(layers)] * 2
        with pytest.raises(MoERequestError, match="not one of session") as refused:  # a dense layer
            peers[0].forward(rows(1, 0), 0)
        assert refused.value.status == 404
        for p in peers:
            p.close()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("family", list(APPS))
def test_a_lane_calls_over_its_session(apps, family):
    """A lane (a session of one peer, the caller) at TP 2: every call over the data plane, none
    on the Serve path, each the reference."""
    a = apps[family]
    with MoEClient(a.app, deployment="tp2", timeout_s=BOUND_S).lane(max_tokens=8) as lane:
        for layer in a.cfg.moe_layers:
            x = rows(3, 70 + layer)
            torch.testing.assert_close(lane.forward(x, layer), reference(a, x, layer), **FP32_TOL)
        st = lane.status()["deployments"]["tp2"]
    assert st["path"] == "session" and st["session_calls"] == len(a.cfg.moe_layers) and st["serve_calls"] == 0, st


@pytest.mark.ray
@pytest.mark.slow
def test_dense_and_unknown_layers_get_the_unknown_layer_error(apps):
    a = apps["deepseek_v3"]  # layer 0 is dense (first_k_dense_replace = 1); the model has layers 0..2
    client = MoEClient(a.app, deployment="tp2", timeout_s=BOUND_S)
    for layer, message in ((0, r"layer 0 is not a MoE layer \(a dense layer of this deepseek_v3 model\)"),
                           (9, "unknown layer 9: the model has layers 0..2")):
        with pytest.raises(MoERequestError, match=message) as info:
            client.forward(rows(2, 0), layer)
        assert info.value.status == 404
        r = httpx.post(f"{a.url}/v1/layers/{layer}/forward", content=st_save({"hidden_states": rows(2, 0)}),
                       timeout=BOUND_S)
        assert r.status_code == 404 and r.json()["status"] == 404, r.text
    assert "not a MoE layer" in httpx.post(f"{a.url}/v1/layers/0/forward", content=st_save(
        {"hidden_states": rows(2, 0)}), timeout=BOUND_S).json()["error"]
