"""Cohorts (deployments/client/cohort.py, attention.py): many attention workers, one forward per
MoE layer per step, on one data-plane session whose peers are the workers.

Exactness is bit for bit against the Serve path's forward of the same concatenated batch (same
ranks, runners and tail plan: ``torch.equal``), and each worker's rows against a lone Serve
forward of its own rows within float32 tolerance (rtol/atol 1e-5: a batch of other rows changes
only the GEMMs' blocking, a few fp32 ulps, as in tests/test_lane.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from types import SimpleNamespace

import pytest
import ray
import torch
from conftest import TEST_APP
from load import CallLoop
from ray import cloudpickle
from waiting import wait_until

from deployments.client import AttentionWorker, MoERequestError, WorkerError
from deployments.config.timeouts import PROBE_S, SESSION_MOVE_S
from deployments.dataplane.peer import ANSWER_MARGIN_S, answer_bound_s

pytestmark = [pytest.mark.ray, pytest.mark.slow]
# The workers' classes travel by value: Ray's worker processes need not import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

APP = "cohort_test"
H = 128  # tiny preset
COMMON = {**TEST_APP, "collective_timeout_s": 4.0, "call_margin_s": 4.0, "health_check_period_s": 1.0,
          "graceful_shutdown_timeout_s": 1.0, "max_tokens_per_request": 64, "max_batch_tokens": 64,
          "auto_tune_tokens": "none"}
DEPLOYMENTS = [
    {"name": "pair", "tp_size": 2, "tail": "sharded", "dtype": "float32", "num_replicas": 2, "layers": [1]},
    {"name": "half", "tp_size": 2, "tail": "replicated", "dtype": "bfloat16", "layers": [2], "max_sessions": 2},
]


def rows(T: int, seed: int, layer: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(1000 * seed + layer)).to(dtype)


class Echo(AttentionWorker):
    """Sends ``T`` seeded rows per layer (the step input is the seed) and keeps what comes back;
    ``fault`` names a misbehaviour for one step."""

    def __init__(self):
        self.reset(0)

    def reset(self, T: int) -> None:
        """As new, sending ``T`` rows per layer (the next test reuses a healthy actor)."""
        self.T, self.dtype = T, torch.float32
        self.got: dict[int, torch.Tensor] = {}
        self.fault: str | None = None
        self.aborts = self.steps = 0

    def reusable(self) -> bool:
        return self.fault != "sleep"  # its attend() may still be sleeping

    def set_fault(self, fault: str | None) -> None:
        self.fault = fault

    def counts(self) -> tuple[int, int]:
        return self.steps, self.aborts

    def start(self, step_input):
        self.seed, self.got = step_input, {}

    def attend(self, layer):
        x = rows(self.T, self.seed, layer, self.dtype if layer == 1 else torch.bfloat16)
        if self.fault == "raise" or (self.fault == "raise_late" and layer == 2):
            raise RuntimeError("attention blew up")
        if self.fault == "nan" and self.T:
            x[0, 0] = float("nan")
        if self.fault == "width":
            x = x[:, : H - 1]
        if self.fault == "rows" and layer == 2:
            x = torch.cat([x, x])
        if self.fault == "too_many":
            x = torch.zeros(99, H, dtype=x.dtype)
        if self.fault == "sleep":
            time.sleep(60)  # the fault itself, not a wait: attend() stuck past the step bound
        return x.float().numpy() if self.dtype == torch.float32 and layer == 1 else x

    def absorb(self, layer, moe_out):
        self.got[layer] = torch.as_tensor(moe_out)

    def finish(self):
        self.steps += 1
        return self.got

    def abort(self):
        self.aborts += 1
        self.got = {}


@pytest.fixture(scope="module")
def app(tiny_ckpt, serve_ports):
    from ray import serve

    from deployments.app import build_app
    from deployments.client import MoEClient

    serve.run(build_app({"checkpoint": str(tiny_ckpt), **COMMON, "deployments": DEPLOYMENTS}),
              name=APP, route_prefix="/")
    yield SimpleNamespace(ckpt=tiny_ckpt, client=MoEClient(APP, timeout_s=60))


@pytest.fixture(scope="module")
def idle_workers():
    """Echo actors a test left healthy, for the next test: a new one is a process to start
    (~2 CPU-s). Ended with the module (an idle actor process still holds a few hundred MB)."""
    idle: list = []
    yield idle
    for actor in idle:
        ray.kill(actor)


@pytest.fixture
def workers(idle_workers):
    """``workers(*T)``: Echo actors sending T rows each, reset and up (a test's timed part never
    waits for a process start). After the test, each healthy one goes back to ``idle_workers``;
    any other (killed, or stuck in a fault) is ended."""
    made = []

    def make(*tokens: int):
        new = [idle_workers.pop() if idle_workers else ray.remote(Echo).options(num_cpus=0).remote()
               for _ in tokens]
        made.extend(new)
        ray.get([w.reset.remote(T) for w, T in zip(new, tokens, strict=True)], timeout=120)
        return new

    yield make
    for actor in made:
        try:
            reusable = ray.get(actor.reusable.remote(), timeout=10)
        except ray.exceptions.RayError:
            reusable = False
        if reusable:
            idle_workers.append(actor)
        else:
            ray.kill(actor)


def direct(name: str):
    from deployments.client import MoEClient

    return MoEClient.direct(name, APP, timeout_s=60)


def serve_reference(app, tokens: tuple[int, ...], seed_of) -> dict[int, list[torch.Tensor]]:
    """Each worker's rows of the Serve path's forward of every worker's rows concatenated."""
    want = {}
    for layer, dtype in ((1, torch.float32), (2, torch.bfloat16)):
        xs = [rows(T, seed_of(i), layer, dtype) for i, T in enumerate(tokens)]
        out = app.client.forward(torch.cat(xs), layer)
        want[layer] = list(torch.split(out, list(tokens)))
    return want


