"""Rank 0's step rules (``dataplane.steps``) without sockets or threads: frames and a scripted
clock go in, effects and ready layers come out. Strict and elastic sessions, parking and dropping,
stall, idle and linger timers, admission, the fairness rule and the same-layer merge."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from deployments.common.wire import WireTensor
from deployments.dataplane.errors import Failure
from deployments.dataplane.frames import END_STEP, NEW_STEP, WITH_LOGITS, Frame, Kind
from deployments.dataplane.steps import (
    Drop,
    End,
    SessionSteps,
    StepRules,
    check_idle_after,
    check_open,
)

H = 4
CALL_S = 10.0
IDLE_S = 2.0


def part(layer: int, rows: int = 1, flags: int = 0, kind: Kind = Kind.FORWARD, text: str = ""):
    data = WireTensor(np.zeros((rows, H), np.float32), "float32") if kind is Kind.FORWARD else None
    logits = Frame(Kind.LOGITS, data=WireTensor(np.zeros((rows, 3), np.float32), "float32")) \
        if flags & WITH_LOGITS else None
    return Frame(kind, flags=flags, layer=layer, text=text, data=data), logits


def step(layer: int, rows: int = 1, *, first: bool = False, last: bool = False):
    """An elastic peer's part: ``first``/``last`` mark its step's first/last layer."""
    return part(layer, rows, (NEW_STEP if first else 0) | (END_STEP if last else 0))


class Group:
    """A StepRules and its sessions, numbered in order, with every peer joined at t = 0."""

    def __init__(self) -> None:
        self.rules = StepRules(CALL_S)
        self.numbers = iter(range(1, 100))

    def open(self, peers: int, *, elastic: bool = False, linger_s: float | None = None, join: bool = True,
             max_sessions: int | None = 64, now: float = 0.0) -> SessionSteps:
        session = SessionSteps(next(self.numbers), peers, f"s{peers}", CALL_S, IDLE_S if elastic else None,
                               linger_s, internal=max_sessions is None, alone_since=now)
        self.rules.admit(session, max_sessions)
        for i in range(peers if join else 0):
            assert self.rules.join(session, i) is None
        return session

    def send(self, session: SessionSteps, index: int, p, now: float) -> list:
        return self.rules.receive(session, index, p, now)

    def run(self, limit: int = 64, now: float = 0.0) -> list[tuple[int, int, list[int]]]:
        """Take the next forward and answer it: (session, layer, peers) of each layer in it."""
        taken = self.rules.take(limit)
        for t in taken:
            if t.end is None:
                self.rules.answered(t.session, t.parts, now)
        return [(t.session.number, t.layer, t.peers) for t in taken]


# -- strict sessions -----------------------------------------------------------------------------

def test_a_strict_layer_waits_for_every_peer_then_runs_once():
    g = Group()
    s = g.open(3)
    assert g.send(s, 2, part(1, 2), 0.0) == [] and not g.rules.ready
    assert s.waiting_for() == [0, 1] and s.waiting() and s.deadline() == CALL_S
    g.send(s, 0, part(1, 0), 1.0)  # 0 rows still take part
    assert not g.rules.ready and g.rules.next_deadline() == CALL_S  # from the first part, not the last
    g.send(s, 1, part(1, 3), 2.0)
    assert list(g.rules.ready) == [s] and not s.waiting() and g.rules.next_deadline() is None
    [taken] = g.rules.take(64)
    assert (taken.layer, taken.peers, taken.end, taken.failure) == (1, [0, 1, 2], None, None)
    assert not taken.new_step and not g.rules.ready and s.pending == {}
    g.rules.answered(s, taken.parts, 3.0)
    assert s.last_at == 3.0 and g.rules.next_deadline() is None  # strict: no timer between layers


def test_a_strict_layer_not_sent_within_the_call_bound_ends_the_session():
    g = Group()
    s = g.open(3, join=False)
    g.rules.join(s, 0)
    g.rules.join(s, 1)
    g.send(s, 1, part(1), 5.0)
    g.send(s, 0, part(1), 6.0)
    assert g.rules.tick(5.0 + CALL_S - 0.001) == []
    [end] = g.rules.tick(5.0 + CALL_S)
    assert end == End(s.number, Failure.PEER_STALLED, f"peer(s) [2] of session 's3' has not sent layer 1 within "
                      f"the call bound {CALL_S:.0f} s ([2] never joined)", 2)
    assert s.ended and s.number not in g.rules.sessions and g.rules.tick(100.0) == []


@pytest.mark.parametrize("failure", [Failure.PEER_GONE, Failure.PEER_STALLED])
def test_a_strict_peers_own_fault_ends_the_session_for_all(failure):
    g = Group()
    s = g.open(2)
    g.send(s, 0, part(1), 0.0)
    assert g.rules.fault(s, 1, failure, "why", 1.0) == [End(s.number, failure, "why", 1)]
    assert s.ended == "why" and s.failure is failure and s.pending == {} and s.joined() == 0
    assert g.rules.fault(s, 0, failure, "again", 1.0) == []  # ended once


def test_strict_parts_that_are_no_forward_or_come_twice_are_out_of_step():
    g = Group()
    s = g.open(2)
    g.send(s, 0, part(1), 0.0)
    [end] = g.send(s, 0, part(1), 0.1)
    assert (end.failure, end.peer, end.reason) == (Failure.OUT_OF_STEP, 0, "peer 0 of session 's2' sent twice "
                                                   "for one layer")
    s = g.open(2)
    [end] = g.send(s, 1, (Frame(Kind.CHANNEL), None), 0.0)
    assert end.failure is Failure.OUT_OF_STEP and "sent a CHANNEL message" in end.reason


def test_strict_peers_sending_different_layers_end_the_session_when_taken():
    g = Group()
    s = g.open(2)
    g.send(s, 0, part(1), 0.0)
    g.send(s, 1, part(2), 0.0)
    [taken] = g.rules.take(64)
    assert taken.end == End(s.number, Failure.OUT_OF_STEP, "the peers of session 's2' sent different layers: "
                            "{0: 1, 1: 2}")
    assert s.ended and not g.rules.sessions


def test_a_strict_peers_fail_fails_the_layer_for_all_and_the_session_stays():
    g = Group()
    s = g.open(2)
    g.send(s, 0, part(1), 0.0)
    g.send(s, 1, part(1, kind=Kind.FAIL, text="oom"), 0.0)
    [taken] = g.rules.take(64)
    assert taken.failure == (1, "peer 1 of session 's2' failed layer 1: oom") and taken.end is None
    g.rules.answered(s, taken.parts, 1.0)
    assert not s.ended and g.send(s, 0, part(2), 2.0) == []


# -- elastic sessions ----------------------------------------------------------------------------

def start_step(g: Group, s: SessionSteps, peers: list[int], now: float = 0.0) -> None:
    """Every peer in ``peers`` sends a one-layer step that starts and ends the group's step."""
    for i in peers:
        g.send(s, i, step(1, first=True, last=True), now)


