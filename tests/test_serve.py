"""End-to-end Serve tests on a local Ray instance: CPU, gloo, TP groups on *logical* GPUs.

One app for the whole module (starting Ray and two TP groups costs most of the runtime on a
2-core machine): ``decode`` (TP 2, sharded tail, float32, layers 1-2; the default deployment)
and ``prefill`` (TP 2, sequence parallel, bfloat16, layer 2). The worker-death test runs
last because it replaces the ``decode`` replica.

Tolerances: float32 outputs differ from the single-device reference only by the order of
the TP reductions (two partial sums of 32 intermediate columns each, then an all-reduce), a
few fp32 ulps on O(1) values, so ``rtol = atol = 1e-5`` leaves a ~10x margin. bfloat16
(8 significant bits, eps 2**-8): every partial product is rounded to bf16 before the
all-reduce adds it, an error of a few bf16 ulps on O(1) values, hence ``3e-2``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import ray
import torch
from conftest import TEST_APP
from ray import serve
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from waiting import wait_until

from deployments.app import build_app
from deployments.client import AsyncHTTPMoEClient, HTTPMoEClient, MoEClient, MoERequestError, MoEServerError
from deployments.common.workers import WORKER_NAMESPACE
from moe_runtime.checkpoint import load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import moe_forward

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "moe_test"
H = 128  # tiny preset
MAX_BATCH_TOKENS = 256
MAX_TOKENS = 600
COLLECTIVE_TIMEOUT_S = 10.0
CALL_MARGIN_S = 10.0
# A failing request must answer within the group call bound plus the Serve hops.
REQUEST_BOUND_S = COLLECTIVE_TIMEOUT_S + CALL_MARGIN_S + 10.0
# Worker killed -> health check fails 3x (period 1 s) -> new placement group, workers, shards.
RECOVERY_BOUND_S = 120.0
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 3e-2, "atol": 3e-2}


@pytest.fixture(scope="module")
def app(tiny_ckpt, serve_ports):
    port = serve_ports.http
    common = {"tp_size": 2, "max_tokens_per_request": MAX_TOKENS, "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
              "call_margin_s": CALL_MARGIN_S, "health_check_period_s": 1.0,
              "graceful_shutdown_timeout_s": 1.0}
    args = {
        "checkpoint": str(tiny_ckpt),
        **TEST_APP,
        **common,
        "deployments": [
            {"name": "decode", "tail": "sharded", "dtype": "float32", "max_batch_tokens": MAX_BATCH_TOKENS,
             "batch_wait_timeout_s": 0.02},
            {"name": "prefill", "role": "prefill", "sequence_parallel": True, "dtype": "bfloat16",
             "layers": [2], "max_batch_tokens": 1024},
        ],
    }
    serve.run(build_app(args), name=APP, route_prefix="/")
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    weights = {(layer, dt): load_layer_weights(tiny_ckpt, cfg, layer, dt)
               for layer in (1, 2) for dt in (torch.float32, torch.bfloat16)}
    yield SimpleNamespace(cfg=cfg, weights=weights, url=f"http://127.0.0.1:{port}",
                          client=MoEClient(APP, timeout_s=REQUEST_BOUND_S))


def reference(app, x: torch.Tensor, layer: int, router_logits=None) -> torch.Tensor:
    return moe_forward(x, app.weights[(layer, x.dtype)], app.cfg, router_logits_TE=router_logits)


def rand(T: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_status_exposes_the_decisions(app):
    status = app.client.status()
    assert status["default_deployment"] == "decode"
    decode, prefill = status["deployments"]["decode"], status["deployments"]["prefill"]
    assert decode["tp_size"] == 2 and decode["layers"] == [1, 2] and decode["healthy"]
    assert decode["tail_plan"]["tiers"] == [{"max_tokens": None, "tail": "sharded"}]
    assert "every condition" in decode["tail_reason"]
    assert (decode["device"], decode["backend"], decode["dtype"]) == ("cpu", "gloo", "float32")
    assert [w["rank"] for w in decode["workers"]] == [0, 1]
    assert all(w["device"] == "cpu" and w["resident_bytes"] > 0 for w in decode["workers"])
    assert prefill["tail_plan"]["tiers"][0]["tail"] == "sequence_parallel" and prefill["layers"] == [2]
    for key in ("requests", "forwards", "tokens", "batch_tokens", "errors"):
        assert key in decode["counters"]
    with HTTPMoEClient(app.url) as http:
        assert http.status()["deployments"]["prefill"]["dtype"] == "bfloat16"
        assert http.healthz()["ok"]


@pytest.mark.parametrize("layer", [1, 2])
@pytest.mark.parametrize("T", [1, 33, 300])
def test_handle_and_http_match_the_single_device_forward(app, layer, T):
    x = rand(T, seed=T + 10 * layer)
    ref = reference(app, x, layer)
    out = app.client.forward(x, layer)
    assert isinstance(out, torch.Tensor) and out.shape == (T, H) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **FP32_TOL)
    with HTTPMoEClient(app.url) as http:
        torch.testing.assert_close(http.forward(x, layer), ref, **FP32_TOL)  # default route
        torch.testing.assert_close(http.forward(x, layer, deployment="decode"), ref, **FP32_TOL)
    if T == 33:  # numpy in, numpy out
        out_np = app.client.forward(x.numpy(), layer)
        assert isinstance(out_np, np.ndarray) and out_np.dtype == np.float32
        torch.testing.assert_close(torch.from_numpy(out_np.copy()), ref, **FP32_TOL)


@pytest.mark.parametrize("T", [1, 33, 300])
def test_sequence_parallel_bf16_deployment(app, T):
    x = rand(T, seed=100 + T, dtype=torch.bfloat16)
    ref = reference(app, x, 2).float()
    prefill = MoEClient(APP, deployment="prefill", timeout_s=REQUEST_BOUND_S)
    out = prefill.forward(x, 2)  # every rank's rows, gathered in order
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)
    # numpy float32 is rounded to bf16 on the replica and answered as float32
    out_np = prefill.forward(x.float().numpy(), 2)
    assert out_np.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(out_np.copy()), ref, **BF16_TOL)
    with HTTPMoEClient(app.url, deployment="prefill") as http:
        torch.testing.assert_close(http.forward(x, 2).float(), ref, **BF16_TOL)  # BF16 body
        torch.testing.assert_close(http.forward(x.float(), 2).float(), ref, **BF16_TOL)  # F32 body


def test_router_logits_are_honoured(app):
    x = rand(20, seed=7)
    w = app.weights[(1, torch.float32)]
    logits = x @ w.gate_EH.t()
    ref = reference(app, x, 1)
    torch.testing.assert_close(app.client.forward(x, 1, router_logits=logits), ref, **FP32_TOL)
    # Different logits change the routing: the server must use the ones given.
    flipped = -logits
    torch.testing.assert_close(app.client.forward(x, 1, router_logits=flipped),
                               reference(app, x, 1, router_logits=flipped), **FP32_TOL)
    with HTTPMoEClient(app.url) as http:
        torch.testing.assert_close(http.forward(x, 1, router_logits=flipped),
                                   reference(app, x, 1, router_logits=flipped), **FP32_TOL)


def _counters(name: str) -> dict:
    return MoEClient.direct(name, APP, timeout_s=REQUEST_BOUND_S).status()["counters"]


def test_concurrent_requests_are_batched_within_the_token_budget(app):
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(1, 25, size=32)]
    xs = [rand(T, seed=1000 + i) for i, T in enumerate(sizes)]
    direct = MoEClient.direct("decode", APP, timeout_s=REQUEST_BOUND_S)
    solo = [direct.forward(x, 1) for x in xs]  # one at a time: each its own forward
    before = _counters("decode")

    async def burst():
        return await asyncio.gather(*(direct.forward_async(x, 1) for x in xs))

    outs = asyncio.run(burst())
    after = _counters("decode")
    forwards = after["forwards"] - before["forwards"]
    assert after["requests"] - before["requests"] == 32
    assert 1 <= forwards < 32, f"32 concurrent requests ran as {forwards} forwards"
    batches = after["batch_tokens"]["recent"][-forwards:]
    assert sum(batches) == sum(sizes) and max(batches) <= MAX_BATCH_TOKENS, batches
    for x, out, alone in zip(xs, outs, solo, strict=True):
        # Each caller gets exactly its rows: rows are independent, so batching changes only
        # the GEMM blocking (fp32 rounding), not the math.
        assert out.shape == x.shape
        torch.testing.assert_close(out, alone, **FP32_TOL)
        torch.testing.assert_close(out, reference(app, x, 1), **FP32_TOL)


def test_layers_never_share_a_forward_and_oversize_requests_run_alone(app):
    xs = [(1 + i % 2, rand(8, seed=2000 + i)) for i in range(16)]
    big = rand(MAX_BATCH_TOKENS + 44, seed=3000)  # over max_batch_tokens, within max_tokens_per_request
    direct = MoEClient.direct("decode", APP, timeout_s=REQUEST_BOUND_S)
    before = _counters("decode")

    async def burst():
        small = [direct.forward_async(x, layer) for layer, x in xs]
        return await asyncio.gather(direct.forward_async(big, 1), *small)

    big_out, *outs = asyncio.run(burst())
    after = _counters("decode")
    torch.testing.assert_close(big_out, reference(app, big, 1), **FP32_TOL)
    for (layer, x), out in zip(xs, outs, strict=True):
        torch.testing.assert_close(out, reference(app, x, layer), **FP32_TOL)
    assert after["solo_oversize_requests"] - before["solo_oversize_requests"] == 1
    per_layer = {
        layer: {k: after["by_layer"][layer][k] - before["by_layer"].get(layer, {}).get(k, 0)
                for k in ("forwards", "tokens", "requests")}
        for layer in ("1", "2")
    }
    assert per_layer["1"]["tokens"] == 8 * 8 + big.shape[0] and per_layer["2"]["tokens"] == 8 * 8
    assert per_layer["1"]["requests"] == 9 and per_layer["2"]["requests"] == 8
    forwards = after["forwards"] - before["forwards"]
    assert per_layer["1"]["forwards"] + per_layer["2"]["forwards"] == forwards


def test_http_concurrency(app):
    xs = [rand(5, seed=4000 + i) for i in range(16)]

    async def burst():
        async with AsyncHTTPMoEClient(app.url) as http:
            return await asyncio.gather(*(http.forward(x, 2) for x in xs))

    for x, out in zip(xs, asyncio.run(burst()), strict=True):
        torch.testing.assert_close(out, reference(app, x, 2), **FP32_TOL)


# -- bad input (DESIGN §5.2): a clear error, and the replica keeps serving ------------------

BAD_HANDLE_INPUTS = {
    "wrong width": (lambda: rand(4, 0)[:, :64], 1, None, 400, r"must have shape \[T, 128\], got \[4, 64\]"),
    "wrong torch dtype": (lambda: rand(4, 0).double(), 1, None, 400, "dtype is torch.float64"),
    "bf16 into fp32": (lambda: rand(4, 0).bfloat16(), 1, None, 400, "this layer runs in torch.float32"),
    "numpy float64": (lambda: rand(4, 0).double().numpy(), 1, None, 400, "must be float32"),
    "not a tensor": (lambda: [[0.0] * H], 1, None, 400, "numpy array or a torch tensor, got list"),
    "NaN": (lambda: rand(4, 0).index_fill_(0, torch.tensor([2]), float("nan")), 1, None, 400, "NaN or Inf"),
    "Inf": (lambda: rand(4, 0).index_fill_(0, torch.tensor([1]), float("inf")), 1, None, 400, "NaN or Inf"),
    "no tokens": (lambda: torch.zeros(0, H), 1, None, 400, r"no tokens \(T == 0\)"),
    "too many tokens": (lambda: rand(MAX_TOKENS + 1, 0), 1, None, 413, "more than max_tokens_per_request = 600"),
    "unknown layer": (lambda: rand(4, 0), 7, None, 404, "unknown layer 7"),
    "dense layer": (lambda: rand(4, 0), 0, None, 404, "layer 0 is not a MoE layer"),
    "router logits shape": (lambda: rand(4, 0), 1, torch.zeros(4, 3), 400, r"router_logits must have shape \[4, 8\]"),
    "router logits NaN": (lambda: rand(2, 0), 1, torch.full((2, 8), float("nan")), 400, "router_logits contains NaN"),
}


@pytest.mark.parametrize("case", list(BAD_HANDLE_INPUTS))
def test_bad_input_through_the_handle(app, case):
    make, layer, logits, status, message = BAD_HANDLE_INPUTS[case]
    with pytest.raises(MoERequestError, match=message) as info:
        app.client.forward(make(), layer, router_logits=logits)
    assert info.value.status == status
    x = rand(3, 1)
    torch.testing.assert_close(app.client.forward(x, 1), reference(app, x, 1), **FP32_TOL)


def test_layer_not_served_and_unknown_deployment(app):
    prefill = MoEClient(APP, deployment="prefill", timeout_s=REQUEST_BOUND_S)
    with pytest.raises(MoERequestError, match=r"layer 1 is not served by deployment 'prefill'") as info:
        prefill.forward(rand(2, 0).bfloat16(), 1)
    assert info.value.status == 404
    with pytest.raises(MoERequestError, match="unknown deployment 'nope'") as info:
        MoEClient(APP, deployment="nope", timeout_s=REQUEST_BOUND_S).forward(rand(2, 0), 1)
    assert info.value.status == 404


def _body(**tensors) -> bytes:
    return st_save(tensors)


BAD_HTTP = {
    "malformed body": ("/v1/layers/1/forward", b"not safetensors at all", 400, "not a valid safetensors"),
    "empty body": ("/v1/layers/1/forward", b"", 400, "empty body"),
    "missing tensor": ("/v1/layers/1/forward", _body(router_logits=torch.zeros(2, 8)), 400,
                       "missing tensor 'hidden_states'"),
    "unexpected tensor": ("/v1/layers/1/forward", _body(hidden_states=torch.zeros(2, H), x=torch.zeros(1)), 400,
                          "unexpected tensor"),
    "wrong width": ("/v1/layers/1/forward", _body(hidden_states=torch.zeros(2, 7)), 400, "must have shape"),
    "wrong dtype": ("/v1/layers/1/forward", _body(hidden_states=torch.zeros(2, H, dtype=torch.float16)), 400,
                    "dtype is torch.float16, this layer runs in torch.float32"),
    "int dtype": ("/v1/layers/1/forward", _body(hidden_states=torch.zeros(2, H, dtype=torch.int32)), 400,
                  "dtype is torch.int32"),
    "NaN": ("/v1/layers/1/forward", _body(hidden_states=torch.full((2, H), float("nan"))), 400, "NaN or Inf"),
    "no tokens": ("/v1/layers/1/forward", _body(hidden_states=torch.zeros(0, H)), 400, "no tokens"),
    "too many tokens": ("/v1/layers/1/forward", _body(hidden_states=torch.zeros(MAX_TOKENS + 1, H)), 413,
                        "max_tokens_per_request"),
    "body too large": ("/v1/layers/1/forward", b"\x00" * (2 << 20), 413, "exceeds the limit"),
    "unknown layer": ("/v1/layers/9/forward", _body(hidden_states=torch.zeros(2, H)), 404, "unknown layer 9"),
    "dense layer": ("/v1/layers/0/forward", _body(hidden_states=torch.zeros(2, H)), 404, "not a MoE layer"),
    "layer not a number": ("/v1/layers/abc/forward", _body(hidden_states=torch.zeros(2, H)), 404,
                           "layer must be an integer"),
    "unknown deployment": ("/v1/nope/layers/1/forward", _body(hidden_states=torch.zeros(2, H)), 404,
                           "unknown deployment 'nope'"),
    "layer not served": ("/v1/prefill/layers/1/forward", _body(hidden_states=torch.zeros(2, H)), 404,
                         "not served by deployment 'prefill'"),
    "bad router logits": ("/v1/layers/1/forward",
                          _body(hidden_states=torch.zeros(2, H), router_logits=torch.zeros(2, 9)), 400,
                          "router_logits must have shape"),
    "unknown route": ("/v2/whatever", b"", 404, "no route POST /v2/whatever"),
}


@pytest.mark.parametrize("case", list(BAD_HTTP))
def test_bad_input_over_http(app, case):
    path, body, status, message = BAD_HTTP[case]
    r = httpx.post(app.url + path, content=body, timeout=REQUEST_BOUND_S)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()
    assert message in err["error"] and err["status"] == status
    x = rand(3, 2)
    good = httpx.post(app.url + "/v1/layers/1/forward", content=_body(hidden_states=x), timeout=REQUEST_BOUND_S)
    assert good.status_code == 200
    torch.testing.assert_close(st_load(good.content)["output"], reference(app, x, 1), **FP32_TOL)


@pytest.mark.parametrize("deployment", ["ingress", "decode", "prefill"])
def test_the_replicas_never_load_torch(app, deployment):
    """After the tests above (handle and HTTP calls, F32 and BF16 bodies, bad input), neither the
    ingress replica nor a group replica has mapped torch's library: the ingress converts bodies
    with numpy, a group replica checks, rounds, batches and splits rows with numpy (its ranks
    compute). A handle caller's torch tensor would load it; the clients send WireTensors."""
    title = f"ServeReplica:{APP}:{deployment}".encode()  # in its process title, whatever it runs
    pids = [p.parent for p in Path("/proc").glob("[0-9]*/cmdline") if title in read_or_empty(p)]
    assert pids, f"no process titled {title!r}"
    for proc in pids:
        assert "libtorch" not in (proc / "maps").read_text(), f"{proc} maps libtorch"


