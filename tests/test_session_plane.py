"""The data plane without Ray or torch: a rank-0 host and a linked rank in this process, peers on
threads, a stand-in forward (``out = 2 x + layer`` in float32: exact, so results compare with
``==``). What is checked: one forward per layer over every peer's rows, each peer its own slice,
0-row peers, and every failure kind of ``dataplane.errors`` with the peer it names."""

from __future__ import annotations

import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch
from waiting import wait_until

from deployments.common.wire import DeviceRows, WireTensor
from deployments.dataplane import frames
from deployments.dataplane.errors import Action, Failure, JoinRefused, SessionError
from deployments.dataplane.host import GroupHost, RankLink
from deployments.dataplane.peer import GroupEndpoint, SessionTicket

H = 8
LAYERS = (1, 2)
CALL_S = 1.0  # short: the stalled-peer and stalled-rank cases wait this long


class FakeCompute:
    def __init__(self, rank: int, fail_on: int | None = None):
        self.rank, self.fail_on = rank, fail_on
        self.runs: list[tuple[int, int]] = []
        self.limit = 64  # rows of one forward

    def check(self, layer, x, logits, max_tokens, what):
        if layer not in LAYERS:
            raise ValueError(f"layer {layer} is not served")
        if x.shape[1:] != (H,) or x.shape[0] > max_tokens:
            raise ValueError(f"{what} has shape {x.shape}")
        if not x.all_finite():
            raise ValueError(f"{what} has NaN or Inf")
        return layer, x, logits

    def run(self, layer, x, logits):
        self.runs.append((layer, x.shape[0]))
        if layer == self.fail_on:
            raise RuntimeError("boom")
        if self.rank:
            return None, "replicated"
        if isinstance(x, DeviceRows):  # came over a device channel: answered on the device
            return DeviceRows(x.tensor * 2 + layer, "float32"), "replicated"
        return WireTensor(x.array * 2 + layer, "float32"), "replicated"

    def forward_limit(self):
        return self.limit


@pytest.fixture
def group(request):
    world, fail_on = getattr(request, "param", (2, None))
    computes = [FakeCompute(r, fail_on if r == 1 else None) for r in range(world)]
    host = GroupHost("127.0.0.1", frames.new_secret(), world, computes[0], CALL_S, H, "float32", "test",
                     channel_device="cpu")
    links = [RankLink(host.address, host.group_secret, r, computes[r], 5.0) for r in range(1, world)]
    host.wait_ranks(5.0)
    yield host, computes
    for link in links:
        link.stop()
    host.stop()


def ticket(host: GroupHost, peers: int, max_tokens: int = 4, idle_after_s: float | None = None,
           **open_args) -> tuple[SessionTicket, int]:
    number, secret = host.open(peers, max_tokens, "s", idle_after_s, **open_args)
    g = GroupEndpoint("d", "r1", "lease", *host.address, secret, number, LAYERS, H, "float32", CALL_S, max_tokens,
                      host.store_port, host.channel_backend)
    return SessionTicket("s", peers, (g,)), number


def rank_runs(computes: list[FakeCompute], n: int) -> list[tuple[int, int]]:
    """Rank 0's forwards, once every rank has run ``n``: rank 0 answers the peers before it reads
    the other ranks' DONEs, so they may still be running the last one when a peer has its answer."""
    deadline = time.monotonic() + 10
    while any(len(c.runs) < n for c in computes) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert all(c.runs == computes[0].runs for c in computes), [c.runs for c in computes]
    return computes[0].runs


def rows(n: int, seed: int) -> WireTensor:
    return WireTensor(np.random.default_rng(seed).standard_normal((n, H), dtype=np.float32), "float32")


def run_peers(t: SessionTicket, per_peer, peers=None):
    """Each peer runs ``per_peer(peer, index)`` on its own thread; results or exceptions."""
    joined = peers or [t.join(i) for i in range(t.peers)]
    with ThreadPoolExecutor(len(joined)) as pool:
        futures = [pool.submit(per_peer, p, i) for i, p in enumerate(joined)]
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout=30))
            except Exception as e:
                out.append(e)
    return out, joined


