"""The one retry rule (deployments/common/retry.py) on every path, counted with stand-ins for
the handles, the ranks and the steps: at most 2 attempts, the second only after the group that
ran the first is known broken, and never on that group's replica. The same rule under real
faults (SIGKILL / SIGSTOP of a rank with two replicas, 0 caller errors) is exercised in
tests/test_dataplane.py (handle), tests/test_lane.py (lane) and tests/test_cohort.py (cohort)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from deployments.client import MoEClient, MoERequestError, MoEServerError
from deployments.client.cohort import CohortCore, Failure, StepAgain
from deployments.client.lane import LaneCore
from deployments.client.leases import GroupLease
from deployments.common.errors import (
    GroupTimeoutError,
    GroupUnavailableError,
    RequestTimeoutError,
    ServeInputError,
)
from deployments.common.layer_routing import LayerRoutes
from deployments.dataplane.errors import Failure as PlaneFailure
from deployments.dataplane.errors import SessionError
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


class LeaseClient:
    """What a lane asks of its client when a call on the data plane failed."""

    def __init__(self):
        self.calls = []

    def forward(self, x, layer, logits):  # a first attempt (the client's own rule applies)
        self.calls.append(("forward", None))
        return "serve"

    def forward_once(self, x, layer, logits, *, avoid_replica=None):
        self.calls.append(("once", avoid_replica))
        return "elsewhere"


def failed_lane_call(exc: BaseException) -> tuple[object, list]:
    client = LeaseClient()
    core = LaneCore(client, "lane", (1,), {1: "d"}, None, 1, 5.0)
    lease = core.leases["d"]
    lease.grant = {"replica": "r1", "session_id": "r1:1", "call_timeout_s": 8.0, "ranks": []}
    lease.report_timeout = lambda reason: client.calls.append(("reported", reason))
    try:
        return core._after_failure("d", exc, X, 1, None), client.calls
    except Exception as e:  # noqa: BLE001 -- the verdict is the error
        return e, client.calls


def test_lane_path():
    # a rank died or failed under the call: once more on the Serve path, not on the broken replica
    failed = SessionError(PlaneFailure.GROUP_FAILED, "rank 1 is gone", None, "r1")
    assert failed_lane_call(failed) == ("elsewhere", [("once", "r1")])
    # the call outlived its bound: reported (the replica breaks the group), then once more elsewhere
    out, calls = failed_lane_call(SessionError(PlaneFailure.GROUP_TIMEOUT, "no answer", None, "r1"))
    assert out == "elsewhere" and calls[0][0] == "reported" and calls[1:] == [("once", "r1")]
    # an ended lease or session: it never ran, so the Serve path is its first attempt
    for never_ran in (PlaneFailure.SESSION_ENDED, PlaneFailure.PEER_STALLED):
        assert failed_lane_call(SessionError(never_ran, "ended")) == ("serve", [("forward", None)])
    # bad input: the caller's error, never re-sent
    out, calls = failed_lane_call(SessionError(PlaneFailure.INPUT, "hidden_states has NaN"))
    assert isinstance(out, MoERequestError) and "NaN" in str(out) and calls == []


def stepping(*outcomes) -> tuple[CohortCore, list]:
    """A cohort whose step attempts answer from a script: a value, or the failure a first attempt met."""
    core = CohortCore.__new__(CohortCore)
    core.counts = {"reruns": 0}
    tries = []

    def attempt(inputs, first, avoid=None):
        tries.append((first, avoid))
        outcome = outcomes[len(tries) - 1]
        if isinstance(outcome, Failure):
            raise StepAgain(outcome, {d: "r1" for d in outcome.deployments})
        return outcome

    core.attempt = attempt
    return core, tries


def test_cohort_path():
    broke = Failure("group", BROKEN, ("d",))
    core, tries = stepping(broke, ["done"])
    assert core.attempts([0]) == ["done"] and tries == [(True, None), (False, {"d": "r1"})]
    core, tries = stepping(broke, broke)
    with pytest.raises(MoEServerError):
        core.attempts([0])
    assert len(tries) == 2  # never a third
    # a lost lease: the step never ran, it starts over once as a first attempt
    lost = Failure("lease", type("LaneLeaseError", (RuntimeError,), {})("lease ended"), ("d",))
    core, tries = stepping(lost, ["done"])
    assert core.attempts([0]) == ["done"] and tries == [(True, None), (True, None)]


def lease_asks(*outcomes) -> tuple[GroupLease, list]:
    """A lease whose asks answer from a script (a grant, or an error), recording each ask's
    ``avoid_replica``."""
    asks = []

    def open_session(*args, avoid_replica=None, peers=1, idle_after_s=None, linger_s=None):
        asks.append(avoid_replica)
        outcome = outcomes[len(asks) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return SimpleNamespace(result=lambda timeout_s=None: outcome)

    handle = SimpleNamespace(open_session=SimpleNamespace(remote=open_session))
    client = SimpleNamespace(group_handle=lambda name: handle, timeout_s=5)
    return GroupLease(client, "d", "owner", max_tokens=4, retry_s=30), asks


def test_lease_path():
    grant = {"granted": True, "replica": "r2", "world": 2, "session_id": "l"}
    # the replica asked has a broken group: asked once more, elsewhere, and leased there
    lease, asks = lease_asks(BROKEN, grant)
    assert lease.acquire(1.0) and lease.replica == "r2" and asks == [None, "r1"]
    # broken there too: no lease and no error; the Serve path until asked again
    lease, asks = lease_asks(BROKEN, GroupUnavailableError("rank 0 died", "r2"))
    assert not lease.acquire(1.0) and asks == [None, "r1"] and "rank 0 died" in lease.why_not
    assert not lease.due()  # asked again after retry_s, not at the next call
    # a replica that died under the ask is unknown: no second ask
    lease, asks = lease_asks(type("RayActorError", (RuntimeError,), {})("the replica died"))
    assert not lease.acquire(1.0) and asks == [None]
    # anything else is the caller's error
    lease, asks = lease_asks(ServeInputError("max_tokens 0 must be positive"))
    with pytest.raises(MoERequestError):
        lease.acquire(1.0)
