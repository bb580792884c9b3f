"""Lanes (deployments/client/lane.py, deployments/serve/lanes.py): per-layer calls of a client on
the data plane of a leased TP group, against the Serve path of the same replicas.

Exactness is bit for bit: a lane call runs the same runner with the same tail plan on the same
ranks as a lone Serve request, so ``torch.equal`` (no tolerance). One reference check against
the single-device math (float32, TP 1: rtol/atol 1e-5, a few fp32 ulps of summation order as in
tests/test_serve.py) keeps the comparison from passing on a shared mistake.

The TP-2 deployments run ``tail: auto`` with a scripted warm-up clock (as tests/test_controller.py)
that makes a different tail win each token range, so one deployment per dtype runs every tail;
the sequence-parallel deployments run the fifth.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deployments.config.timeouts import LANE_POLL_S
from moe_runtime.tp.tuning import current_measurement

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "lane_test"
H = 128  # tiny preset
TUNE_TOKENS = [1, 4, 16, 256]
COST_MS = {  # a different tail wins each measured count
    "single_allreduce": {1: 1.0, 4: 9.0, 16: 9.0, 256: 90.0},
    "overlap": {1: 2.0, 4: 2.0, 16: 9.0, 256: 90.0},
    "replicated": {1: 3.0, 4: 3.0, 16: 3.0, 256: 90.0},
    "sharded": {1: 4.0, 4: 4.0, 16: 4.0, 256: 5.0},
}
TAIL_AT = {1: "single_allreduce", 3: "overlap", 16: "replicated", 40: "sharded"}
_fake_now = [0.0]


def scripted_clock() -> float:
    """Injected tune clock: every timed sample of (tail, tokens) reads as its scripted cost."""
    tail, tokens = current_measurement()
    _fake_now[0] += COST_MS[tail][tokens] / 1e3
    return _fake_now[0]


def rand(T: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


COMMON = {"collective_timeout_s": 10.0, "call_margin_s": 10.0, "health_check_period_s": 1.0,
          "graceful_shutdown_timeout_s": 1.0, "max_tokens_per_request": 512, "max_batch_tokens": 512}
AUTO = {"tp_size": 2, "tail": "auto", "auto_tune_tokens": TUNE_TOKENS, "auto_tune_reps": 1,
        "tune_clock": f"tests.test_lane:{scripted_clock.__name__}"}
EXACT_DEPLOYMENTS = [
    {"name": "tp1_f32", "dtype": "float32", "layers": [1]},
    {"name": "tp1_bf16", "dtype": "bfloat16", "layers": [2]},
    {"name": "tp2_f32", "dtype": "float32", **AUTO},
    {"name": "tp2_bf16", "dtype": "bfloat16", **AUTO},
    {"name": "sp_f32", "dtype": "float32", "tp_size": 2, "sequence_parallel": True},
    {"name": "sp_bf16", "dtype": "bfloat16", "tp_size": 2, "sequence_parallel": True},
]


@pytest.fixture(scope="module")
def exact_app(tiny_ckpt, serve_ports):
    from conftest import TEST_APP  # here: the workers import this module for its clock
    from ray import serve

    from deployments.app import build_app
    from deployments.client import MoEClient

    serve.run(build_app({"checkpoint": str(tiny_ckpt), **TEST_APP, **COMMON, "deployments": EXACT_DEPLOYMENTS}),
              name=APP, route_prefix="/")
    yield SimpleNamespace(ckpt=tiny_ckpt, client=MoEClient(APP, timeout_s=60))


def direct(name: str, timeout_s: float = 60):
    from deployments.client import MoEClient

    return MoEClient.direct(name, APP, timeout_s=timeout_s)


def lanes_if_free(name: str) -> dict | None:
    """The replica's ``lanes`` status once no lease is active, else None."""
    lanes = direct(name).status()["lanes"]
    return lanes if lanes["active"] is None else None