def test_one_forward_per_layer_over_every_peer(group):
    host, computes = group
    t, number = ticket(host, 3)
    sizes = [2, 0, 3]  # a peer with nothing to send still takes part

    def step(peer, i):
        got = []
        for layer in LAYERS:
            x = rows(sizes[i], 10 * i + layer)
            out, tail = peer.forward_wire(x, layer)
            assert tail == "replicated"
            assert np.array_equal(out.array, x.array * 2 + layer)
            got.append(out.shape)
        return got

    results, _ = run_peers(t, step)
    assert results == [[(n, H)] * 2 for n in sizes]
    # every rank ran each layer once, over the 5 rows of the 3 peers
    assert rank_runs(computes, 2) == [(1, 5), (2, 5)]
    counts = host.snapshot(5.0)["sessions"][number]
    assert (counts["forwards"], counts["parts"], counts["rows"]) == (2, 4, 10)
    assert counts["layer_rows"] == {1: 5, 2: 5} and counts["tails"] == {"replicated": 2}


def test_bad_rows_fail_their_peer_only(group):
    host, computes = group
    t, _ = ticket(host, 2)
    bad = WireTensor(np.full((1, H), np.nan, np.float32), "float32")

    def step(peer, i):
        return peer.forward_wire(bad if i else rows(2, i), 1)

    (ok, err), peers = run_peers(t, step)
    assert ok[0].shape == (2, H)
    assert isinstance(err, SessionError) and err.failure is Failure.INPUT and "peer 1" in str(err)
    assert err.action is Action.CALLER_ERROR
    # the session goes on: both peers step again
    again, _ = run_peers(t, lambda p, i: p.forward_wire(rows(1, i), 2)[0].shape, peers)
    assert again == [(1, H), (1, H)]
    assert rank_runs(computes, 2) == [(1, 2), (2, 2)]


def test_a_peers_own_failure_ends_the_layer_for_all_and_the_session_stays(group):
    host, _ = group
    t, _ = ticket(host, 2)

    def step(peer, i):
        if i == 1:
            raise peer.fail(1, "attend raised KeyError")
        return peer.forward_wire(rows(1, 0), 1)

    results, peers = run_peers(t, step)
    assert all(isinstance(e, SessionError) and e.failure is Failure.PEER_FAILED and e.peer == 1 for e in results)
    assert "attend raised KeyError" in str(results[0])
    again, _ = run_peers(t, lambda p, i: p.forward_wire(rows(1, i), 1)[0].shape, peers)
    assert again == [(1, H), (1, H)]


def test_a_dead_peer_ends_the_session_naming_it(group):
    host, _ = group
    t, number = ticket(host, 3)
    peers = [t.join(i) for i in range(3)]

    def step(peer, i):
        if i == 2:  # goes once the others wait in the layer
            while host.state(number)["waiting_for"] != [2]:
                time.sleep(0.01)
            peer.close("killed")
            return None
        return peer.forward_wire(rows(1, i), 1)

    results, _ = run_peers(t, step, peers)
    for e in results[:2]:
        assert isinstance(e, SessionError) and e.failure is Failure.PEER_GONE and e.peer == 2
        assert e.action is Action.SESSION_OVER
    assert host.state(number)["failure"] == "peer_gone"
    with pytest.raises(SessionError) as closed:
        peers[0].forward_wire(rows(1, 0), 2)
    assert closed.value.failure is Failure.SESSION_ENDED


def test_a_stalled_peer_ends_the_session_within_the_call_bound(group):
    host, _ = group
    t, _ = ticket(host, 2)
    results, _ = run_peers(t, lambda p, i: p.forward_wire(rows(1, i), 1) if i == 0 else None)
    e = results[0]
    assert isinstance(e, SessionError) and e.failure is Failure.PEER_STALLED and e.peer == 1
    assert f"{CALL_S:.0f} s" in str(e)