def read_or_empty(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a process that ended meanwhile
        return b""


def test_client_errors_are_counted_not_fatal(app):
    before = _counters("decode")
    with pytest.raises(MoERequestError):
        app.client.forward(rand(2, 0)[:, :3], 1)
    after = _counters("decode")
    assert after["errors"]["client"] == before["errors"]["client"] + 1
    assert after["errors"]["server"] == before["errors"]["server"]


# -- failure: keep last, it replaces the decode replica -----------------------------------


def test_a_dead_worker_gets_the_replica_replaced(app):
    direct = MoEClient.direct("decode", APP, timeout_s=REQUEST_BOUND_S)
    before = direct.status()
    victim = before["workers"][1]["name"]
    x = rand(16, seed=5)
    ref = reference(app, x, 1)
    results: list[tuple[float, float, BaseException | None]] = []

    async def caller(stop: asyncio.Event):
        # Keep requests in flight across the kill; each one is bounded and must not hang.
        while not stop.is_set():
            start = time.monotonic()
            try:
                out = await direct.forward_async(x, 1)
                torch.testing.assert_close(out, ref, **FP32_TOL)
                err = None
            except MoEServerError as e:
                err = e
                await asyncio.sleep(0.2)  # a caller's back-off before its next request, not a wait
            results.append((start, time.monotonic(), err))

    def replaced() -> bool:
        try:
            return direct.status()["replica"] != before["replica"]
        except Exception:  # noqa: BLE001 -- no replica answers yet; the loop's bound is asserted below
            return False

    async def scenario() -> tuple[float, float]:
        stop = asyncio.Event()
        callers = [asyncio.create_task(caller(stop)) for _ in range(4)]
        # in a thread: the callers run on this event loop meanwhile
        await asyncio.to_thread(wait_until, lambda: results, 30, "a first answer before the kill")
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(victim, namespace=WORKER_NAMESPACE), no_restart=True)
        recovered_at = None
        # Polled here, not by wait_until: a timeout is asserted below, once the callers stopped.
        while time.monotonic() - killed_at < RECOVERY_BOUND_S:
            await asyncio.sleep(0.5)
            # ray.kill returns before the rank is gone: a request started just after it may
            # still succeed, so recovery is an answer that started after the last failure
            failed = [s for s, e, err in results if err is not None]
            ok_since = [e for s, e, err in results if err is None and failed and s > max(failed)]
            # ... and Serve has replaced the replica: requests still in flight on the old one
            # when the first failures came back can end after them, answered or not
            if ok_since and await asyncio.to_thread(replaced):
                recovered_at = min(ok_since)
                break
        stop.set()
        await asyncio.gather(*callers)
        return killed_at, recovered_at

    killed_at, recovered_at = asyncio.run(scenario())
    errors = [err for _, _, err in results if err is not None]
    assert errors, "killing a worker made no request fail"
    assert any("rank 1 died" in e.message for e in errors), [e.message for e in errors]
    # the dead rank is the cause given, not Ray's TypeError from reading the broken channel
    assert not any("not iterable" in e.message for e in errors), [e.message for e in errors]
    assert all(e.status in (503, 504) for e in errors), [(e.status, e.message) for e in errors]
    assert recovered_at is not None, (
        f"no successful request within {RECOVERY_BOUND_S} s of the kill: "
        f"{[(round(s - killed_at, 1), err and err.message) for s, _, err in results if s > killed_at][-8:]}"
    )
    # every failed request was ended by the tier (its group's bound or the dead rank), none by the
    # client giving up on it
    assert not any(e.kind in ("TimeoutError", "GetTimeoutError") for e in errors), [e.message for e in errors]
    after = direct.status()
    assert after["replica"] != before["replica"] and after["healthy"]
    assert {w["name"] for w in after["workers"]}.isdisjoint({w["name"] for w in before["workers"]})
    print(f"replica replaced {recovered_at - killed_at:.1f} s after the kill")
    torch.testing.assert_close(direct.forward(x, 1), ref, **FP32_TOL)