@pytest.mark.parametrize("name", [d["name"] for d in EXACT_DEPLOYMENTS if d["name"].startswith(("tp2", "sp"))])
def test_lane_equals_the_serve_path_bit_for_bit_for_every_tail(exact_app, name):
    from waiting import wait_until  # here: the workers import this module for its clock

    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    serve_path = direct(name)
    # The Serve path first: while a lane holds the only replica, Serve calls wait for the lease.
    inputs = {(T, layer): rand(T, 100 * T + layer, dtype) for T in TAIL_AT for layer in (1, 2)}
    want = {key: serve_path.forward(x, key[1]) for key, x in inputs.items()}
    logits, x_logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(5)), rand(3, 6, dtype)
    want_logits = serve_path.forward(x_logits, 1, logits)
    before = serve_path.status()["counters"]["tails"]
    with serve_path.lane(max_tokens=64, name=f"exact-{name}") as lane:
        assert lane.status()["deployments"][name]["path"] == "lane"
        for (T, layer), x in inputs.items():
            got = lane.forward(x, layer)
            assert got.dtype == dtype and torch.equal(got, want[T, layer]), (name, T, layer)
            # numpy float32 in -> float32 numpy out, rounded to the deployment dtype on the way
            got_np = lane.forward(x.float().numpy(), layer)
            assert isinstance(got_np, np.ndarray) and np.array_equal(got_np, want[T, layer].float().numpy())
        assert torch.equal(lane.forward(x_logits, 1, logits), want_logits)
        assert lane.status()["deployments"][name]["serve_calls"] == 0

        def counted() -> dict | None:  # the replica polls the lane's counters every LANE_POLL_S
            st = serve_path.status()
            return st if st["counters"]["lane"]["tokens"] >= 4 * sum(TAIL_AT) else None

        status = wait_until(counted, timeout_s=30, what="the lane's calls in the replica's counters",
                            every_s=LANE_POLL_S)
    tails = status["counters"]["tails"]
    # the tail decision applies to lane calls: each range ran its measured tail on the lane too
    expected = ["sequence_parallel"] if name.startswith("sp") else list(TAIL_AT.values())
    for tail in expected:
        assert tails.get(tail, 0) > before.get(tail, 0), (tail, before, tails)
    assert status["lanes"]["active"]["client"] == f"exact-{name}"
    assert status["counters"]["lane"]["tokens"] >= 4 * sum(TAIL_AT)


def test_app_lane_routes_by_layer_and_matches_the_reference(exact_app):
    from moe_runtime.checkpoint import load_layer_weights
    from moe_runtime.config import LatentMoEConfig
    from moe_runtime.layer import moe_forward

    cfg = LatentMoEConfig.from_pretrained(exact_app.ckpt)
    x = rand(5, 7)
    xb = x.to(torch.bfloat16)
    want1, want2 = direct("tp1_f32").forward(x, 1), direct("tp1_bf16").forward(xb, 2)
    ref = moe_forward(x, load_layer_weights(exact_app.ckpt, cfg, 1, torch.float32), cfg)
    # the lane's calls back to back: a lane idle for half a term lets its groups go
    with exact_app.client.lane(max_tokens=8, name="routed") as lane:  # layer 1 -> tp1_f32, 2 -> tp1_bf16
        assert set(lane.status()["deployments"]) == {"tp1_f32", "tp1_bf16"}
        out1, out2 = lane.forward(x, 1), lane.forward(xb, 2)
        assert all(d["path"] == "lane" for d in lane.status()["deployments"].values())
    assert torch.equal(out1, want1) and torch.equal(out2, want2)
    torch.testing.assert_close(out1, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["nan", "shape", "dtype", "too_many", "layer"])
def test_bad_input_on_a_lane_is_a_clear_4xx_and_the_lane_keeps_serving(exact_app, case):
    from deployments.client import MoERequestError

    ok = rand(2, 2)
    want = direct("tp2_f32").forward(ok, 1)
    with direct("tp2_f32").lane(max_tokens=4, name=f"bad-{case}") as lane:
        x, layer = rand(2, 1), 1
        if case == "nan":
            x[0, 3] = float("nan")
        elif case == "shape":
            x = rand(2, 1)[:, :100]
        elif case == "dtype":
            x = x.double()
        elif case == "too_many":
            x = rand(600, 1)  # over max_tokens_per_request (512)
        else:
            layer = 7
        with pytest.raises(MoERequestError) as err:
            lane.forward(x, layer)
        assert err.value.status in (400, 404, 413)
        assert torch.equal(lane.forward(ok, 1), want)
        assert lane.status()["deployments"]["tp2_f32"]["path"] == "lane"