def test_peers_out_of_step(group):
    host, _ = group
    t, _ = ticket(host, 2)
    results, _ = run_peers(t, lambda p, i: p.forward_wire(rows(1, i), LAYERS[i]))
    assert all(isinstance(e, SessionError) and e.failure is Failure.OUT_OF_STEP for e in results)


@pytest.mark.parametrize("group", [(2, 2)], indirect=True)
def test_a_failed_rank_breaks_the_group(group):
    """Rank 1 fails layer 2 after rank 0 computed it (rank 0's own output is the group's and
    answered at once; the other ranks' answers are read before the next batch): the next batch
    finds it, every peer hears the group failed, and the host opens nothing more."""
    host, _ = group
    t, _ = ticket(host, 2)
    results, peers = run_peers(t, lambda p, i: p.forward_wire(rows(1, i), 2))
    assert [r[0].shape for r in results] == [(1, H), (1, H)]
    results, _ = run_peers(t, lambda p, i: p.forward_wire(rows(1, i), 1), peers)
    for e in results:
        assert isinstance(e, SessionError) and e.failure is Failure.GROUP_FAILED
        assert e.action is Action.RETRY_ELSEWHERE
    assert "rank 1" in host.failed and "boom" in host.failed
    with pytest.raises(RuntimeError, match="broken"):
        host.open(1, 1, "after")


def test_closing_a_session_ends_it_as_never_run(group):
    host, _ = group
    t, number = ticket(host, 1)
    peer = t.join(0)
    assert peer.forward_wire(rows(1, 0), 1)[0].shape == (1, H)
    host.close(number, "lease expired", 5.0)
    with pytest.raises(SessionError) as e:
        peer.forward_wire(rows(1, 0), 1)
    assert e.value.failure is Failure.SESSION_ENDED and e.value.action is Action.START_OVER
    assert "lease expired" in str(e.value)


def test_only_the_sessions_peers_join_and_strays_stall_nothing(group):
    host, _ = group
    t, _ = ticket(host, 1)
    g = t.groups[0]
    stray = socket.create_connection(host.address)  # connects and says nothing
    with pytest.raises(JoinRefused, match="not one this group knows") as refused:
        frames.connect(host.address, frames.new_secret(), frames.Role.PEER, 0, 5.0)
    assert refused.value.reason == "secret" and refused.value.status == 403
    with pytest.raises(ValueError, match="peer index"):
        t.join(1)
    peer = t.join(0)
    with pytest.raises(JoinRefused, match="another peer has joined") as refused:  # index 0 has joined already
        frames.connect(host.address, g.secret, frames.Role.PEER, 0, 5.0)
    assert refused.value.reason == "taken"
    assert peer.forward_wire(rows(2, 0), 1)[0].shape == (2, H)
    stray.close()


def test_ticket_round_trips_as_json(group):
    host, _ = group
    t, _ = ticket(host, 2)
    assert SessionTicket.from_json(t.to_json()) == t


@pytest.mark.parametrize(("dtype", "shape"), [("float32", (3, H)), ("bfloat16", (2, H)), ("bfloat16", (0, H)),
                                              ("float32", (5,))])
def test_arrays_cross_a_connection_as_their_bytes(dtype, shape):
    a, b = socket.socketpair()
    bits = np.random.default_rng(0).integers(-2**15, 2**15, size=shape, dtype=np.int16)
    data = WireTensor(bits if dtype == "bfloat16" else bits.astype(np.float32), dtype)
    frames.send(a, frames.Kind.RESULT, layer=7, text="replicated", data=data)
    got = frames.recv(b)
    assert (got.kind, got.layer, got.text) == (frames.Kind.RESULT, 7, "replicated")
    assert got.data.dtype == dtype and got.data.array.dtype == data.array.dtype
    assert np.array_equal(got.data.array, data.array)
    a.close()
    with pytest.raises(frames.ConnectionLost):
        frames.recv(b)


# -- device channels (gloo between CPU processes here; NCCL between GPUs in tests/test_gpu.py) ---