def counters(name: str) -> dict[str, dict]:
    """Each replica's counters (status() answers for whichever replica the router picks, and
    reads rank 0's session counts live: exact at each read)."""
    replicas = 2 if name == "pair" else 1
    seen: dict[str, dict] = {}

    def every_replica_seen() -> bool:
        st = direct(name).status()
        seen[st["replica"]] = st["counters"]
        return len(seen) >= replicas

    wait_until(every_replica_seen, timeout_s=30, what=lambda: f"status() of {name!r} from only {list(seen)}")
    return seen


def test_every_worker_gets_its_rows_of_one_forward_per_layer_bit_for_bit(app, workers):
    tokens = (2, 0, 3)
    ws = workers(*tokens)
    want = serve_reference(app, tokens, lambda i: 10 + i)
    lone = {i: app.client.forward(rows(T, 10 + i, 1), 1) for i, T in enumerate(tokens) if T}
    before = {n: counters(n) for n in ("pair", "half")}
    with app.client.cohort(ws, max_tokens=4, name="exact") as cohort:
        assert cohort.status()["path"] == "session"
        for _ in range(3):
            got = cohort.step([10, 11, 12])
        status = cohort.status()
    leased = {n: status["deployments"][n]["replica"] for n in ("pair", "half")}
    after = {n: counters(n) for n in ("pair", "half")}
    for i, T in enumerate(tokens):
        for layer in (1, 2):
            assert torch.equal(got[i][layer], want[layer][i]), (i, layer)
        assert got[i][2].dtype == torch.bfloat16 and got[i][1].dtype == torch.float32
        if T:
            torch.testing.assert_close(got[i][1], lone[i], rtol=1e-5, atol=1e-5)
    assert status["session_steps"] == 3 and status["serve_steps"] == 0 and status["sessions"] == 1, status
    # the default step bound: a layer's two bounds (its peers, then its forward: the groups' call
    # bound each), the peers' margin, one move of the session to a healthy group and a probe
    call_s = COMMON["collective_timeout_s"] + COMMON["call_margin_s"]
    assert status["step_timeout_s"] == 2 * call_s + ANSWER_MARGIN_S + SESSION_MOVE_S + PROBE_S
    assert status["step_timeout_s"] == answer_bound_s(call_s) + SESSION_MOVE_S + PROBE_S
    for name in ("pair", "half"):  # one forward per layer per step, of every worker's rows
        b, a = before[name][leased[name]], after[name][leased[name]]
        assert a["forwards"] - b["forwards"] == 3
        assert a["requests"] - b["requests"] == 3 * 2  # the two workers with rows; the empty one adds nothing
        assert a["batch_tokens"]["recent"][-3:] == [5, 5, 5]
        assert a["sessions"]["tokens"] - b["sessions"]["tokens"] == 15


def test_the_replica_lists_the_cohorts_session_with_its_workers(app, workers):
    ws = workers(1, 1)
    with app.client.cohort(ws, name="listed") as cohort:
        cohort.step([1, 2])
        (active,) = direct("half").status()["sessions"]["open"]
        names = cohort.status()["workers"]
    assert active["client"] == "listed" and active["kind"] == "cohort" and active["workers"] == names
    assert active["forwards"] == 1 and active["rows"] == 2 and active["joined"] == 2
    assert all(n.startswith("Echo:") for n in names)