def test_an_elastic_layer_waits_only_for_the_active_peers_and_a_new_one_waits_for_a_step():
    g = Group()
    s = g.open(3, elastic=True)
    g.send(s, 0, step(1, first=True), 0.0)  # the group's first step: a peer that comes takes part at once
    g.send(s, 1, step(1, first=True), 0.0)
    assert s.active == {0, 1}
    assert s.waiting_for() == [] and list(g.rules.ready) == [s]  # 2 is not active: not waited for
    assert g.run() == [(s.number, 1, [0, 1])]
    assert not s.at_boundary  # mid-step now
    g.send(s, 2, step(1, first=True), 1.0)  # its first layer waits for the group's next step start
    assert set(s.held) == {2} and 2 not in s.active and not g.rules.ready
    assert s.waiting() and s.deadline() == s.last_at + CALL_S  # the active ones' next layer is due
    g.send(s, 0, step(2, last=True), 1.5)
    g.send(s, 1, step(2, last=True), 1.5)
    assert g.run(now=2.0) == [(s.number, 2, [0, 1])]
    assert s.at_boundary and s.active == {0, 1, 2} and s.held == {} and set(s.pending) == {2}  # 2 is in
    assert s.first_at == 2.0 and s.deadline() == 2.0 + IDLE_S


def test_a_peer_not_in_the_step_sending_a_later_layer_is_dropped_alone():
    g = Group()
    s = g.open(2, elastic=True)
    start_step(g, s, [0])
    g.run()
    [drop] = g.send(s, 1, step(3), 1.0)
    assert drop == Drop(s.number, 1, Failure.OUT_OF_STEP, "peer 1 of session 's2' is not in the group's step "
                        "and sent layer 3, not its step's first")
    assert not s.ended and s.connected == {0} and g.rules.join(s, 1) is None  # its slot is free again