def test_lane_arguments_are_checked(exact_app):
    with pytest.raises(ValueError, match="max_tokens"):
        exact_app.client.lane(max_tokens=0)
    with pytest.raises(ValueError, match=r"layer\(s\) \[9\]"):
        exact_app.client.lane(layers=[9])
    from deployments.client import MoERequestError

    with pytest.raises(MoERequestError, match="max_tokens_per_request"):
        direct("tp2_f32").lane(max_tokens=100_000)


# -- the control plane: autoscaling signals, leases of dead clients, several clients ---------

PAIR = {"name": "pair", "tp_size": 2, "tail": "sharded", "dtype": "float32", "num_replicas": 2,
        "lane_lease_s": 10.0, "collective_timeout_s": 4.0, "call_margin_s": 4.0}
SOLO = {"name": "solo", "tp_size": 1, "dtype": "float32", "lane_lease_s": 2.0}


def test_the_serve_path_reaches_the_ranks_over_the_replicas_own_session(exact_app):
    """The replica is the one peer of a data-plane session of its own: no compiled graph, nothing
    to tear down when idle, and the same answer on every call."""
    client = direct("sp_f32")
    x = rand(5, seed=11)
    first = client.forward(x, 1)
    assert client.status()["group_transport"].startswith("data plane (session 1 on rank 0 at ")
    assert torch.equal(client.forward(x, 1), first)


@pytest.fixture(scope="module")
def fault_app(tiny_ckpt, exact_app):
    """Replaces the exact app (one Ray instance at a time on a small machine)."""
    from conftest import TEST_APP
    from ray import serve

    from deployments.app import build_app
    from deployments.client import MoEClient

    serve.delete(APP)
    args = {"checkpoint": str(tiny_ckpt), **TEST_APP, **COMMON, "deployments": [PAIR, SOLO]}
    serve.run(build_app(args), name=APP, route_prefix="/")
    yield SimpleNamespace(args=args, client=MoEClient(APP, timeout_s=60), build_app=build_app)


def test_lane_traffic_feeds_the_autoscaling_signals(fault_app):
    from ray import serve
    from waiting import wait_until  # here: the workers import this module for its clock

    handle = serve.get_deployment_handle("solo", APP)
    with direct("solo").lane(max_tokens=4, name="scaler") as lane:
        x = rand(4, 3)
        for _ in range(40):
            lane.forward(x, 1)

        def counted() -> dict | None:  # the replica polls the lane's counters every LANE_POLL_S
            stats = handle.record_autoscaling_stats.remote().result(timeout_s=30)
            return stats if stats["tokens_per_s"] >= 40 * 4 / 10.0 * 0.99 else None

        stats = wait_until(counted, timeout_s=30, what="the lane's 160 tokens in tokens_per_s",
                           every_s=LANE_POLL_S)
    assert stats["tokens_per_s"] >= 40 * 4 / 10.0 * 0.99  # 160 tokens within the 10 s window


