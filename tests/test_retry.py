"""The retry rules, counted with stand-ins for the handles, the ranks, the sessions and the steps.

The handle and ingress paths (deployments/common/retry.py): at most 2 attempts, the second only
after the group that ran the first is known broken, and never on that group's replica. Lanes and
cohorts (deployments/client/session.py ``runs_again``, read from dataplane/errors.py ACTIONS): a
broken group is their peers' to leave (they move by themselves), so a call or step runs at most
twice, the second time only after its session ended under it. The same rules under real faults
(SIGKILL / SIGSTOP of a rank with two replicas, 0 caller errors) are exercised in
tests/test_dataplane.py (handle), tests/test_lane.py (lane), tests/test_cohort.py (cohort) and
tests/test_session_moves.py (session peers)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from deployments.client import MoEClient, MoERequestError, MoEServerError, WorkerError
from deployments.client import lane as lane_module
from deployments.client.cohort import CohortCore
from deployments.client.lane import LaneCore
from deployments.client.session import SessionRefused, open_group, runs_again
from deployments.common.errors import (
    GroupTimeoutError,
    GroupUnavailableError,
    RequestTimeoutError,
    ServeInputError,
)
from deployments.common.layer_routing import LayerRoutes
from deployments.dataplane.errors import ACTIONS, Action, Failure, SessionError
from deployments.serve.http import MoEIngress

BROKEN = GroupUnavailableError("rank 1 died", "r1")


class Outcomes:
    """A deployment handle whose ``forward`` answers from a script, recording every attempt."""

    def __init__(self, *script):
        self.script, self.sent = list(script), []

    def answer(self, kwargs):
        self.sent.append(kwargs.get("avoid_replica"))
        outcome = self.script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    @property
    def forward(self):
        return SimpleNamespace(remote=lambda *args, **kwargs: Reply(self, kwargs))


class Reply:
    def __init__(self, outcomes: Outcomes, kwargs):
        self.outcomes, self.kwargs = outcomes, kwargs

    def result(self, timeout_s=None):
        return self.outcomes.answer(self.kwargs)

    def __await__(self):
        async def answer():
            return self.outcomes.answer(self.kwargs)

        return answer().__await__()

    def cancel(self):
        pass


def handle_client(group: Outcomes) -> MoEClient:
    client = MoEClient("app", handle=object(), routes=LayerRoutes.single("d"), timeout_s=5)
    client._groups["d"] = group
    return client


X = torch.zeros(1, 4)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_handle_path(mode):
    def run(client):
        return client.forward(X, 1) if mode == "sync" else asyncio.run(client.forward_async(X, 1))

    group = Outcomes(BROKEN, "ok")
    assert run(handle_client(group)) == "ok" and group.sent == [None, "r1"]  # once more, elsewhere
    group = Outcomes(BROKEN, GroupTimeoutError("past its bound", "r2"))
    with pytest.raises(MoEServerError):
        run(handle_client(group))
    assert group.sent == [None, "r1"]  # never a third
    for first in (RequestTimeoutError("no answer"), ServeInputError("bad rows"), RuntimeError("bug")):
        group = Outcomes(first, "ok")
        with pytest.raises((MoEServerError, MoERequestError)):
            run(handle_client(group))
        assert group.sent == [None]  # not known broken: never re-sent


def test_ingress_path():
    group = Outcomes(BROKEN, "ok")
    ingress = SimpleNamespace(groups={"d": group}, request_timeout_s=5)
    ingress._call = lambda what, response: MoEIngress._call(ingress, what, response)
    assert asyncio.run(MoEIngress._forward(ingress, "d", X, 1, None)) == "ok" and group.sent == [None, "r1"]
    group = Outcomes(BROKEN, BROKEN)
    ingress.groups = {"d": group}
    with pytest.raises(GroupUnavailableError):
        asyncio.run(MoEIngress._forward(ingress, "d", X, 1, None))
    assert group.sent == [None, "r1"]


def test_one_rule_for_lanes_and_cohorts_read_from_the_table():
    for failure, action in ACTIONS.items():
        error = SessionError(failure, "why")
        assert runs_again(error, 1) is (action is Action.START_OVER), failure
        assert not runs_again(error, 2), failure  # never a third run
    for other in (MoEServerError("boom", 503), WorkerError(0, "w", "raised"), RuntimeError("bug")):
        assert not runs_again(other, 1)


class ScriptedSession:
    """Stands in for ``client.session.Session`` under a lane: each one opened is recorded on the
    client, and its peer answers from the client's script (an answer, or an error to raise)."""

    def __init__(self, client, peers, **kwargs):
        if client.refuse:
            raise SessionRefused("full")
        self.client, self.closed = client, None
        client.opened.append(self)

    def join(self, index):
        return SimpleNamespace(forward=self.forward, close=lambda why: None, moves=[])

    def forward(self, x, layer, logits):
        outcome = self.client.script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def close(self, why):
        self.closed = why


