"""Lanes (deployments/client/lane.py, deployments/serve/sessions.py): per-layer calls of a client on
the data plane of a TP group it holds a session on, against the Serve path of the same replicas.

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
import inspect
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deployments.config.timeouts import EVENTS_PUSH_S, ROUTING_STATS_PERIOD_S

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


def timed_pair() -> tuple[str, int]:
    """The (tail, tokens) being timed: the loop variables of ``time_tails``, the clock's caller."""
    caller = inspect.currentframe().f_back.f_back
    assert caller.f_code.co_name == "time_tails", caller.f_code.co_name
    return caller.f_locals["tail"], caller.f_locals["T"]


def scripted_clock() -> float:
    """Injected tune clock: every timed sample of (tail, tokens) reads as its scripted cost."""
    tail, tokens = timed_pair()
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


def sessions_once_ended(name: str, client: str) -> dict | None:
    """The replica's ``sessions`` status once none is open and ``client``'s session is the last
    ended, else None. Both: rank 0 drops an ended session from its snapshot (so from "open") a
    moment before its pushed end reaches the replica's history."""
    sessions = direct(name).status()["sessions"]
    ended = sessions["history"][-1:]
    return sessions if not sessions["open"] and ended and ended[0]["client"] == client else None


@pytest.mark.parametrize("name", [d["name"] for d in EXACT_DEPLOYMENTS if d["name"].startswith(("tp2", "sp"))])
def test_lane_equals_the_serve_path_bit_for_bit_for_every_tail(exact_app, name):

    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    serve_path = direct(name)
    inputs = {(T, layer): rand(T, 100 * T + layer, dtype) for T in TAIL_AT for layer in (1, 2)}
    want = {key: serve_path.forward(x, key[1]) for key, x in inputs.items()}
    logits, x_logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(5)), rand(3, 6, dtype)
    want_logits = serve_path.forward(x_logits, 1, logits)
    before = serve_path.status()["counters"]["tails"]
    with serve_path.lane(max_tokens=64, name=f"exact-{name}") as lane:
        assert lane.status()["deployments"][name]["path"] == "session"
        for (T, layer), x in inputs.items():
            got = lane.forward(x, layer)
            assert got.dtype == dtype and torch.equal(got, want[T, layer]), (name, T, layer)
            # numpy float32 in -> float32 numpy out, rounded to the deployment dtype on the way
            got_np = lane.forward(x.float().numpy(), layer)
            assert isinstance(got_np, np.ndarray) and np.array_equal(got_np, want[T, layer].float().numpy())
        assert torch.equal(lane.forward(x_logits, 1, logits), want_logits)
        assert lane.status()["deployments"][name]["serve_calls"] == 0

        status = serve_path.status()  # read live from rank 0: exact at once, nothing to wait for
        assert status["counters"]["sessions"]["tokens"] >= 4 * sum(TAIL_AT)
        (mine,) = [s for s in status["sessions"]["open"] if s["client"] == f"exact-{name}"]
        assert mine["rows"] == 4 * sum(TAIL_AT) + 3 and mine["forwards"] == 4 * len(TAIL_AT) + 1
    tails = status["counters"]["tails"]
    # the tail decision applies to lane calls: each range ran its measured tail on the lane too
    expected = ["sequence_parallel"] if name.startswith("sp") else list(TAIL_AT.values())
    for tail in expected:
        assert tails.get(tail, 0) > before.get(tail, 0), (tail, before, tails)
    assert direct(name).status()["sessions"]["history"][-1]["client"] == f"exact-{name}"  # closed with it