def test_rows_over_a_device_channel_share_the_layer_with_bytes(group):
    """Peer 0 joins with a device: its rows go to rank 0 and its slice comes back over its channel
    (as ``DeviceRows``); peer 1's travel as bytes; one forward per layer over both, 0 rows too."""
    host, computes = group
    t, number = ticket(host, 2)
    peers = [t.join(0, device="cpu"), t.join(1)]
    sizes = {0: [3, 0], 1: [2, 1]}  # per peer, per step

    def step(peer, i):
        for s, n in enumerate(sizes[i]):
            for layer in LAYERS:
                x = rows(n, 10 * i + s + layer)
                out, _ = peer.forward_wire(x, layer)
                assert isinstance(out, DeviceRows) == (i == 0)
                got = out.to_torch().numpy() if i == 0 else out.array
                assert np.array_equal(got, x.array * 2 + layer)
        return True

    results, _ = run_peers(t, step, peers)
    assert results == [True, True]
    assert rank_runs(computes, 4) == [(1, 5), (2, 5), (1, 1), (2, 1)]
    assert list(host.sessions[number].channels) == [0]
    peers[0].close()  # its connection closes: a strict session ends, and its channel with it
    wait_for(lambda: number not in host.sessions, "the session ended")
    peers[1].close()


def test_a_peer_whose_channel_rows_never_come_is_dropped_within_the_call_bound(group):
    host, _ = group
    t, number = ticket(host, 2)
    a, b = t.join(0, device="cpu"), t.join(1)
    header = DeviceRows(torch.zeros(2, H), "float32")  # the header says rows follow on the channel ...
    frames.send(a.socks["d"], frames.Kind.FORWARD, flags=a.bounds[1], index=0, layer=1, data=header)
    a.channels["d"].close()  # ... and they never come
    with pytest.raises(SessionError) as err:  # rank 0's wait for them ends at the call bound
        b.forward_wire(rows(1, 1), 1)
    assert err.value.failure is Failure.PEER_GONE and err.value.peer == 0 and "device channel" in str(err.value)
    assert host.state(number)["failure"] == "peer_gone"


def test_a_device_channel_must_match_the_groups_ranks(group):
    host, _ = group
    t, _ = ticket(host, 1)
    with pytest.raises(ValueError, match="channel"):  # CPU ranks offer gloo, never NCCL
        t.join(0, device="cuda")
    bare = SessionTicket(t.name, 1, tuple(replace(g, store_port=0, channel="") for g in t.groups))
    with pytest.raises(ValueError, match="offers no device channel"):
        bare.join(0, device="cpu")


# -- elastic sessions: peers come, go and idle ------------------------------------------------

IDLE_S = 0.2  # an elastic session's idle_after_s here: short, the idle cases wait it


def steps(peer, i, n: int, size: int = 1):
    """``n`` steps over LAYERS; each output checked against the stand-in forward."""
    for s in range(n):
        for layer in LAYERS:
            x = rows(size, 100 * i + 10 * s + layer)
            out, _ = peer.forward_wire(x, layer)
            assert np.array_equal(out.array, x.array * 2 + layer)
    return n


def wait_for(predicate, what: str, timeout_s: float = 10.0) -> None:
    wait_until(predicate, timeout_s, what, every_s=0.005)


def in_step(host: GroupHost, number: int, t: SessionTicket, pool: ThreadPoolExecutor) -> list:
    """Every peer of ``t`` joined and active in the group's step, at a step's start. Peer 0 steps
    first, alone; the others' first layers are held for the next step, which they share."""
    peers = [t.join(i) for i in range(t.peers)]
    peers[0].forward_wire(rows(1, 0), LAYERS[0])
    later = [pool.submit(p.forward_wire, rows(1, i), LAYERS[0]) for i, p in enumerate(peers) if i]
    wait_for(lambda: len(host.sessions[number].held) == t.peers - 1, "the others held")
    peers[0].forward_wire(rows(1, 0), LAYERS[1])  # its step ends: the held ones start the next
    later.append(pool.submit(peers[0].forward_wire, rows(1, 0), LAYERS[0]))
    [f.result(timeout=30) for f in later]
    ends = [pool.submit(p.forward_wire, rows(1, i), LAYERS[1]) for i, p in enumerate(peers)]
    [f.result(timeout=30) for f in ends]
    assert host.state(number)["active"] == list(range(t.peers))
    return peers