def lane_calls(monkeypatch, *script, refuse=False):
    """A lane of deployment "d" over scripted sessions; its client's Serve path answers "serve"."""
    monkeypatch.setattr(lane_module, "Session", ScriptedSession)
    client = SimpleNamespace(deployment="d", script=list(script), opened=[], refuse=refuse, serve=0)

    def serve_forward(x, layer, logits):
        client.serve += 1
        return "serve"

    client.forward = serve_forward
    return LaneCore(client, "lane", {"d": (1,)}, max_tokens=1, retry_s=30.0, move_s=1.0), client


def test_lane_path(monkeypatch):
    ended = SessionError(Failure.SESSION_ENDED, "closed under the call")
    # a session that ended under the call: once more, on a session opened anew
    core, client = lane_calls(monkeypatch, ended, "ok")
    assert core.forward(X, 1, None) == "ok" and len(client.opened) == 2 and client.opened[0].closed
    assert core.counts["d"] == {"session_calls": 1, "serve_calls": 0, "reruns": 1}
    # ... but never a third time
    core, client = lane_calls(monkeypatch, ended, ended, "never")
    with pytest.raises(SessionError):
        core.forward(X, 1, None)
    assert len(client.opened) == 2 and client.script == ["never"]
    # a broken group reaching the lane means no group took the session within move_s (the peer
    # moves by itself before that): the caller's error, no second run on the Serve path
    for broken in (Failure.GROUP_FAILED, Failure.GROUP_TIMEOUT):
        core, client = lane_calls(monkeypatch, SessionError(broken, "no group took it", None, "r1"), "never")
        with pytest.raises(SessionError) as err:
            core.forward(X, 1, None)
        assert err.value.failure is broken and client.serve == 0 and len(client.opened) == 1
        assert client.opened[0].closed  # left: the next call opens a new session
    # no session to be had (admission): the Serve path, asked again only after retry_s
    core, client = lane_calls(monkeypatch, refuse=True)
    assert core.forward(X, 1, None) == "serve" and core.forward(X, 1, None) == "serve"
    assert client.serve == 2 and core.sessions["d"].why_serve == "full" and core.sessions["d"].next_try > 0


def stepping(*outcomes) -> tuple[CohortCore, list]:
    """A cohort whose step attempts answer from a script: a value, or an error to raise."""
    core = CohortCore.__new__(CohortCore)
    core.counts = {"steps": 0, "reruns": 0}
    core.workers, core.recent_ms, core.closing, core.closed, core.name = [0], [], False, None, "c"
    core.lock = threading.Lock()
    tries = []

    def attempt(inputs):
        tries.append(inputs)
        outcome = outcomes[len(tries) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    core.attempt = attempt
    return core, tries


def test_cohort_path():
    ended = SessionError(Failure.SESSION_ENDED, "closed under the step")
    core, tries = stepping(ended, ["done"])
    assert core.step([0]) == ["done"] and len(tries) == 2 and core.counts["reruns"] == 1
    core, tries = stepping(ended, ended, ["never"])
    with pytest.raises(SessionError):
        core.step([0])
    assert len(tries) == 2  # never a third
    for once in (SessionError(Failure.GROUP_FAILED, "no group took it", None, "r1"),
                 WorkerError(0, "w", "attend raised"), MoEServerError("step outlived its bound", 504)):
        core, tries = stepping(once, ["never"])
        with pytest.raises(type(once)):
            core.step([0])
        assert len(tries) == 1, once


def session_asks(*outcomes) -> tuple[object, list]:
    """A deployment whose ``open_session`` answers from a script (a grant, or an error), recording
    each ask's ``avoid_replica``."""
    asks = []

    def open_session(avoid_replica=None, **opened_with):
        asks.append(avoid_replica)
        outcome = outcomes[len(asks) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return SimpleNamespace(result=lambda timeout_s=None: outcome)

    handle = SimpleNamespace(open_session=SimpleNamespace(remote=open_session))
    return SimpleNamespace(group_handle=lambda name: handle, timeout_s=5), asks


def test_session_open_path():
    grant = {"granted": True, "replica": "r2", "world": 2, "session_id": "s"}
    opened_with = {"client": "owner", "max_tokens": 4, "peers": 1}
    # the replica asked has a broken group: asked once more, elsewhere, and opened there
    client, asks = session_asks(BROKEN, grant)
    assert open_group(client, "d", opened_with, 1.0)["replica"] == "r2" and asks == [None, "r1"]
    # broken there too: refused (a lane or cohort takes the Serve path until asked again)
    client, asks = session_asks(BROKEN, GroupUnavailableError("rank 0 died", "r2"))
    with pytest.raises(SessionRefused, match="rank 0 died"):
        open_group(client, "d", opened_with, 1.0)
    assert asks == [None, "r1"]
    # a replica that died under the ask is unknown: no second ask
    client, asks = session_asks(type("RayActorError", (RuntimeError,), {})("the replica died"))
    with pytest.raises(SessionRefused):
        open_group(client, "d", opened_with, 1.0)
    assert asks == [None]
    # anything else is the caller's error
    client, asks = session_asks(ServeInputError("max_tokens 0 must be positive"))
    with pytest.raises(MoERequestError):
        open_group(client, "d", opened_with, 1.0)
