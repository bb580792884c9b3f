"""The replica's sessions (deployments.serve.sessions.GroupSessions) against a stand-in rank 0: a
session that rank 0 has ended is in the history at the first status read, whether its pushed end
came first or not, and only once."""

import asyncio
from types import SimpleNamespace

import pytest

from deployments.serve import sessions as serve_sessions


class RankZero:
    """Rank 0's two calls the replica makes here, each answered as an awaitable like a Ray call's."""

    def __init__(self):
        self.open, self.ended, self.numbers = {}, {}, iter(range(1, 100))

    @staticmethod
    async def answer(value):
        return value

    def end(self, number: int, failure: str) -> dict:
        self.ended[number] = {**self.open.pop(number), "ended": True, "failure": failure}
        return self.ended[number]

    @property
    def session_open(self):
        def remote(*_args):
            number = next(self.numbers)
            self.open[number] = {"session": number, "joined": 0, "forwards": 0, "rows": 0}
            return self.answer({"session": number})
        return SimpleNamespace(remote=remote)

    @property
    def sessions_snapshot(self):
        served = {"forwards": 0}
        group = {"forwards": 0, "rows": 0, "busy_s": 0.0, "recent_ms": [], "busy_fraction": 0.0}
        return SimpleNamespace(remote=lambda: self.answer(
            {"sessions": dict(self.open), "ended": dict(self.ended), "served": served, "group": group}))


@pytest.fixture
def replica(monkeypatch):
    forgotten = []
    monkeypatch.setattr(serve_sessions.moves, "forget", lambda *args: forgotten.append(args))
    rank0 = RankZero()
    group = SimpleNamespace(workers=[rank0], check_usable=lambda: None, world=1,
                            infos=[{"hidden_size": 8, "device": "cpu"}],
                            resolved=SimpleNamespace(layers={1: None}))
    spec = SimpleNamespace(name="d", lanes=True, max_tokens_per_request=64, max_sessions=8, dtype="float32",
                           session_linger_s=30.0, bounds=SimpleNamespace(call_s=10.0))
    stats = SimpleNamespace(sessions=lambda *a: None, session_forwards=lambda **k: None)
    return serve_sessions.GroupSessions(group, lambda: spec, stats, "r1"), rank0, forgotten


@pytest.mark.parametrize("pushed_first", [False, True])
def test_a_session_ended_on_rank_0_is_in_the_history_at_the_next_read_once(replica, pushed_first):
    sessions, rank0, forgotten = replica

    async def scenario():
        grant = await sessions.open("doomed", 2)
        other = await sessions.open("alive", 2)
        assert [s["client"] for s in (await sessions.status())["open"]] == ["doomed", "alive"]
        state = rank0.end(grant["session"], "peer_gone")
        if pushed_first:
            sessions.on_event({"event": "ended", "session": grant["session"], "state": state})
        status = await sessions.status()  # the pushed end may still be on its way: the read settles it
        sessions.on_event({"event": "ended", "session": grant["session"], "state": state})  # late: no-op
        return status, other, await sessions.status()

    status, other, later = asyncio.run(scenario())  # returns once the executor's forgets ran
    assert [s["client"] for s in status["open"]] == ["alive"]
    assert [(h["client"], h["failure"]) for h in status["history"]] == [("doomed", "peer_gone")]
    assert later["history"] == status["history"]  # the late push added nothing
    assert [s["session"] for s in later["open"]] == [other["session"]]
    assert [args[0] for args in forgotten] == ["doomed"]