def test_a_bad_worker_fails_the_step_naming_it_and_the_cohort_keeps_serving(app, workers):
    """Every misbehaviour in turn on one cohort: each fails its step naming worker 1 and undoes
    the healthy worker's step, and the next step answers exactly, still on the session."""
    ws = workers(2, 3)
    want = serve_reference(app, (2, 3), lambda i: 20 + i)
    with app.client.cohort(ws, max_tokens=4, name="bad") as cohort:
        for failed, fault in enumerate(["nan", "width", "rows", "too_many", "raise"], start=1):
            ray.get(ws[1].set_fault.remote(fault))
            with pytest.raises(WorkerError) as err:
                cohort.step([20, 21])
            assert err.value.index == 1 and not err.value.died and "attention worker 1" in str(err.value), fault
            assert ray.get(ws[0].counts.remote()) == (failed - 1, failed), fault  # (steps, aborts)
            ray.get(ws[1].set_fault.remote(None))
            got = cohort.step([20, 21])
            assert cohort.status()["path"] == "session", fault
            assert all(torch.equal(got[i][layer], want[layer][i]) for i in (0, 1) for layer in (1, 2)), fault


def test_cohort_arguments_are_checked(app, workers):
    pair = workers(1, 1)  # the same two actors for every check: a refused cohort leaves them free
    with pytest.raises(ValueError, match="max_tokens"):
        app.client.cohort(pair[:1], max_tokens=0)
    with pytest.raises(ValueError, match="non-empty list"):
        app.client.cohort([])
    with pytest.raises(ValueError, match=r"layer\(s\) \[9\]"):
        app.client.cohort(pair[:1], layers=[9])
    with pytest.raises(ValueError, match="twice"):
        app.client.cohort(pair[:1] * 2)
    with pytest.raises(MoERequestError, match="max_tokens_per_request"):
        app.client.cohort(pair, max_tokens=40)  # 2 x 40 rows > 64 per forward
    not_a_worker = ray.remote(num_cpus=0)(type("Plain", (), {"ping": lambda self: 1})).remote()
    with pytest.raises(WorkerError, match="AttentionWorker"):
        app.client.cohort([not_a_worker])
    ray.kill(not_a_worker)
    with app.client.cohort(pair) as cohort, pytest.raises(ValueError, match="one input per worker"):
        cohort.step([1])


def test_a_dead_worker_is_named_and_closes_the_cohort(app, workers):
    ws = workers(1, 1)
    with app.client.cohort(ws, name="dying") as cohort:
        cohort.step([1, 2])
        ray.kill(ws[0], no_restart=True)
        with pytest.raises(WorkerError) as err:
            cohort.step([1, 2])
        assert err.value.index == 0 and err.value.died
        with pytest.raises(RuntimeError, match="closed: worker 0"):
            cohort.step([1, 2])


def test_without_a_session_the_step_runs_aggregated_on_the_serve_path(app, workers):
    """"half" takes 2 sessions (max_sessions): with two lanes open on it, the cohort is refused
    there, holds nothing, and runs its step on the Serve path, still one forward per layer."""
    ws = workers(2, 1)
    want = serve_reference(app, (2, 1), lambda i: 30 + i)
    before = counters("pair")
    with direct("half").lane(max_tokens=4, name="holder-1") as one, \
            direct("half").lane(max_tokens=4, name="holder-2") as two:
        assert one.status()["deployments"]["half"]["path"] == two.status()["deployments"]["half"]["path"] == "session"
        with app.client.cohort(ws, max_tokens=4, wait_s=0.5, retry_s=60, name="aside") as cohort:
            got = cohort.step([30, 31])
            status = cohort.status()
        assert torch.equal(one.forward(rows(1, 0, 2, torch.bfloat16), 2), two.forward(rows(1, 0, 2, torch.bfloat16), 2))
    assert status["path"] == "serve" and status["serve_steps"] == 1 and status["session_steps"] == 0
    assert "2 session(s) are open on this group and max_sessions = 2" in status["deployments"]["half"]["why_serve"]
    assert all(torch.equal(got[i][layer], want[layer][i]) for i in (0, 1) for layer in (1, 2))
    after = counters("pair")
    forwards = sum(after[r]["forwards"] - before[r]["forwards"] for r in after)
    assert forwards == 1  # still one forward per layer for both workers
    # "pair" opened nothing for the refused cohort: it holds a session on every group or none
    assert not any(direct("pair").status()["sessions"]["open"] for _ in range(4))