def test_app_lane_routes_by_layer_and_matches_the_reference(exact_app):
    from moe_runtime.checkpoint import load_layer_weights
    from moe_runtime.config import LatentMoEConfig
    from moe_runtime.layer import moe_forward

    cfg = LatentMoEConfig.from_pretrained(exact_app.ckpt)
    x = rand(5, 7)
    xb = x.to(torch.bfloat16)
    want1, want2 = direct("tp1_f32").forward(x, 1), direct("tp1_bf16").forward(xb, 2)
    ref = moe_forward(x, load_layer_weights(exact_app.ckpt, cfg, 1, torch.float32), cfg)
    with exact_app.client.lane(max_tokens=8, name="routed") as lane:  # layer 1 -> tp1_f32, 2 -> tp1_bf16
        assert set(lane.status()["deployments"]) == {"tp1_f32", "tp1_bf16"}
        out1, out2 = lane.forward(x, 1), lane.forward(xb, 2)
        assert all(d["path"] == "session" for d in lane.status()["deployments"].values())
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
        assert lane.status()["deployments"]["tp2_f32"]["path"] == "session"


def test_lane_arguments_are_checked(exact_app):
    with pytest.raises(ValueError, match="max_tokens"):
        exact_app.client.lane(max_tokens=0)
    with pytest.raises(ValueError, match=r"layer\(s\) \[9\]"):
        exact_app.client.lane(layers=[9])
    from deployments.client import MoERequestError

    with pytest.raises(MoERequestError, match="max_tokens_per_request"):
        direct("tp2_f32").lane(max_tokens=100_000)


# -- the control plane: autoscaling signals, sessions of dead clients, several clients -------

PAIR = {"name": "pair", "tp_size": 2, "tail": "sharded", "dtype": "float32", "num_replicas": 2,
        "collective_timeout_s": 4.0, "call_margin_s": 4.0}
SOLO = {"name": "solo", "tp_size": 1, "dtype": "float32", "session_linger_s": 2.0}


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

        def counted() -> dict | None:  # rank 0 pushes a session's counts every EVENTS_PUSH_S
            stats = handle.record_autoscaling_stats.remote().result(timeout_s=30)
            return stats if stats["tokens_per_s"] >= 40 * 4 / 10.0 * 0.99 else None

        stats = wait_until(counted, timeout_s=30, what="the lane's 160 tokens in tokens_per_s",
                           every_s=EVENTS_PUSH_S / 4)
        assert stats["open_sessions"] == 1  # a scale-down keeps this replica while its session is open
    assert stats["tokens_per_s"] >= 40 * 4 / 10.0 * 0.99  # 160 tokens within the 10 s window


def test_two_lanes_and_the_serve_path_share_one_replica_at_once(fault_app):
    """Two lanes on the one replica of ``solo`` call back to back while a third client sends
    Serve-path requests: every call is answered exactly, both lanes stay on their sessions the
    whole time (nothing is held or revoked), and both sessions are open at once."""
    from load import CallLoop  # here: the workers import this module for its clock
    from waiting import wait_until

    want = {T: direct("solo").forward(rand(T, T), 1) for T in (1, 2, 3)}

    def call(client, T: int) -> None:
        # Not bit for bit: rank 0 runs same-layer parts of several sessions and the Serve path as
        # one forward, and a 3-row forward moves a 2-row one's fp32 results by a few ulps (1.2e-6
        # measured on this layer): the GEMMs' blocking, not a fault.
        torch.testing.assert_close(client.forward(rand(T, T), 1), want[T], rtol=1e-5, atol=1e-5)

    serve_path = direct("solo")
    with direct("solo").lane(max_tokens=2, name="first") as first, \
            direct("solo").lane(max_tokens=2, name="second", wait_s=0.5) as second:
        assert {lane.status()["deployments"]["solo"]["path"] for lane in (first, second)} == {"session"}
        assert {s["client"] for s in serve_path.status()["sessions"]["open"]} == {"first", "second"}
        with CallLoop(lambda: call(first, 1)) as one, CallLoop(lambda: call(second, 2)) as two, \
                CallLoop(lambda: call(serve_path, 3)) as three:
            marks = one.calls(), two.calls(), three.calls()
            wait_until(lambda: min(one.calls() - marks[0], two.calls() - marks[1], three.calls() - marks[2]) >= 20,
                       timeout_s=120, what="20 more calls of each client")
        s1, s2 = first.status()["deployments"]["solo"], second.status()["deployments"]["solo"]
    assert not one.errors and not two.errors and not three.errors, (one.errors, two.errors, three.errors)
    assert s1["serve_calls"] == s2["serve_calls"] == 0 and s1["session_calls"] > 20 and s2["session_calls"] > 20
    assert s1["path"] == s2["path"] == "session"