def test_two_clients_on_one_replica_share_it_without_deadlock(fault_app):
    """The documented rule: the second client waits wait_s, then takes the Serve path; the
    Serve path's demand stops the first lease's renewal after one term; nobody deadlocks."""
    from load import CallLoop  # here: the workers import this module for its clock
    from waiting import wait_until

    want = {T: direct("solo").forward(rand(T, T), 1) for T in (1, 2)}

    def call(lane, T: int) -> None:
        # Not bit for bit: once both clients run on the Serve path, one batch can hold both
        # clients' rows, and a 3-row batch moves a 2-row one's fp32 results by a few ulps (1.2e-6
        # measured on this layer). Those are the GEMMs' blocking, not a fault.
        torch.testing.assert_close(lane.forward(rand(T, T), 1), want[T], rtol=1e-5, atol=1e-5)

    with direct("solo").lane(max_tokens=2, name="first", retry_s=0.5) as first:
        assert first.status()["deployments"]["solo"]["path"] == "lane"
        # The first client calls before the second asks (an idle lane would let its group go).
        with CallLoop(lambda: call(first, 1)) as one, \
                direct("solo").lane(max_tokens=2, name="second", wait_s=0.5, retry_s=0.5) as second:
            assert second.status()["deployments"]["solo"]["path"] == "serve"
            assert "held by first" in second.status()["deployments"]["solo"]["why_serve"]
            with CallLoop(lambda: call(second, 2)) as two:
                # The second client's Serve calls end the first lease after one term (lane_lease_s
                # 2 s): the first client then calls on the Serve path too.
                wait_until(lambda: one.errors or two.errors or first.status()["deployments"]["solo"]["serve_calls"],
                           timeout_s=60, what="the first client on the Serve path once its lease ended",
                           every_s=0.25)
                # both clients call on, a few calls each, with the first on the Serve path
                marks = one.calls(), two.calls()
                wait_until(lambda: one.calls() >= marks[0] + 3 and two.calls() >= marks[1] + 3, timeout_s=60,
                           what="three more calls of each client")
            s1, s2 = first.status()["deployments"]["solo"], second.status()["deployments"]["solo"]
    assert not one.errors and not two.errors, (one.errors, two.errors)
    assert s1["lane_calls"] > 0 and s1["serve_calls"] > 0 and s2["serve_calls"] > 0


def test_an_idle_lane_releases_its_group_and_leases_again_on_the_next_call(fault_app):
    from waiting import wait_until  # here: the workers import this module for its clock

    x = rand(1, 5)
    want = direct("solo").forward(x, 1)
    with direct("solo").lane(max_tokens=1, name="idler") as lane:
        assert torch.equal(lane.forward(x, 1), want)
        wait_until(lambda: lanes_if_free("solo"), timeout_s=30, every_s=0.25,
                   what="the lease released after half a term (1 s) idle")
        # Released by the idle lane after half a term; on a loaded machine the replica's expiry
        # (a whole term, 2 s) can come first. Either way the group went free without a call.
        assert direct("solo").status()["lanes"]["history"][-1]["ended"] in ("released", "expired")
        assert lane.status()["deployments"]["solo"]["path"] == "serve"
        assert torch.equal(lane.forward(x, 1), want)
        assert lane.status()["deployments"]["solo"]["path"] == "lane"  # leased again by the call


def test_a_lane_dropped_without_close_releases_its_group(fault_app):
    """Only the lane's core is held by its idle thread: the lane itself is collected once its
    owner lets go, and its finalizer releases the lease."""
    import gc
    import threading as th

    from waiting import wait_until  # here: the workers import this module for its clock

    lane = direct("solo").lane(max_tokens=1, name="forgotten")
    assert lane.status()["deployments"]["solo"]["path"] == "lane"
    lane.forward(rand(1, 3), 1)
    idle = [t for t in th.enumerate() if t.name == "idle-forgotten"]
    del lane
    gc.collect()
    lanes = wait_until(
        lambda: lanes_if_free("solo"), timeout_s=30, every_s=0.25,
        what=lambda: f"the dropped lane's lease released; lanes {direct('solo').status()['lanes']}")
    assert lanes["history"][-1]["client"] == "forgotten" and lanes["history"][-1]["ended"] == "released"
    for t in idle:
        t.join(timeout=10)
        assert not t.is_alive()


def test_two_clients_on_two_replicas_each_get_a_group(fault_app):
    a = direct("pair").lane(max_tokens=2, name="a", wait_s=10)
    sa = a.status()["deployments"]["pair"]
    b = direct("pair").lane(max_tokens=2, name="b", wait_s=10)
    sb = b.status()["deployments"]["pair"]
    try:
        assert sa["path"] == sb["path"] == "lane" and sa["replica"] != sb["replica"]
        x = rand(2, 4)
        assert torch.equal(a.forward(x, 1), b.forward(x, 1))
    finally:
        a.close()
        b.close()


def _rank_pid(lane, deployment: str, rank: int) -> int:
    import ray

    grant = lane.leases[deployment].grant
    return ray.get(grant["ranks"][rank].info.remote(), timeout=30)["pid"]