def test_elastic_peers_that_never_join_hold_nobody(group):
    host, computes = group
    t, number = ticket(host, 4, idle_after_s=IDLE_S)
    with t.join(2) as peer:
        assert steps(peer, 2, 3) == 3
    assert computes[0].runs == [(1, 1), (2, 1)] * 3
    state = host.state(number)
    assert state["elastic"] and state["failure"] is None and state["layers"] == 6


def test_elastic_peers_in_step_share_one_forward_per_layer(group):
    host, computes = group
    t, _ = ticket(host, 2, idle_after_s=CALL_S)  # the longest wait: both always in every step
    sizes = [3, 0]  # a peer with no tokens still takes part with 0 rows
    results, _ = run_peers(t, lambda p, i: steps(p, i, 5, sizes[i]))
    assert results == [5, 5]
    # after the first step (which may have started before the second peer's first layer)
    # every step is one forward per layer over both peers' rows
    assert computes[0].runs[-8:] == [(1, 3), (2, 3)] * 4
    assert len(computes[0].runs) in (10, 12)  # 5 steps, the first maybe split in two
    steps_run = host.snapshot(5.0)["group"]["steps"]
    assert len(computes[0].runs) == len(LAYERS) * steps_run  # each group step: a forward per layer


def test_elastic_idle_peer_sits_steps_out_and_rejoins_at_a_step_start(group):
    host, computes = group
    t, number = ticket(host, 2, idle_after_s=IDLE_S)
    a, b = t.join(0), t.join(1)
    with ThreadPoolExecutor(2) as pool:
        both = [pool.submit(steps, a, 0, 2, 1), pool.submit(steps, b, 1, 2, 2)]
        assert [f.result(timeout=30) for f in both] == [2, 2]
        # b goes idle: a's next step waits IDLE_S for it once, then runs on without it
        assert steps(a, 0, 2) == 2
        assert host.state(number)["active"] == [0]
        # b comes back half-way through a's step: it waits for the group's next step
        a.forward_wire(rows(1, 0), LAYERS[0])
        back = pool.submit(steps, b, 1, 1, 2)
        wait_for(lambda: host.state(number)["waiting_for"] == [] and 1 in host.sessions[number].held,
                 "b held for the next step")
        a.forward_wire(rows(1, 1), LAYERS[1])  # a's step ends alone
        assert steps(a, 0, 1) == 1  # the next step is both: a waits for nobody, b was held
        assert back.result(timeout=30) == 1
    sizes = [n for _, n in computes[0].runs]
    assert sum(sizes) == 12 + 12 and set(sizes) <= {1, 2, 3}  # every row once; a step alone or shared
    assert sizes[-4:] == [1, 1, 3, 3]  # a's half-step alone, then one shared step
    steps_run = host.snapshot(5.0)["group"]["steps"]
    assert len(sizes) == len(LAYERS) * steps_run  # alone or shared, a forward per layer and step
    assert host.state(number)["failure"] is None


def test_elastic_peer_that_says_it_is_idle_is_parked_without_the_wait(group):
    host, computes = group
    t, number = ticket(host, 2, idle_after_s=CALL_S)  # the longest wait: a parked-by-wait peer shows
    with ThreadPoolExecutor(2) as pool:
        a, b = in_step(host, number, t, pool)  # both active, at a step's start
    assert b.idle()  # between its steps: sent
    wait_for(lambda: host.state(number)["active"] == [0], "b parked by its notice")
    assert steps(a, 0, 2) == 2  # a's steps start without waiting for b
    state = host.state(number)
    assert (state["idled"], state["parked"], state["failure"]) == (1, 0, None)
    assert steps(b, 1, 1) == 1 and host.state(number)["active"] == [1]  # b's next step brings it back
    with b.calling:  # a call in flight: the peer is busy, nothing is sent
        assert not b.idle()