def rank_pid(cohort, deployment: str, rank: int) -> int:
    """The pid of ``rank`` of the group serving the cohort's session on ``deployment`` now."""
    from deployments.client.session import rank_of

    group = cohort.session.groups()[deployment]
    return ray.get(rank_of(group, rank).info.remote(), timeout=30)["pid"]


def test_a_killed_rank_costs_the_caller_nothing_with_two_replicas(app, workers):
    """SIGKILL a rank of the session's "pair" replica while steps run: the workers' peers move
    the session to the other replica by themselves and the step goes on there, so every step
    answers with the same rows as before the kill, none aborted, re-run or on the Serve path."""
    ws = workers(1, 2)
    want = serve_reference(app, (1, 2), lambda i: 40 + i)

    def step() -> bool:
        got = cohort.step([40, 41])
        return all(torch.equal(got[i][layer], want[layer][i]) for i in (0, 1) for layer in (1, 2))

    def moved_on() -> bool:  # the session is on a healthy replica's group now
        status = cohort.status()
        return status["moves"] >= 1 and status["deployments"]["pair"]["replica"] not in (None, killed)

    with app.client.cohort(ws, max_tokens=2, retry_s=0.5, name="victim") as cohort, CallLoop(step) as load:
        killed = cohort.status()["deployments"]["pair"]["replica"]
        os.kill(rank_pid(cohort, "pair", 1), signal.SIGKILL)
        wait_until(moved_on, timeout_s=60, what=lambda: f"a move to another replica: {cohort.status()}",
                   every_s=0.25)
        marks = load.calls()
        wait_until(lambda: load.calls() >= marks + 3, timeout_s=60, what="3 more steps after the move")
        load.stop()
        status = cohort.status()
    assert not load.errors, load.errors
    assert all(load.results)  # bit for bit: the other replica runs the same ranks' math
    assert (status["moves"], status["reruns"], status["aborts"], status["serve_steps"]) == (1, 0, 0, 0), status
    assert status["session_steps"] == status["steps"] == load.calls() and status["sessions"] == 1, status


def test_a_stalled_rank_costs_the_step_a_move_and_nothing_else(app, workers):
    """SIGSTOP a rank of the session's "pair" replica: rank 0's collective gives up within the
    collective timeout, every worker's peer hears the group failed and moves the session to the
    other replica, and the step goes on there: the same rows, no abort, no re-run."""
    wait_until(lambda: len({st["replica"] for st in (direct("pair").status() for _ in range(16))
                            if st["healthy"]}) >= 2,
               timeout_s=300, what="two healthy pair replicas (Serve replaced the one the test above broke)",
               every_s=1.0)
    ws = workers(1, 1)
    want = serve_reference(app, (1, 1), lambda i: 50 + i)
    with app.client.cohort(ws, name="stalled") as cohort:
        cohort.step([50, 51])
        stopped = cohort.status()["deployments"]["pair"]["replica"]
        pid = rank_pid(cohort, "pair", 1)
        os.kill(pid, signal.SIGSTOP)
        try:
            got = cohort.step([50, 51])
        finally:
            with contextlib.suppress(ProcessLookupError):  # the broken group's replica ended it
                os.kill(pid, signal.SIGCONT)
        status = cohort.status()
    assert all(torch.equal(got[i][layer], want[layer][i]) for i in (0, 1) for layer in (1, 2))
    assert (status["moves"], status["reruns"], status["aborts"]) == (1, 0, 0), status
    assert status["deployments"]["pair"]["replica"] != stopped
    assert all(ray.get(w.counts.remote()) == (2, 0) for w in ws)  # (steps, aborts)


def test_a_stalled_worker_is_named_within_the_call_bound(app, workers):
    """A worker stuck in attend() sends nothing: rank 0 ends the session once the other worker's
    rows have waited a call bound, naming the stuck one; the step fails with its WorkerError
    without waiting for the stuck call."""
    ws = workers(1, 1)
    with app.client.cohort(ws, step_timeout_s=12.0, name="slow-worker") as cohort:  # > the 8 s call bound
        ray.get(ws[0].set_fault.remote("sleep"))
        with pytest.raises(WorkerError) as err:
            cohort.step([1, 2])
        assert err.value.index == 0 and "not sent layer 1 within the call bound" in str(err.value)
    ray.kill(ws[0])  # still in its minute-long attend(): the fixture's reuse check would wait 10 s on it


