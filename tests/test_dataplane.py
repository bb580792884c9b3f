"""The data plane under Serve: live reconfiguration, backpressure, failover (DESIGN §9).

One app for the module, deployed the way ``serve deploy`` does (a config through the Serve
controller, so a changed ``user_config`` is a light update, not a restart): ``pool`` (TP 1,
two replicas: reconfiguration and failover) and ``tight`` (TP 1, one replica with
``max_ongoing_requests = max_queued_requests = 1``: backpressure). TP 1 keeps the module cheap;
the paths under test do not depend on the TP size. The failover test runs last: it breaks a
replica.

Tolerance: TP 1 float32 runs the same ops as the single-device reference, but a batch of
several requests changes the GEMM blocking, so fp32 rounding may differ by a few ulps on O(1)
values; ``rtol = atol = 1e-5`` leaves a ~10x margin.
"""

from __future__ import annotations

import asyncio
import os
import signal
from types import SimpleNamespace

import httpx
import pytest
import torch
from conftest import TEST_APP, serve_deploy
from safetensors.torch import save as st_save
from waiting import wait_until

from deployments.client import MoEClient, MoEOverloadedError
from moe_runtime.checkpoint import load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import moe_forward

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "dataplane_test"
H = 128  # tiny preset
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
BOUND_S = 60.0  # any single request, answered or refused
READY_S = 300.0


def app_config(ckpt, pool_user_config: dict | None = None) -> dict:
    overrides = [] if pool_user_config is None else [{"name": "pool", "user_config": pool_user_config}]
    return {"applications": [{
        "name": APP, "route_prefix": "/", "import_path": "deployments.app:build_app",
        "args": {
            "checkpoint": str(ckpt), "layers": [1], "replica_cpus": 0.25, "collective_timeout_s": 10.0,
            "call_margin_s": 10.0, "health_check_period_s": 2.0, "graceful_shutdown_timeout_s": 1.0,
            "ingress_cpus": 0.05, **TEST_APP,
            "deployments": [
                {"name": "pool", "num_replicas": 2, "max_batch_tokens": 256, "batch_wait_timeout_s": 0.005},
                {"name": "tight", "max_ongoing_requests": 1, "max_queued_requests": 1},
            ],
        },
        "deployments": overrides,
    }]}


@pytest.fixture(scope="module")
def app(tiny_ckpt, serve_ports):
    port = serve_ports.http
    serve_deploy(app_config(tiny_ckpt), wait_for=APP, timeout_s=READY_S)
    cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
    yield SimpleNamespace(cfg=cfg, weights=load_layer_weights(tiny_ckpt, cfg, 1), ckpt=tiny_ckpt,
                          url=f"http://127.0.0.1:{port}", client=MoEClient(APP, timeout_s=BOUND_S))