def test_elastic_peer_killed_mid_step_leaves_the_others_serving(group):
    host, computes = group
    t, number = ticket(host, 2, idle_after_s=CALL_S)
    a, b = t.join(0), t.join(1)

    def b_dies(peer, i):
        peer.forward_wire(rows(1, 7), LAYERS[0])
        peer.close("killed")  # half-way through its step
        return None

    with ThreadPoolExecutor(2) as pool:
        dying = pool.submit(b_dies, b, 1)
        assert steps(a, 0, 3) == 3  # its step's second layer runs without b
        dying.result(timeout=30)
    state = host.state(number)
    assert state["failure"] is None and state["active"] == [0]
    before = len(computes[0].runs)
    with t.join(1) as again:  # the slot can be joined again, at a step start
        results, _ = run_peers(t, lambda p, i: steps(p, i, 2), [a, again])
        assert results == [2, 2]
    # Whoever sends first starts a step: the other joins it if its first layer comes before the
    # step's first forward runs, else at the next step start (or, when one peer's two steps are
    # over before the other's thread sends, every step runs alone). Every row runs once, each step
    # is a forward per layer of the same peers, and no step mixes with another.
    sizes = [n for _, n in computes[0].runs[before:]]
    assert sum(sizes) == 8 and set(sizes) <= {1, 2} and sizes[0::2] == sizes[1::2], sizes


def test_elastic_stalled_or_out_of_step_peer_is_dropped_alone(group):
    host, _ = group
    t, number = ticket(host, 3, idle_after_s=IDLE_S)
    with ThreadPoolExecutor(3) as pool:
        a, b, c = in_step(host, number, t, pool)
        first = [pool.submit(p.forward_wire, rows(1, i), LAYERS[0]) for i, p in enumerate((a, b, c))]
        [f.result(timeout=30) for f in first]
        # mid-step: b never sends layer 2 (stalled), c sends a layer out of order
        later = [pool.submit(a.forward_wire, rows(1, 0), LAYERS[1]), pool.submit(c.forward_wire, rows(1, 2), LAYERS[0])]
        out, _ = later[0].result(timeout=30)
        assert out.shape == (1, H)
        with pytest.raises(SessionError) as wrong:
            later[1].result(timeout=30)
    assert wrong.value.failure is Failure.OUT_OF_STEP and wrong.value.peer == 2
    assert host.state(number)["active"] == [0] and host.state(number)["failure"] is None
    with pytest.raises(SessionError) as stalled:
        b.forward_wire(rows(1, 1), LAYERS[1])
    assert stalled.value.failure is Failure.PEER_STALLED and stalled.value.peer == 1
    assert f"{CALL_S:.0f} s" in str(stalled.value)


def test_elastic_failure_fails_its_own_peer_only(group):
    host, _ = group
    t, number = ticket(host, 2, idle_after_s=CALL_S)

    def step(peer, i):
        got = peer.fail(LAYERS[0], "attention blew up") if i else peer.forward_wire(rows(2, 0), LAYERS[0])[0].shape
        peer.forward_wire(rows(1, i), LAYERS[1])
        return got

    with ThreadPoolExecutor(2) as pool:
        results, _ = run_peers(t, step, in_step(host, number, t, pool))
    assert results[0] == (2, H)
    assert results[1].failure is Failure.PEER_FAILED and "attention blew up" in str(results[1])
    assert host.state(number)["active"] == [0, 1]


@pytest.mark.parametrize("bad", [0, -1.0, CALL_S * 2, "soon", True])
def test_elastic_idle_after_is_checked(group, bad):
    host, _ = group
    with pytest.raises(ValueError, match=r"idle_after_s must be None or seconds in \(0, call bound"):
        host.open(2, 4, "s", bad)