def test_a_session_of_independent_peers_is_one_forward_per_layer(app):
    """``MoEClient.session`` + ``join``: two peers (threads here; processes in
    tests/test_plain_deployment.py) each get their rows of one forward per layer, bit for bit;
    bad rows fail their peer only; a closed session tells every peer so."""
    from concurrent.futures import ThreadPoolExecutor

    from deployments.client import SessionError, SessionTicket, join
    from deployments.dataplane.errors import Failure

    tokens = (2, 1)
    want = serve_reference(app, tokens, lambda i: 60 + i)
    before = counters("half")
    with app.client.session(peers=2, max_tokens=4, name="pair-of-peers") as session:
        ticket = SessionTicket.from_json(session.ticket.to_json())  # as a peer process gets it
        peers = [join(ticket, i) for i in range(2)]
        assert direct("half").status()["sessions"]["open"][0]["kind"] == "session"

        def step(i: int, bad: bool = False) -> dict:
            out = {}
            for layer, dtype in ((1, torch.float32), (2, torch.bfloat16)):
                x = rows(tokens[i], 60 + i, layer, dtype)
                if bad and layer == 1:
                    x[0, 0] = float("nan")
                out[layer] = peers[i].forward(x, layer)
            return out

        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(step, range(2)))
            assert all(torch.equal(got[i][layer], want[layer][i]) for i in (0, 1) for layer in (1, 2))
            bad = pool.submit(step, 1, True)
            good = pool.submit(lambda: peers[0].forward(rows(2, 60, 1), 1))
            with pytest.raises(MoERequestError, match="NaN"):
                bad.result(timeout=60)
            assert good.result(timeout=60).shape == (2, H)  # the good peer's layer ran without the bad rows
            # the session is still in step: layer 2 next for peer 0, the bad peer's layer 2 is owed
            pair = list(pool.map(lambda i: peers[i].forward(rows(tokens[i], 60 + i, 2, torch.bfloat16), 2),
                                 range(2)))
            assert all(torch.equal(pair[i], want[2][i]) for i in (0, 1))
    with pytest.raises(SessionError) as ended:
        peers[0].forward(rows(2, 60, 1), 1)
    assert ended.value.failure is Failure.SESSION_ENDED
    after = counters("half")
    forwards = sum(after[r]["forwards"] - before[r]["forwards"] for r in after)
    assert forwards == 2  # layer 2 of both steps: one forward each for both peers


def test_a_peer_on_a_device_channel_gets_the_serve_paths_answer(app):
    """A peer joined with a device sends its rows to the ranks, and gets its slice back, over a
    gloo channel per group (NCCL between GPUs: tests/test_gpu.py), in the same forward as a peer
    sending bytes; both answers equal the Serve path's bit for bit, step after step."""
    from concurrent.futures import ThreadPoolExecutor

    from deployments.client import join

    tokens = (2, 3)
    want = serve_reference(app, tokens, lambda i: 80 + i)
    with app.client.session(peers=2, max_tokens=4, name="channel-and-bytes") as session:
        assert {g.channel for g in session.ticket.groups} == {"gloo"}  # CPU ranks
        peers = [join(session.ticket, 0, device="cpu"), join(session.ticket, 1)]

        def step(i: int) -> bool:
            return all(torch.equal(peers[i].forward(rows(tokens[i], 80 + i, layer, dtype), layer), want[layer][i])
                       for layer, dtype in ((1, torch.float32), (2, torch.bfloat16)))

        with ThreadPoolExecutor(2) as pool:
            assert all(pool.map(step, range(2))) and all(pool.map(step, range(2)))
        for p in peers:
            p.close()


def test_an_elastic_session_takes_late_idle_and_departed_peers(app):
    """``idle_after_s``: peer 0 steps before peer 1 has joined; peer 1 joins later and steps while
    peer 0 idles (peer 0 sits those steps out); peer 1 leaves and peer 0 steps on. Nobody waits on
    an absent peer, no error reaches either, and each answer is the Serve path's for its rows, bit
    for bit."""
    from deployments.client import join

    # The Serve path's answers first: while the session holds the groups, Serve forwards wait.
    want = {seed: serve_reference(app, (2,), lambda _, s=seed: s) for seed in range(70, 75)}

    def step(peer, seed: int) -> bool:
        return all(torch.equal(peer.forward(rows(2, seed, layer, dtype), layer), want[seed][layer][0])
                   for layer, dtype in ((1, torch.float32), (2, torch.bfloat16)))

    with app.client.session(peers=2, max_tokens=4, idle_after_s=0.5, name="elastic") as session:
        first = join(session.ticket, 0)
        assert step(first, 70) and step(first, 71)
        with join(session.ticket, 1) as second:
            assert step(second, 72) and step(second, 73)
        assert step(first, 74)
        first.close()