def test_a_killed_rank_under_lane_load_costs_the_caller_nothing(fault_app):
    """SIGKILL one rank of the leased replica of 2 while a closed loop calls the lane: every call
    answers (the failed one is retried on the Serve path, which routes to the healthy replica),
    and the lane leases a group again."""
    from load import CallLoop  # here: the workers import this module for its clock
    from waiting import wait_until

    want = direct("pair").forward(rand(1, 11), 1)

    def moved_on() -> bool:  # a call failed over to Serve, then the lane leased the other group
        st = lane.status()["deployments"]["pair"]
        return st["fallbacks"] >= 1 and st["path"] == "lane" and st["replica"] != killed_replica

    with direct("pair").lane(max_tokens=1, name="victim", retry_s=0.5) as lane, \
            CallLoop(lambda: torch.equal(lane.forward(rand(1, 11), 1), want)) as load:
        killed_replica = lane.status()["deployments"]["pair"]["replica"]
        os.kill(_rank_pid(lane, "pair", 1), signal.SIGKILL)
        # the calls go on meanwhile; the failed one may take the call bound (4 + 4 s) to fail
        wait_until(moved_on, timeout_s=60, every_s=0.25,
                   what=lambda: f"a fallback, then a lease elsewhere: {lane.status()['deployments']['pair']}")
        load.stop()
        assert moved_on()  # still on the other group once the calls stopped
    assert not load.errors, load.errors
    assert all(load.results)


def test_a_stalled_rank_costs_the_caller_nothing_with_two_replicas(fault_app):
    """SIGSTOP a rank of the leased replica of 2: rank 0's collective gives up within the
    collective timeout, the lane hears the group failed and sends the call once more on the Serve
    path, which avoids that replica: the caller gets the same answer, no error."""
    from waiting import wait_until  # here: the workers import this module for its clock

    wait_until(lambda: len({st["replica"] for st in (direct("pair").status() for _ in range(16))
                            if st["healthy"]}) >= 2,
               timeout_s=300, what="two healthy pair replicas (Serve replaced the one the test above broke)",
               every_s=1.0)
    x = rand(1, 1)
    want = direct("pair").forward(x, 1)
    lane = direct("pair").lane(max_tokens=1, name="stalled")
    pid = _rank_pid(lane, "pair", 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert torch.equal(lane.forward(x, 1), want)
        status = lane.status()["deployments"]["pair"]
        assert status["fallbacks"] == 1 and status["serve_calls"] == 1, status
    finally:
        with contextlib.suppress(ProcessLookupError):  # the broken group's replica ended it
            os.kill(pid, signal.SIGCONT)
        lane.close()


def test_a_dead_clients_session_ends_and_the_group_leases_again(fault_app):
    """A client killed mid-work closes its connection to rank 0: its session ends at once (the
    replica ends the lease at its next poll, not a term later) and nothing is left on the ranks."""
    import ray
    from waiting import wait_until  # here: the workers import this module for its clock

    code = f"""
import sys, time, torch
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
import ray
ray.init(address={ray.get_runtime_context().gcs_address!r}, namespace="serve", log_to_driver=False)
from deployments.client import MoEClient
lane = MoEClient.direct("solo", {APP!r}, timeout_s=60).lane(max_tokens=2, name="doomed")
assert lane.status()["deployments"]["solo"]["path"] == "lane"
lane.forward(torch.zeros(1, {H}), 1)
print("leased", flush=True)
while True:  # a busy client (an idle one would drop its lease itself), killed mid-work
    lane.forward(torch.zeros(1, {H}), 1)
"""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "leased"
        assert direct("solo").status()["lanes"]["active"]["client"] == "doomed"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    lanes = wait_until(
        lambda: lanes_if_free("solo"), timeout_s=30, every_s=0.25,
        what=lambda: f"the dead client's lease ended; lanes {direct('solo').status()['lanes']}")
    ended = lanes["history"][-1]
    assert ended["client"] == "doomed" and ended["ended"].startswith("its session ended (peer_gone: peer 0 "), ended
    x = rand(1, 9)
    want = direct("solo").forward(x, 1)
    with direct("solo").lane(max_tokens=2, name="next") as lane:
        assert lane.status()["deployments"]["solo"]["path"] == "lane"
        assert torch.equal(lane.forward(x, 1), want)