# -- many sessions on one group: shared, lasting, watched --------------------------------------


def frames_waiting(host: GroupHost, n: int) -> None:
    """Until ``n`` peers' sockets on rank 0 hold unread bytes (their frames came while the loop is
    held)."""
    def readable() -> bool:
        socks = [s for session in host.sessions.values() for s in session.sockets if s is not None]
        return len(select.select(socks, [], [], 0)[0]) >= n

    wait_for(readable, f"{n} peers' frames in rank 0's sockets")


def hold_loop(host: GroupHost) -> threading.Event:
    """Hold rank 0's loop (a command that waits) until the event is set: frames sent meanwhile
    wait in its sockets and are all read in its next round. Returns once the loop is held: a frame
    sent before that could land in the same round as the wake-up and be read on its own."""
    gate, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        gate.wait(5)

    host._commands.put(hold)
    host._wake()
    if not held.wait(5):
        raise TimeoutError("rank 0's loop did not run the holding command within 5 s")
    return gate


def test_sessions_pending_together_share_one_forward_and_each_peer_gets_its_slice(group):
    """Two sessions' layer 1 are ready together: they run as one forward of their 3 + 4 rows, each
    peer its own slice; layer 2, sent by one session only, then runs alone."""
    host, computes = group
    (a, _), (b, _) = ticket(host, 2), ticket(host, 1)
    a0, a1, b0 = a.join(0), a.join(1), b.join(0)
    xs = {"a0": rows(1, 1), "a1": rows(2, 2), "b0": rows(4, 3)}
    gate = hold_loop(host)
    with ThreadPoolExecutor(3) as pool:
        sent = {k: pool.submit(p.forward_wire, xs[k], 1) for k, p in (("a0", a0), ("a1", a1), ("b0", b0))}
        frames_waiting(host, 3)
        gate.set()
        outs = {k: f.result(timeout=10)[0] for k, f in sent.items()}
    for key, out in outs.items():
        assert np.array_equal(out.array, xs[key].array * 2 + 1)
    assert rank_runs(computes, 1) == [(1, 7)]
    assert b0.forward_wire(rows(2, 4), 2)[0].shape == (2, H)
    assert rank_runs(computes, 2) == [(1, 7), (2, 2)]


def test_ready_layers_of_different_layers_or_over_the_limit_run_in_arrival_order(group):
    host, computes = group
    computes[0].limit = 5  # rows of one forward: 4 + 4 do not fit together
    sessions = [ticket(host, 1)[0].join(0) for _ in range(3)]
    gate = hold_loop(host)
    with ThreadPoolExecutor(3) as pool:
        sent = [pool.submit(p.forward_wire, rows(4, i), layer) for i, (p, layer) in enumerate(zip(sessions, [1, 2, 1],
                                                                                        strict=True))]
        frames_waiting(host, 3)
        gate.set()
        [f.result(timeout=10) for f in sent]
    # every layer alone (over the limit, or another layer); none waited for more than the others
    assert sorted(rank_runs(computes, 3)) == [(1, 4), (1, 4), (2, 4)]


def test_a_session_lasts_while_a_peer_is_connected_and_ends_after_its_linger(group):
    """An elastic session's peers come and go: it lasts while one is connected and ends its
    linger after the last left (a strict session ends at once when a peer leaves: PEER_GONE)."""
    host, _ = group
    t, number = ticket(host, 1, idle_after_s=IDLE_S, linger_s=0.3)
    peer = t.join(0)
    time.sleep(0.6)  # twice the linger: a connected peer keeps it
    assert number in host.sessions and peer.forward_wire(rows(1, 0), 1)[0].shape == (1, H)
    peer.close()
    wait_for(lambda: number not in host.sessions, "the session ended after its linger", 5.0)
    state = host.state(number)
    assert state["failure"] == "session_ended" and "linger_s" in state["ended"]
    never, unjoined = ticket(host, 1, linger_s=0.2)
    wait_for(lambda: unjoined not in host.sessions, "a session nobody joined ended", 5.0)
    with pytest.raises(JoinRefused, match="has ended") as refused:
        never.join(0)
    assert refused.value.reason == "ended" and refused.value.failure is Failure.SESSION_ENDED