def test_an_active_peer_out_of_step_with_the_group_is_dropped_alone():
    g = Group()
    s = g.open(2, elastic=True)
    g.send(s, 0, step(1, first=True), 0.0)
    g.send(s, 1, step(1, first=True), 0.0)
    g.run()
    g.send(s, 0, step(2), 1.0)
    [drop] = g.send(s, 1, step(1, first=True), 1.0)  # a new step while the group is half-way through one
    assert (drop.peer, drop.failure) == (1, Failure.OUT_OF_STEP) and "half-way through a step" in drop.reason
    assert s.active == {0} and list(g.rules.ready) == [s]  # the layer goes on without it


def test_an_idle_peer_is_parked_at_a_step_start_and_comes_back_at_the_next():
    g = Group()
    s = g.open(2, elastic=True)
    start_step(g, s, [0, 1])
    g.run(now=0.0)
    g.send(s, 1, step(1, first=True), 10.0)  # 0 is idle
    assert g.rules.next_deadline() == 10.0 + IDLE_S and g.rules.tick(10.0 + IDLE_S - 0.01) == []
    assert g.rules.tick(10.0 + IDLE_S) == []  # parked: nobody is told anything
    assert s.active == {1} and list(g.rules.ready) == [s] and s.parked == 1
    assert g.run(now=12.5) == [(s.number, 1, [1])]
    g.send(s, 0, step(1, first=True, last=True), 13.0)  # back, mid-step: held for the next start
    assert set(s.held) == {0}
    g.send(s, 1, step(2, last=True), 13.5)
    g.run(now=14.0)
    assert s.active == {0, 1} and set(s.pending) == {0}


def idle(g: Group, s: SessionSteps, index: int, now: float) -> list:
    return g.send(s, index, part(0, kind=Kind.IDLE), now)


def test_a_peer_that_says_it_is_idle_is_parked_at_once_and_comes_back_with_its_next_step():
    g = Group()
    s = g.open(2, elastic=True)
    start_step(g, s, [0, 1])
    g.run(now=0.0)
    assert idle(g, s, 0, 5.0) == []  # nobody is told anything; the parked count is the wait's
    assert s.active == {1} and (s.idled, s.parked) == (1, 0)
    g.send(s, 1, step(1, first=True, last=True), 10.0)
    assert list(g.rules.ready) == [s]  # 1's step start waits for no one: no idle_after_s
    assert g.run(now=10.0) == [(s.number, 1, [1])]
    g.send(s, 0, step(1, first=True, last=True), 11.0)  # back: at the group's step start, in at once
    g.send(s, 1, step(1, first=True, last=True), 11.0)
    assert s.active == {0, 1} and g.run(now=11.0) == [(s.number, 1, [0, 1])]


def test_an_idle_notice_that_comes_late_or_to_a_strict_session_changes_nothing():
    g = Group()
    s = g.open(2, elastic=True)
    start_step(g, s, [0, 1])
    g.run(now=0.0)
    g.send(s, 0, step(1, first=True), 1.0)
    idle(g, s, 0, 1.0)  # its next step's first layer came before the notice: it is busy
    assert s.active == {0, 1} and set(s.pending) == {0}
    g.send(s, 1, step(1, first=True), 1.0)
    g.run(now=1.0)
    idle(g, s, 1, 1.5)  # mid-step: its next layer is on its way
    assert s.active == {0, 1} and s.idled == 0
    g.send(s, 0, step(2, last=True), 2.0)
    g.send(s, 1, step(2, last=True), 2.0)
    assert g.run(now=2.0) == [(s.number, 2, [0, 1])]
    strict = g.open(2)
    assert idle(g, strict, 0, 3.0) == [] and not strict.ended and strict.idled == 0
    assert g.rules.tick(2.0 + IDLE_S) == [] and s.parked == 0  # nobody waited out idle_after_s


def test_a_waiting_step_start_runs_when_the_missing_peer_says_it_is_idle():
    g = Group()
    s = g.open(2, elastic=True)
    start_step(g, s, [0, 1])
    g.run(now=0.0)
    g.send(s, 1, step(1, first=True, last=True), 1.0)
    assert not g.rules.ready  # it waits for 0 (until 1.0 + idle_after_s)
    idle(g, s, 0, 1.2)
    assert list(g.rules.ready) == [s] and g.run(now=1.2) == [(s.number, 1, [1])]


def test_a_mid_step_peer_silent_for_the_call_bound_is_dropped_and_the_layer_runs():
    g = Group()
    s = g.open(3, elastic=True)
    start_step(g, s, [0, 1, 2])  # a step of one layer...
    g.run(now=0.0)
    for i in range(3):
        g.send(s, i, step(1, first=True), 1.0)  # ...then one of two layers
    g.run(now=1.0)
    g.send(s, 0, step(2, last=True), 2.0)
    g.send(s, 1, step(2, last=True), 2.0)
    effects = g.rules.tick(2.0 + CALL_S)
    assert effects == [Drop(s.number, 2, Failure.PEER_STALLED, f"peer 2 of session 's3' did not send layer 2 "
                            f"within the call bound {CALL_S:.0f} s")]
    assert s.active == {0, 1} and s.connected == {0, 1} and list(g.rules.ready) == [s]