def test_an_idle_lane_keeps_its_session_without_renewals(fault_app):
    """No term: a lane idle for longer than the old lease term (2 s) and the linger (2 s: it
    only counts while no peer is connected) still calls on its session."""
    x = rand(1, 5)
    want = direct("solo").forward(x, 1)
    with direct("solo").lane(max_tokens=1, name="idler") as lane:
        assert torch.equal(lane.forward(x, 1), want)
        import time

        time.sleep(3 * 2.0)  # idle: three linger periods with the lane's peer connected
        assert torch.equal(lane.forward(x, 1), want)
        st = lane.status()["deployments"]["solo"]
        assert st["path"] == "session" and st["sessions"] == 1 and st["serve_calls"] == 0


def test_a_lane_dropped_without_close_closes_its_session(fault_app):
    """The lane is collected once its owner lets go, and its finalizer closes the session."""
    import gc

    from waiting import wait_until  # here: the workers import this module for its clock

    lane = direct("solo").lane(max_tokens=1, name="forgotten")
    assert lane.status()["deployments"]["solo"]["path"] == "session"
    lane.forward(rand(1, 3), 1)
    del lane
    gc.collect()
    sessions = wait_until(
        lambda: sessions_once_ended("solo", "forgotten"), timeout_s=30, every_s=0.25,
        what=lambda: f"the dropped lane's session closed; {direct('solo').status()['sessions']}")
    last = sessions["history"][-1]
    assert last["client"] == "forgotten" and last["failure"] == "session_ended", last


def test_a_new_session_goes_to_the_least_loaded_replica(fault_app):
    import time

    a = direct("pair").lane(max_tokens=2, name="a", wait_s=10)
    sa = a.status()["deployments"]["pair"]
    # The router learns each replica's session rows from its routing stats, every
    # ROUTING_STATS_PERIOD_S: b is opened once the router has heard of a's session.
    time.sleep(4 * ROUTING_STATS_PERIOD_S)
    b = direct("pair").lane(max_tokens=2, name="b", wait_s=10)
    sb = b.status()["deployments"]["pair"]
    try:
        assert sa["path"] == sb["path"] == "session" and sa["replica"] != sb["replica"]
        x = rand(2, 4)
        assert torch.equal(a.forward(x, 1), b.forward(x, 1))
    finally:
        a.close()
        b.close()


def _rank_pid(lane, deployment: str, rank: int) -> int:
    """The pid of ``rank`` of the group serving the lane's session on ``deployment`` now."""
    import ray

    from deployments.client.session import rank_of

    group = lane.sessions[deployment].groups()[deployment]
    return ray.get(rank_of(group, rank).info.remote(), timeout=30)["pid"]