def test_sessions_beyond_max_sessions_are_refused_with_the_arithmetic(group):
    host, _ = group
    ticket(host, 1, max_sessions=2)
    ticket(host, 1, max_sessions=2)
    with pytest.raises(ValueError, match=r"2 session\(s\) are open on this group and max_sessions = 2: one "
                                         r"more would make 3"):
        ticket(host, 1, max_sessions=2)
    host.open(1, None, "the replica's own")  # internal: never counted or refused


def watch(host: GroupHost) -> socket.socket:
    sock = frames.connect(host.address, host.group_secret, frames.Role.WATCH, 0, 5.0)
    sock.settimeout(10)
    return sock


def events(sock: socket.socket, until: str) -> list[dict]:
    got = []
    while not got or got[-1]["event"] != until:
        frame = frames.recv(sock)
        assert frame.kind is frames.Kind.EVENT
        got.append(frame.meta())
    return got


def test_the_watcher_hears_counts_and_ends_when_they_happen_and_nothing_while_idle(group):
    host, _ = group
    sock = watch(host)
    t, number = ticket(host, 1)
    peer = t.join(0)
    for layer in LAYERS:
        peer.forward_wire(rows(3, layer), layer)
    counts = events(sock, "counts")[-1]["sessions"][str(number)]
    if counts["forwards"] < 2:  # the first push went after one forward: the next within EVENTS_PUSH_S
        counts = events(sock, "counts")[-1]["sessions"][str(number)]
    assert (counts["forwards"], counts["rows"]) == (2, 6)
    sock.settimeout(1.5)
    with pytest.raises(TimeoutError):  # idle: more than EVENTS_PUSH_S without a word
        frames.recv(sock)
    sock.settimeout(10)
    host.close(number, "closed by its opener", 5.0)
    ended = events(sock, "ended")[-1]
    assert ended["session"] == number and ended["state"]["ended"] == "closed by its opener"
    assert ended["state"]["forwards"] == 2
    sock.close()


def test_an_idle_groups_stopped_rank_is_found_by_the_heartbeat_within_the_call_bound():
    """No layer in flight: rank 1's link admits but never answers (a SIGSTOPped process). Rank 0's
    heartbeat finds it within the call bound, ends the open session as group_timeout, tells the
    watcher, and refuses new sessions."""
    compute = FakeCompute(0)
    host = GroupHost("127.0.0.1", frames.new_secret(), 2, compute, CALL_S, H, "float32", "hb",
                     heartbeat_s=0.2)
    silent = frames.connect(host.address, host.group_secret, frames.Role.RANK, 1, 5.0)
    try:
        host.wait_ranks(5.0)
        sock = watch(host)
        t, number = ticket(host, 1)
        peer = t.join(0)
        start = time.monotonic()
        failed = events(sock, "failed")[-1]
        assert time.monotonic() - start <= CALL_S + 0.5
        assert failed["failure"] == "group_timeout" and "heartbeat" in failed["reason"]
        assert host.state(number)["failure"] == "group_timeout"
        with pytest.raises(SessionError) as e:
            peer.forward_wire(rows(1, 0), 1)
        assert e.value.failure is Failure.GROUP_TIMEOUT and e.value.action is Action.RETRY_ELSEWHERE
        with pytest.raises(RuntimeError, match="broken"):
            host.open(1, 1, "after")
    finally:
        silent.close()
        host.stop()


def test_a_dead_rank_of_an_idle_group_breaks_it_as_group_failed(group):
    host, computes = group
    host.heartbeat_s = 0.1
    sock = watch(host)
    t, number = ticket(host, 1)
    host.links[1].shutdown(socket.SHUT_RDWR)  # rank 1's end is gone
    failed = events(sock, "failed")[-1]
    assert failed["failure"] == "group_failed"
    assert host.state(number)["failure"] == "group_failed"
