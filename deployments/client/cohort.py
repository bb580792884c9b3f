"""Cohorts: many attention workers share the tier's TP groups on the data plane, one expert batch per
MoE layer.

    workers = [ray.remote(MyWorker).remote(...) for _ in range(M)]   # AttentionWorker actors
    with MoEClient("default").cohort(workers, max_tokens=4) as cohort:
        results = cohort.step(inputs)        # one input per worker -> one result per worker
        cohort.status()

The reason a separate MoE tier exists is aggregation: every expert GEMM should see the summed
batch of many attention instances. A cohort is the process that owns M attention workers
(``client.attention.AttentionWorker`` actors) and **one session of M peers** (``client.session``)
on every TP group serving its layers (the app's routing table, across deployments): each worker
joins its ticket as peer ``i``. A step is one actor call per worker (``cohort_step``), in which
the worker drives its own layers: start -> per MoE layer, attend, send its rows to the group
serving the layer, wait for its slice, absorb -> finish. Per layer the group's rank 0 waits for
all M workers' rows, runs **one** forward over them on every rank and answers each worker; the
driver is not on the per-layer path at all.

**Admission.** Membership is fixed: new workers need a new cohort. Steps run on the data plane
while the cohort holds its session (on every group it needs, or on none); while none can be had
(a replica refusing it, ``lanes: false``) a step runs on the **Serve path, still aggregated**:
the driver gathers every worker's rows per layer and sends them as one request, and asks for the
session again every ``retry_s``.

**Faults.** The workers' peers move by themselves to a healthy group when theirs fails (a rank
died or stalled, a replica replaced, scaled down or redeployed), and the step goes on there: the
caller sees a slower step and the same rows. Everything else follows the data plane's one table
(``dataplane.errors.ACTIONS``) and the one retry rule (``client.session.runs_again``): a step runs
at most twice, the second time only when its session ended under it before it ran. A failed step
is aborted on every worker (``abort()``; calls of the aborted attempt are refused by an epoch). A
worker whose own code raised, sent bad rows, stalled (the session ends within the call bound,
naming it) or died raises :class:`~deployments.client.errors.WorkerError` naming it; a dead worker
also closes the cohort. A session no group took within ``move_s`` is the caller's error.

**Exactness.** Every worker's rows equal the Serve path's forward of the same concatenated batch
bit for bit (same ranks, runners and tail plan).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import ray
import torch
from ray.actor import ActorHandle

from ..cluster.liveness import dead_actors
from ..common.errors import actor_died, error_message, root_cause
from ..common.wire import WireTensor
from ..config.timeouts import DEFAULT_RETRY_S, DEFAULT_WAIT_S, PROBE_S, SESSION_MOVE_S
from ..dataplane.errors import Action, MoEServeError, SessionError
from ..dataplane.peer import answer_bound_s
from .errors import MoEServerError, WorkerError, raise_for
from .session import (
    Session,
    SessionOrServe,
    SessionRefused,
    check_seconds,
    default_client_name,
    layers_by_deployment,
    runs_again,
)

DEFAULT_MAX_TOKENS = 1  # rows per worker and step (decode: one token per sequence)
# The most telling of the workers' data-plane verdicts first.
VERDICTS = (Action.RETRY_ELSEWHERE, Action.START_OVER, Action.SESSION_OVER, Action.PEER_ERROR,
            Action.CALLER_ERROR, Action.RETRY_LATER)


class CohortCore:
    """A cohort's workers, session and counters (what :class:`Cohort` delegates to; a
    ``weakref.finalize`` of the cohort closes it)."""

    def __init__(self, client: Any, name: str, workers: list[ActorHandle], layers: tuple[int, ...],
                 by_layer: dict[int, str], max_tokens: int, retry_s: float, move_s: float):
        self.client, self.name, self.workers, self.layers = client, name, workers, layers
        self.deployments = sorted(set(by_layer.values()))
        self.max_tokens, self.move_s = max_tokens, move_s
        self.names = [f"worker-{i}" for i in range(len(workers))]
        self.session = SessionOrServe(self.open, retry_s)
        self.epoch = 0  # moves on at every abort: the aborted attempt's calls are refused
        self.closed: str | None = None  # why the cohort can no longer step (a worker died)
        self.info: dict[str, dict[str, Any]] = {}  # deployment -> hidden size, dtype, call bound
        self.dtypes: dict[int, str] = {}  # layer -> the dtype its deployment takes
        self.step_timeout_s = 0.0
        self.counts = {"steps": 0, "session_steps": 0, "serve_steps": 0, "reruns": 0, "aborts": 0, "moves": 0}
        self.recent_ms: list[float] = []
        self.lock = threading.Lock()
        self.closing = False

    # -- set-up ---------------------------------------------------------------------------

    def describe_groups(self, by_layer: dict[int, str], step_timeout_s: float | None) -> None:
        """Each deployment's hidden size, dtype and call bound (its own ``status()``), and the
        workers' dtype per layer."""
        for d in self.deployments:
            st = self.client.group_handle(d).status.remote().result(timeout_s=self.client.timeout_s)
            self.info[d] = {"hidden_size": st["workers"][0]["hidden_size"], "dtype": st["dtype"],
                            "call_s": st["bounds"]["call_s"]}
        if len({i["hidden_size"] for i in self.info.values()}) > 1:
            raise ValueError(f"the cohort's deployments disagree on the hidden size: {self.info}")
        self.dtypes = {layer: self.info[d]["dtype"] for layer, d in by_layer.items()}
        # A worker's wait for a layer's answer (dataplane.peer), one move to a healthy group, and
        # a probe for the driver.
        call_s = max(i["call_s"] for i in self.info.values())
        self.step_timeout_s = step_timeout_s or answer_bound_s(call_s) + self.move_s + PROBE_S

    def join(self) -> None:
        """Seat every worker (an actor that is not an ``AttentionWorker`` fails here)."""
        hidden = next(iter(self.info.values()))["hidden_size"]
        seats = []
        for i, w in enumerate(self.workers):
            try:
                joined = w.cohort_join.remote(i, hidden, self.dtypes, self.max_tokens, self.epoch)
                seats.append(ray.get(joined, timeout=self.client.timeout_s))
            except Exception as e:
                raise WorkerError(i, repr(w), f"cannot join the cohort (is it an AttentionWorker actor?): "
                                  f"{error_message(e)}") from None
        self.names = [seat["name"] for seat in seats]

    # -- the session ----------------------------------------------------------------------

    def open(self, wait_s: float) -> Session:
        """The session of the M workers on every group, each worker joined as its peer."""
        session = Session(self.client, len(self.workers), layers=self.layers, max_tokens=self.max_tokens,
                          wait_s=wait_s, name=self.name, move_s=self.move_s, workers=self.names)
        try:
            self.gather([w.cohort_session.remote(session.ticket) for w in self.workers],
                        self.client.timeout_s)
        except Exception as e:
            self.leave()
            session.close(f"the workers could not join it: {error_message(e)}")
            cause = root_cause(e)
            if isinstance(cause, WorkerError) and cause.died:
                self.closed = f"worker {cause.index} ({cause.name}) died"
                raise cause from None
            raise SessionRefused(f"the workers of cohort {self.name!r} could not join its session: "
                                 f"{error_message(e)}") from None
        return session

    def leave(self) -> None:
        with contextlib.suppress(Exception):  # a worker gone: its connections went with it
            ray.get([w.cohort_session.remote(None) for w in self.workers], timeout=PROBE_S)

    def drop(self, why: str) -> None:
        """Close the session, then every worker leaves it (rank 0 records why it ended, not a
        peer gone); the next step asks for a new one."""
        if self.session.session is not None:
            self.session.drop(why)
            self.leave()

    # -- steps ----------------------------------------------------------------------------

    def step(self, inputs: Sequence[Any]) -> list[Any]:
        if self.closing or self.closed:
            raise RuntimeError(f"cohort {self.name} is closed{': ' + self.closed if self.closed else ''}")
        if not isinstance(inputs, list | tuple) or len(inputs) != len(self.workers):
            got = len(inputs) if isinstance(inputs, list | tuple) else repr(inputs)
            raise ValueError(f"cohort {self.name} has {len(self.workers)} workers: step() takes one input "
                             f"per worker, got {got}")
        with self.lock:
            started = time.monotonic()
            for attempt in (1, 2):
                try:
                    results = self.attempt(list(inputs))
                    break
                except MoEServeError as e:
                    if not runs_again(e, attempt):
                        raise
                    self.counts["reruns"] += 1
            self.counts["steps"] += 1
            self.recent_ms = [*self.recent_ms[-63:], round((time.monotonic() - started) * 1e3, 3)]
            return results

    def attempt(self, inputs: list[Any]) -> list[Any]:
        if self.session.get() is None:
            return self.serve_step(inputs)
        return self.session_step(inputs)

    def session_step(self, inputs: list[Any]) -> list[Any]:
        """One ``cohort_step`` call per worker: each drives its layers on the session."""
        epoch, layers = self.epoch, list(self.layers)
        refs = [w.cohort_step.remote(epoch, x, layers) for w, x in zip(self.workers, inputs, strict=True)]
        outcomes = self.outcomes(refs)
        if any(isinstance(o, BaseException) for o in outcomes):
            self.fail(*self.verdict(outcomes))
        # Every worker's peer moved with the session: count each group it moved to once.
        self.counts["moves"] += len({(m["deployment"], m["to"]) for o in outcomes for m in o["moves"]})
        self.counts["session_steps"] += 1
        return [o["result"] for o in outcomes]

    def outcomes(self, refs: list[Any]) -> list[Any]:
        """Each worker's answer or exception. Waiting ends at the step bound (a worker still
        running then is a ``TimeoutError``), or as soon as the data plane has ended the session
        (its verdict names the peer at fault; a stuck worker's call may run on for long)."""
        deadline = time.monotonic() + self.step_timeout_s
        index = {ref: i for i, ref in enumerate(refs)}
        late = TimeoutError(f"no answer within step_timeout_s = {self.step_timeout_s:g} s")
        out: list[Any] = [late] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                out[index[ready[0]]] = ray.get(ready[0])
            except Exception as e:
                out[index[ready[0]]] = e
                cause = root_cause(e)
                if isinstance(cause, SessionError) and cause.action is Action.SESSION_OVER:
                    break
        return out

    def verdict(self, outcomes: list[Any]) -> tuple[BaseException, bool]:
        """What a failed step raises, from every worker's answer, and whether the session stays
        (every peer is still in step: a worker's own failure, or one layer's)."""
        causes = [root_cause(o) for o in outcomes if isinstance(o, BaseException)]
        own = next((c for c in causes if isinstance(c, WorkerError)), None)
        if own is not None:
            return own, not own.died
        dead = self.dead_workers()
        if dead:
            return self.died(dead[0]), False
        plane = [c for c in causes if isinstance(c, SessionError)]
        if plane:
            e = min(plane, key=lambda c: VERDICTS.index(c.action))
            if e.action in (Action.RETRY_ELSEWHERE, Action.START_OVER):
                return e, False
            index = e.peer  # else the first worker that heard it
            if index is None or not 0 <= index < len(self.workers):
                index = next(i for i, o in enumerate(outcomes)
                             if isinstance(o, BaseException) and root_cause(o) is e)
            return WorkerError(index, self.names[index], str(e)), e.action is not Action.SESSION_OVER
        if any(isinstance(c, ray.exceptions.GetTimeoutError | TimeoutError) for c in causes):
            what = f"a step outlived step_timeout_s = {self.step_timeout_s:g} s"
            return self.stuck_worker() or MoEServerError(f"{what}; no worker was found stuck", 504), False
        return causes[0], False

    def fail(self, error: BaseException, keep: bool) -> None:
        """Abort the step on every worker (leaving the session first unless ``keep``), then raise
        what the caller gets."""
        if not keep:
            self.drop(f"step failed: {error_message(error)}")
        died = isinstance(error, WorkerError) and error.died
        pending = self.abort(skip=error.index if died else None)
        if died:
            self.closed = f"worker {error.index} ({error.name}) died"
            raise error
        if pending and not isinstance(error, WorkerError):
            raise pending[0] from error
        raise_for(error)

    def serve_step(self, inputs: list[Any]) -> list[Any]:
        """The step on the Serve path, still aggregated: per layer one request with every
        worker's rows."""
        epoch, timeout = self.epoch, self.step_timeout_s
        try:
            self.gather([w.cohort_start.remote(epoch, x) for w, x in zip(self.workers, inputs, strict=True)],
                        timeout)
            for layer in self.layers:
                parts = self.gather([w.cohort_attend.remote(epoch, layer) for w in self.workers], timeout)
                rows = [p.to_torch() if isinstance(p, WireTensor) else p.cpu() for p in parts]
                sizes = [r.shape[0] for r in rows]
                batch = torch.cat([r for r in rows if r.shape[0]]) if any(sizes) else None
                out = rows[0][:0] if batch is None else self.client.forward(batch, layer)
                pieces = torch.split(out, sizes)
                self.gather([w.cohort_absorb.remote(epoch, layer, p.clone())
                             for w, p in zip(self.workers, pieces, strict=True)], timeout)
            results = self.gather([w.cohort_finish.remote(epoch) for w in self.workers], timeout)
        except Exception as e:
            self.fail(*self.verdict([e]))
        self.counts["serve_steps"] += 1
        return results

    def gather(self, refs: list[Any], timeout: float) -> list[Any]:
        """Every worker's answer; the first failure names its worker."""
        try:
            return ray.get(refs, timeout=timeout)
        except Exception as e:
            if not actor_died(e):
                raise
            dead = self.dead_workers()
            if dead:
                raise self.died(dead[0]) from None
            raise

    def abort(self, skip: int | None = None) -> list[WorkerError]:
        """Undo the step on every worker (but ``skip``, dead); the aborted attempt's calls are
        refused from now on. Returns the workers that could not abort yet (still in a call after
        ``step_timeout_s``: they undo it when that call returns) or at all."""
        self.epoch += 1
        self.counts["aborts"] += 1
        wait_s = self.step_timeout_s
        refs = {i: w.cohort_abort.remote(self.epoch, wait_s) for i, w in enumerate(self.workers) if i != skip}
        pending = []
        for i, ref in refs.items():
            try:
                if not ray.get(ref, timeout=wait_s + PROBE_S):
                    pending.append(WorkerError(i, self.names[i], f"still in a call after {wait_s:.0f} s; its "
                                               "step is undone when that call returns"))
            except Exception as e:
                pending.append(WorkerError(i, self.names[i], f"could not abort its step: {error_message(e)}",
                                           died=actor_died(e)))
        return pending

    def died(self, index: int) -> WorkerError:
        return WorkerError(index, self.names[index], "its actor died", died=True)

    def dead_workers(self) -> list[int]:
        return dead_actors(self.workers)

    def stuck_worker(self) -> WorkerError | None:
        refs = [w.cohort_state.remote() for w in self.workers]
        for i, ref in enumerate(refs):
            try:
                state = ray.get(ref, timeout=PROBE_S)
            except Exception as e:
                return WorkerError(i, self.names[i], f"does not answer ({error_message(e)}): stalled")
            if state["phase"] != "idle":
                return WorkerError(i, self.names[i], f"stuck in {state['phase']} for {state['for_s']:.0f} s")
        return None

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        self.closing = True
        with self.lock:
            self.drop("cohort closed")

    def status(self) -> dict[str, Any]:
        st = self.session.status()
        where = st["deployments"]
        recent = sorted(self.recent_ms)
        return {"cohort": self.name, "workers": list(self.names), "layers": list(self.layers),
                "max_tokens": self.max_tokens, "path": st["path"], "closed": self.closed,
                "step_timeout_s": self.step_timeout_s, **self.counts, "sessions": st["sessions"],
                "step_ms_p50": recent[len(recent) // 2] if recent else None,
                "deployments": {d: {"path": st["path"], "why_serve": st["why_serve"],
                                    **where.get(d, {"replica": None, "session_id": None})}
                                for d in self.deployments}}


class Cohort:
    """M attention workers decoding together on the tier's TP groups; see the module doc.

    Built by :meth:`MoEClient.cohort`; a context manager that closes its session on exit
    (:meth:`close`, also when the last reference to it goes).
    """

    def __init__(self, client: Any, workers: Sequence[ActorHandle], *, layers: Iterable[int] | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, wait_s: float = DEFAULT_WAIT_S,
                 retry_s: float = DEFAULT_RETRY_S, step_timeout_s: float | None = None,
                 name: str | None = None, move_s: float = SESSION_MOVE_S):
        workers = list(workers)
        if not workers or not all(isinstance(w, ActorHandle) for w in workers):
            raise ValueError(f"workers must be a non-empty list of AttentionWorker actor handles, "
                             f"got {workers!r}")
        if len(set(workers)) != len(workers):  # handles compare and hash by actor id
            raise ValueError("workers lists the same actor twice")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer (rows per worker and step), "
                             f"got {max_tokens!r}")
        check_seconds(wait_s=wait_s, retry_s=retry_s, move_s=move_s)
        if step_timeout_s is not None:
            check_seconds(step_timeout_s=step_timeout_s)
        self.name = name or f"cohort-{default_client_name()}-{uuid.uuid4().hex[:4]}"
        chosen, by_layer = layers_by_deployment(client, layers)
        core = CohortCore(client, self.name, workers, chosen, by_layer, max_tokens, float(retry_s),
                          float(move_s))
        self._core = core
        self._close = weakref.finalize(self, core.close)
        try:
            core.describe_groups(by_layer, step_timeout_s)
            core.join()
            core.session.get(float(wait_s))
        except BaseException:
            self.close()
            raise

    @property
    def workers(self) -> list[ActorHandle]:
        return list(self._core.workers)

    @property
    def layers(self) -> tuple[int, ...]:
        return self._core.layers

    @property
    def session(self) -> Session | None:
        """The session the workers are peers of (None: steps take the Serve path)."""
        return self._core.session.session

    def step(self, inputs: Sequence[Any]) -> list[Any]:
        """One decode step of every worker (``inputs[i]`` to worker ``i``'s ``start``); each
        worker's ``finish()`` result, in order. Blocking."""
        return self._core.step(inputs)

    def status(self) -> dict[str, Any]:
        """``path`` (session or serve), ``steps``, ``session_steps``, ``serve_steps``, ``reruns``
        (steps run again after their session ended under them), ``aborts`` (steps undone on every
        worker), ``moves`` (the session's moves to a healthy group), ``sessions`` opened, and per
        deployment where the session is (``replica``, ``session_id``) or ``why_serve``."""
        return self._core.status()

    def close(self) -> None:
        """Leave and close the session (idempotent)."""
        self._close()

    def __enter__(self) -> Cohort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