def rand(T: int, seed: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


def reference(app, x: torch.Tensor) -> torch.Tensor:
    return moe_forward(x, app.weights, app.cfg)


def replica_views(name: str, calls: int = 24) -> dict[str, dict]:
    """Each replica's status, keyed by replica id (the router spreads ``calls`` over them)."""
    direct = MoEClient.direct(name, APP, timeout_s=BOUND_S)
    return {s["replica"]: s for s in (direct.status() for _ in range(calls))}


def test_direct_client_routes_by_layer(app):
    x = rand(5, 0)
    torch.testing.assert_close(app.client.forward(x, 1), reference(app, x), **FP32_TOL)
    # Forwards skip the ingress: the routing table came from it once, the handles are the groups'.
    assert app.client.routes.default == "pool" and set(app.client._groups) == {"pool"}
    tight = MoEClient(APP, deployment="tight", timeout_s=BOUND_S)
    torch.testing.assert_close(tight.forward(x, 1), reference(app, x), **FP32_TOL)
    via = MoEClient(APP, deployment="tight", via_ingress=True, timeout_s=BOUND_S)
    torch.testing.assert_close(via.forward(x, 1), reference(app, x), **FP32_TOL)


def test_user_config_reconfigures_without_restart(app):
    before = replica_views("pool")
    assert len(before) == 2
    assert {v["max_batch_tokens"] for v in before.values()} == {256}
    serve_deploy(app_config(app.ckpt, {"max_batch_tokens": 64, "batch_wait_timeout_s": 0.0,
                                       "max_tokens_per_request": 100}))

    def reconfigured() -> dict | None:
        after = replica_views("pool")
        return after if {v["max_batch_tokens"] for v in after.values()} == {64} and len(after) == 2 else None

    def now() -> str:
        limits = {k: v["max_batch_tokens"] for k, v in replica_views("pool").items()}
        return f"max_batch_tokens 64 on both replicas, now {limits}"

    after = wait_until(reconfigured, timeout_s=READY_S, what=now, every_s=1.0)
    # Same replicas, same worker processes, shards loaded once: a reconfigure, not a restart.
    assert set(after) == set(before)
    for rid in before:
        assert [w["pid"] for w in after[rid]["workers"]] == [w["pid"] for w in before[rid]["workers"]]
        assert after[rid]["batch_wait_timeout_s"] == 0.0 and after[rid]["max_tokens_per_request"] == 100
    with pytest.raises(ValueError, match="max_tokens_per_request = 100"):
        MoEClient.direct("pool", APP, timeout_s=BOUND_S).forward(rand(101, 1), 1)
    x = rand(100, 2)
    torch.testing.assert_close(app.client.forward(x, 1), reference(app, x), **FP32_TOL)


def test_a_live_user_config_change_reaches_lane_calls(app):
    """A lane calls the ranks directly, so the replica pushes a live max_tokens_per_request to
    them; the lane keeps its session across the change (a loop keeps calling meanwhile)."""
    import threading

    from deployments.client import MoERequestError

    limits = {"max_batch_tokens": 64, "batch_wait_timeout_s": 0.0}
    with MoEClient.direct("pool", APP, timeout_s=BOUND_S).lane(max_tokens=50, name="live") as lane:
        x = rand(60, 3)
        torch.testing.assert_close(lane.forward(x, 1), reference(app, x), **FP32_TOL)  # limit 100
        stop = threading.Event()

        def keep_calling() -> None:
            while not stop.is_set():
                lane.forward(rand(1, 4), 1)

        calling = threading.Thread(target=keep_calling)
        calling.start()
        try:
            serve_deploy(app_config(app.ckpt, {**limits, "max_tokens_per_request": 50}))

            def refused() -> MoERequestError | None:
                try:
                    lane.forward(x, 1)
                except MoERequestError as error:
                    return error
                return None

            # Serve reconfigures the replicas one at a time: the lane's ranks refuse 60 tokens
            # once their replica's turn has come.
            err = wait_until(refused, timeout_s=READY_S, every_s=1.0,
                             what="a lane call of 60 tokens refused at max_tokens_per_request 50")
        finally:
            stop.set()
            calling.join(timeout=BOUND_S)
        assert err.status == 413 and "max_tokens_per_request = 50" in str(err), err
        state = lane.status()["deployments"]["pool"]
        assert (state["path"], state["moves"], state["reruns"], state["serve_calls"]) == ("session", 0, 0, 0)
    serve_deploy(app_config(app.ckpt, {**limits, "max_tokens_per_request": 100}), wait_for=APP, timeout_s=READY_S)


def test_backpressure_refuses_at_once_and_never_hangs(app):
    # One request running and one queued per caller; the rest of a burst is refused at once.
    xs = [rand(512, 100 + i) for i in range(24)]
    tight = MoEClient.direct("tight", APP, timeout_s=BOUND_S)

    async def one(x):
        try:
            return await tight.forward_async(x, 1)
        except MoEOverloadedError as e:
            assert e.status == 503 and e.retry_after_s == 1.0
            return e

    async def burst():
        return await asyncio.wait_for(asyncio.gather(*(one(x) for x in xs)), 4 * BOUND_S)

    outs = asyncio.run(burst())
    answered = [(x, o) for x, o in zip(xs, outs, strict=True) if isinstance(o, torch.Tensor)]
    refused = [o for o in outs if isinstance(o, MoEOverloadedError)]
    assert len(answered) + len(refused) == len(xs)
    assert answered and refused, f"{len(answered)} answered, {len(refused)} refused"
    for x, out in answered:
        torch.testing.assert_close(out, reference(app, x), **FP32_TOL)

    async def http_burst():
        body = st_save({"hidden_states": rand(512, 7)})
        async with httpx.AsyncClient(base_url=app.url, timeout=BOUND_S) as http:
            return await asyncio.gather(*(http.post("/v1/tight/layers/1/forward", content=body)
                                          for _ in range(24)))

    responses = asyncio.run(http_burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and "backpressure" in r.json()["error"]


def test_healthz_reports_the_groups(app):
    r = httpx.get(app.url + "/healthz", timeout=BOUND_S)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ok"] and set(body["deployments"]) == {"pool", "tight"}
    assert all(d["healthy"] for d in body["deployments"].values())


def test_killing_a_rank_of_one_replica_costs_no_client_errors(app):
    """Closed-loop load on two replicas; one rank dies; every request still gets its answer."""
    # Both replicas in view: one that a lane (the test above) just released is steered around
    # until it reports itself free.
    def both_seen() -> dict[str, dict] | None:
        views = replica_views("pool")
        return views if len(views) == 2 else None

    views = wait_until(both_seen, timeout_s=READY_S, what="status() from both pool replicas", every_s=1.0)
    victim = next(iter(views.values()))["workers"][0]["pid"]
    x = rand(8, 9)
    ref = reference(app, x)
    client = MoEClient(APP, timeout_s=BOUND_S)
    errors: list[BaseException] = []
    answered = 0

    async def caller(stop: asyncio.Event):
        nonlocal answered
        while not stop.is_set():
            try:
                torch.testing.assert_close(await client.forward_async(x, 1), ref, **FP32_TOL)
                answered += 1
            except Exception as e:
                errors.append(e)

    async def scenario():
        stop = asyncio.Event()
        tasks = [asyncio.create_task(caller(stop)) for _ in range(4)]
        # in a thread: the callers run on this event loop meanwhile
        await asyncio.to_thread(wait_until, lambda: answered or errors, 30, "a first answer before the kill")
        os.kill(victim, signal.SIGKILL)  # one rank of one replica, looked up from status()
        await asyncio.sleep(10.0)  # the scenario, not a wait: the load runs on across the failover
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 2 * BOUND_S)

    asyncio.run(scenario())
    assert answered > 0 and not errors, f"{len(errors)} client errors, first: {errors[:1]}"