def test_an_elastic_group_silent_mid_step_drops_every_active_peer_then_lets_the_held_in():
    g = Group()
    s = g.open(3, elastic=True)
    g.send(s, 0, step(1, first=True), 0.0)
    g.send(s, 1, step(1, first=True), 0.0)
    g.run(now=1.0)
    g.send(s, 2, step(1, first=True), 2.0)  # held: the group is mid-step
    assert s.deadline() == 1.0 + CALL_S
    effects = g.rules.tick(1.0 + CALL_S)
    assert [(e.peer, e.failure) for e in effects] == [(0, Failure.PEER_STALLED), (1, Failure.PEER_STALLED)]
    assert "did not send its next layer" in effects[0].reason
    assert s.active == {2} and s.at_boundary and list(g.rules.ready) == [s]  # the held peer's step starts


def test_an_elastic_peer_gone_is_dropped_alone_and_a_fail_stays_its_own():
    g = Group()
    s = g.open(2, elastic=True)
    g.send(s, 0, step(1, first=True), 0.0)
    g.send(s, 1, part(1, flags=NEW_STEP, kind=Kind.FAIL, text="oom"), 0.0)
    [taken] = g.rules.take(64)
    assert taken.failure is None and taken.peers == [0, 1]  # the host answers 1's FAIL to 1 alone
    g.rules.answered(s, taken.parts, 0.0)
    g.send(s, 0, step(2), 1.0)
    assert g.rules.fault(s, 1, Failure.PEER_GONE, "gone", 1.5) == [Drop(s.number, 1, Failure.PEER_GONE, "gone")]
    assert list(g.rules.ready) == [s] and not s.ended  # 0's layer no longer waits for 1


# -- linger ----------------------------------------------------------------------------------------

def test_a_session_nobody_joined_ends_after_its_linger():
    g = Group()
    s = g.open(2, linger_s=30.0, join=False, now=5.0)
    assert g.rules.next_deadline() == 35.0 and g.rules.tick(34.9) == []
    [end] = g.rules.tick(35.0)
    assert end == End(s.number, Failure.SESSION_ENDED, "session 's2' had no connected peer for 30 s (its linger_s)")


def test_linger_counts_from_the_last_peer_leaving_and_stops_while_one_is_connected():
    g = Group()
    s = g.open(2, elastic=True, linger_s=30.0)
    assert g.rules.next_deadline() is None and g.rules.tick(1000.0) == []  # connected: no linger
    g.rules.fault(s, 0, Failure.PEER_GONE, "gone", 1000.0)
    assert s.linger_deadline() is None
    g.rules.fault(s, 1, Failure.PEER_GONE, "gone", 1010.0)
    assert s.alone_since == 1010.0 and g.rules.next_deadline() == 1040.0
    g.rules.join(s, 1)  # a peer comes back before its end: it lasts
    assert g.rules.tick(1040.0) == [] and not s.ended


# -- admission -------------------------------------------------------------------------------------

def test_admission_counts_clients_sessions_and_a_broken_group_refuses():
    g = Group()
    g.open(1, max_sessions=2)
    g.open(1, max_sessions=None)  # the replica's own: never counted or refused
    g.open(1, max_sessions=2)
    with pytest.raises(ValueError, match="2 session\\(s\\) are open on this group and max_sessions = 2: "
                                         "one more would make 3"):
        g.open(1, max_sessions=2)
    g.open(1, max_sessions=None)
    effects = g.rules.fail_group(Failure.GROUP_TIMEOUT, "rank 1 stalled")
    assert [e.failure for e in effects] == [Failure.GROUP_TIMEOUT] * 4 and not g.rules.sessions
    assert g.rules.fail_group(Failure.GROUP_FAILED, "later") == []  # the first failure stays
    with pytest.raises(RuntimeError, match="broken: rank 1 stalled"):
        g.open(1, max_sessions=None)


def test_a_join_is_refused_a_taken_or_unknown_index_and_an_ended_session():
    g = Group()
    s = g.open(2, join=False)
    assert g.rules.join(s, 0) is None and g.rules.join(s, 0) == "taken" and g.rules.join(s, 2) == "taken"
    assert g.rules.join(s, -1) == "taken" and s.joined() == 1
    g.rules.end(s, Failure.SESSION_ENDED, "closed")
    assert g.rules.join(s, 1) == "ended"