def test_a_killed_rank_under_lane_load_costs_the_caller_nothing(fault_app):
    """SIGKILL one rank of the session's replica of 2 while a closed loop calls the lane: the
    lane's peer moves its session to the healthy replica by itself and sends the call in flight
    again there, so every call answers with the Serve path's rows, none on the Serve path."""
    from load import CallLoop  # here: the workers import this module for its clock
    from waiting import wait_until

    want = direct("pair").forward(rand(1, 11), 1)

    def moved_on() -> bool:  # the session moved to the other replica's group
        st = lane.status()["deployments"]["pair"]
        return st["moves"] >= 1 and st["path"] == "session" and st["replica"] != killed_replica

    with direct("pair").lane(max_tokens=1, name="victim", retry_s=0.5) as lane, \
            CallLoop(lambda: torch.equal(lane.forward(rand(1, 11), 1), want)) as load:
        killed_replica = lane.status()["deployments"]["pair"]["replica"]
        os.kill(_rank_pid(lane, "pair", 1), signal.SIGKILL)
        # the calls go on meanwhile; the one in flight waits for the move
        wait_until(moved_on, timeout_s=60, every_s=0.25,
                   what=lambda: f"a move to the other replica: {lane.status()['deployments']['pair']}")
        marks = load.calls()
        wait_until(lambda: load.calls() >= marks + 5, timeout_s=60, what="5 more calls after the move")
        load.stop()
        st = lane.status()["deployments"]["pair"]
    assert not load.errors, load.errors
    assert all(load.results)  # bit for bit: the other replica runs the same ranks' math
    assert st["moves"] == 1 and st["serve_calls"] == 0 and st["reruns"] == 0 and st["sessions"] == 1, st


def test_a_stalled_rank_costs_the_caller_nothing_with_two_replicas(fault_app):
    """SIGSTOP a rank of the session's replica of 2: rank 0's collective gives up within the
    collective timeout, the lane's peer hears the group failed, moves the session to the other
    replica and sends the call again there: the caller gets the same answer, no error."""
    from waiting import wait_until  # here: the workers import this module for its clock

    wait_until(lambda: len({st["replica"] for st in (direct("pair").status() for _ in range(16))
                            if st["healthy"]}) >= 2,
               timeout_s=300, what="two healthy pair replicas (Serve replaced the one the test above broke)",
               every_s=1.0)
    x = rand(1, 1)
    want = direct("pair").forward(x, 1)
    lane = direct("pair").lane(max_tokens=1, name="stalled")
    stopped = lane.status()["deployments"]["pair"]["replica"]
    pid = _rank_pid(lane, "pair", 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert torch.equal(lane.forward(x, 1), want)
        status = lane.status()["deployments"]["pair"]
        assert status["moves"] == 1 and status["serve_calls"] == 0 and status["replica"] != stopped, status
    finally:
        with contextlib.suppress(ProcessLookupError):  # the broken group's replica ended it
            os.kill(pid, signal.SIGCONT)
        lane.close()


def test_a_dead_clients_session_ends_and_the_group_serves_on(fault_app):
    """A client killed mid-work closes its connection to rank 0: its session ends at once (rank 0
    pushes the end to the replica) and nothing is left on the ranks."""
    import ray
    from waiting import wait_until  # here: the workers import this module for its clock

    code = f"""
import sys, time, torch
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
import ray
ray.init(address={ray.get_runtime_context().gcs_address!r}, namespace="serve", log_to_driver=False)
from deployments.client import MoEClient
lane = MoEClient.direct("solo", {APP!r}, timeout_s=60).lane(max_tokens=2, name="doomed")
assert lane.status()["deployments"]["solo"]["path"] == "session"
lane.forward(torch.zeros(1, {H}), 1)
print("leased", flush=True)
while True:  # a busy client, killed mid-work
    lane.forward(torch.zeros(1, {H}), 1)
"""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "leased"
        assert [s["client"] for s in direct("solo").status()["sessions"]["open"]] == ["doomed"]
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    sessions = wait_until(
        lambda: sessions_once_ended("solo", "doomed"), timeout_s=30, every_s=0.25,
        what=lambda: f"the dead client's session ended; {direct('solo').status()['sessions']}")
    ended = sessions["history"][-1]
    assert ended["client"] == "doomed" and ended["failure"] == "peer_gone", ended
    x = rand(1, 9)
    want = direct("solo").forward(x, 1)
    with direct("solo").lane(max_tokens=2, name="next") as lane:
        assert lane.status()["deployments"]["solo"]["path"] == "session"
        assert torch.equal(lane.forward(x, 1), want)