def test_open_arguments_are_checked():
    check_open(1, None, None, CALL_S)
    check_open(4, CALL_S, 1, CALL_S)
    for peers in (0, True, 1.0):
        with pytest.raises(ValueError, match="positive number of peers"):
            check_open(peers, None, None, CALL_S)
    for idle in (0, -1, CALL_S + 1, True, "1"):
        with pytest.raises(ValueError, match="idle_after_s"):
            check_idle_after(idle, CALL_S)
    with pytest.raises(ValueError, match="linger_s"):
        check_open(1, None, 0, CALL_S)


# -- the ready queue: fairness and the merge ------------------------------------------------------

def ready_one(g: Group, s: SessionSteps, layer: int, rows: int, flags: int = 0, now: float = 0.0) -> None:
    for i in range(s.peers):
        g.send(s, i, part(layer, rows, flags), now)


def test_ready_layers_run_oldest_first_with_every_same_layer_one_beside_it():
    g = Group()
    a, b, c, d = (g.open(1) for _ in range(4))
    ready_one(g, a, 1, 2)
    ready_one(g, b, 2, 2)
    ready_one(g, c, 1, 2)
    assert g.run() == [(a.number, 1, [0]), (c.number, 1, [0])]  # one forward of layer 1
    ready_one(g, d, 2, 2)  # ready after b: it waits for b's forward, shares it here
    ready_one(g, a, 2, 2)
    assert g.run() == [(b.number, 2, [0]), (d.number, 2, [0]), (a.number, 2, [0])]
    assert g.run() == [] and not g.rules.ready


def test_the_merge_stays_within_the_forward_limit_and_leaves_router_logits_alone():
    g = Group()
    a, b, c, d = (g.open(1) for _ in range(4))
    ready_one(g, a, 1, 5)
    ready_one(g, b, 1, 4)  # 5 + 4 > 8: not beside a
    ready_one(g, c, 1, 3)  # 5 + 3 <= 8: beside a, although b came first
    ready_one(g, d, 1, 1, WITH_LOGITS)  # with router logits: always a forward of its own
    assert g.run(limit=8) == [(a.number, 1, [0]), (c.number, 1, [0])]
    assert g.run(limit=8) == [(b.number, 1, [0])]
    assert g.run(limit=8) == [(d.number, 1, [0])]
    ready_one(g, d, 2, 1, WITH_LOGITS)
    ready_one(g, a, 2, 1)
    assert g.run(limit=8) == [(d.number, 2, [0])]  # the oldest with logits takes nobody with it


def two_ready(g: Group) -> tuple[SessionSteps, SessionSteps]:
    """An elastic session of 2 peers mid-step with its layer 2 ready, then a strict one ready."""
    s, t = g.open(2, elastic=True), g.open(1)
    for i in (0, 1):
        g.send(s, i, step(1, first=True), 0.0)
    g.run()
    for i in (0, 1):
        g.send(s, i, step(2), 1.0)
    ready_one(g, t, 2, 1)
    assert list(g.rules.ready) == [s, t]
    return s, t


def test_a_queued_layer_that_lost_a_part_keeps_its_place():
    g = Group()
    s, t = two_ready(g)
    g.rules.fault(s, 0, Failure.PEER_GONE, "gone", 1.5)
    assert list(g.rules.ready) == [s, t] and s.complete()  # 1's part alone is the layer now
    assert g.run() == [(s.number, 2, [1]), (t.number, 2, [0])]


def test_a_queued_layer_that_lost_every_part_is_skipped():
    g = Group()
    s, t = two_ready(g)
    g.rules.fault(s, 0, Failure.PEER_GONE, "gone", 1.5)
    g.rules.fault(s, 1, Failure.PEER_GONE, "gone", 1.5)
    assert not s.complete() and s.at_boundary  # nobody is mid-step: the next layer starts one
    assert g.run() == [] and g.run() == [(t.number, 2, [0])]


def test_channel_rows_count_from_their_header_in_the_merge():
    g = Group()
    a, b = g.open(1), g.open(1)
    ready_one(g, a, 1, 6)
    g.send(b, 0, (Frame(Kind.FORWARD, layer=1, channel=((3, H), "float32")), None), 0.0)
    assert b.shape() == (1, 3, False)
    assert g.run(limit=8) == [(a.number, 1, [0])]  # 6 + 3 > 8
    assert g.run(limit=8) == [(b.number, 1, [0])]


def test_the_rules_import_neither_ray_nor_torch():
    code = ("import sys, deployments.dataplane.steps; "
            "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
