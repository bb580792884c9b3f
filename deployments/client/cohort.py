"""Cohorts: many attention workers share the tier's TP groups on the data plane, one expert batch
per MoE layer.

    workers = [ray.remote(MyWorker).remote(...) for _ in range(M)]   # AttentionWorker actors
    with MoEClient("default").cohort(workers, max_tokens=4) as cohort:
        results = cohort.step(inputs)        # one input per worker -> one result per worker
        cohort.status()

The reason a separate MoE tier exists is aggregation: every expert GEMM should see the summed
batch of many attention instances. A cohort is the process that owns M attention workers
(``client.attention.AttentionWorker`` actors) and leases every TP group serving its layers (the
app's routing table, across deployments) for **one data-plane session of M peers**
(``deployments.dataplane``): each worker joins it as peer ``i``. A step is one actor call per
worker (``cohort_step``), in which the worker drives its own layers: start -> per MoE layer,
attend, send its rows to the group serving the layer, wait for its slice, absorb -> finish.
Per layer the group's rank 0 waits for all M workers' rows, runs **one** forward over them on
every rank and answers each worker; the driver is not on the per-layer path at all.

**Sessions and membership.** The cohort opens its session on every deployment serving its layers
as a lane does (no term; ``status()["sessions"]`` of the replica lists it with its workers).
Membership is fixed: new workers need a new cohort. Steps run on the data plane only when the
cohort holds the session on every group it needs; otherwise (a replica refusing it, ``lanes:
false``, a session lost) it closes what it holds and runs the step on the **Serve path, still
aggregated**: the driver gathers every worker's rows per layer and sends them as one request,
asking for the sessions again every ``retry_s``.

**Faults.** The data plane names what ended a layer (``dataplane.errors``: one table from
failure kind to action) and the retry rule is the tier's one (``common.retry``). A step that
met a broken group -- a rank died or failed, or a rank stalled past the call bound -- is aborted
on every worker (``abort()``; calls of the aborted attempt are refused by an epoch) and run once
more, on another replica of that deployment (a new session) or else on the Serve path,
never on the failed replica: the caller sees no error and the same tokens while a healthy
replica exists. A step that met an ended session never ran: it starts over once. A worker whose
own code raised, sent bad rows, stalled (the session ends within the call bound, naming it) or
died raises :class:`~deployments.client.errors.WorkerError` naming it, after the step was aborted
on every other worker; a dead worker also closes the cohort. A bad input never reaches a rank
(each worker checks its rows) and the cohort stays usable. Nothing waits without a bound.

**Exactness.** Every worker's rows equal the Serve path's forward of the same concatenated batch
bit for bit (same ranks, runners and tail plan).
"""

from __future__ import annotations

import contextlib
import time
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import ray
import torch
from ray.actor import ActorHandle

from ..cluster.liveness import dead_actors
from ..common.errors import (
    GroupTimeoutError,
    GroupUnavailableError,
    ServeInputError,
    actor_died,
    error_message,
    root_cause,
)
from ..common.wire import WireTensor
from ..config.timeouts import DEFAULT_RETRY_S, DEFAULT_WAIT_S, LEASE_ATTEMPT_S, PROBE_S
from ..dataplane.errors import Action, SessionError
from ..dataplane.errors import Failure as PlaneFailure
from ..dataplane.peer import GroupEndpoint, SessionTicket, answer_bound_s
from .errors import MoEServerError, WorkerError, raise_for
from .leases import (
    GroupLease,
    LeaseHolder,
    check_seconds,
    default_client_name,
    layers_by_deployment,
)

DEFAULT_MAX_TOKENS = 1  # rows per worker and step (decode: one token per sequence)


@dataclass
class Failure:
    """Why a step failed, as the cohort handles it."""

    kind: str  # "worker" | "input" | "lease" | "group" | "unknown"
    error: BaseException
    deployments: tuple[str, ...] = ()  # the leased groups at fault ("group", "lease")
    stuck: bool = False  # the step did not finish on every worker
    ended: bool = False  # the session is over (a peer went, stalled or fell out of step)


class StepAgain(Exception):
    """The step was aborted everywhere and may run again (its first attempt met ``failure``)."""

    def __init__(self, failure: Failure, avoid: dict[str, str | None]):
        super().__init__(failure.kind)
        self.failure, self.avoid = failure, avoid


class CohortCore(LeaseHolder):
    """A cohort's workers, leases, session and counters (what :class:`Cohort` delegates to)."""

    def __init__(self, client: Any, name: str, workers: list[ActorHandle], layers: tuple[int, ...],
                 by_layer: dict[int, str], max_tokens: int, retry_s: float):
        deployments = sorted(set(by_layer.values()))
        self.client, self.workers, self.layers, self.by_layer = client, workers, layers, by_layer
        self.max_tokens, self.names = max_tokens, [f"worker-{i}" for i in range(len(workers))]
        super().__init__(name, {d: GroupLease(client, d, name, max_tokens, retry_s, self.names, len(workers))
                                for d in deployments})
        self.ticket: SessionTicket | None = None  # the session every worker has joined
        self.epoch = 0  # moves on at every abort: the aborted attempt's calls are refused
        self.closed: str | None = None  # why the cohort can no longer step (a worker died)
        self.info: dict[str, dict[str, Any]] = {}  # deployment -> hidden size, dtype, call bound
        self.step_timeout_s = 0.0
        self.counts = {"steps": 0, "session_steps": 0, "serve_steps": 0, "reruns": 0, "sessions": 0,
                       "aborts": 0}
        self.recent_ms: list[float] = []

    # -- set-up ---------------------------------------------------------------------------

    def describe_groups(self, step_timeout_s: float | None) -> None:
        """Each deployment's hidden size, dtype and call bound (its own ``status()``)."""
        for d in self.leases:
            st = self.client.group_handle(d).status.remote().result(timeout_s=self.client.timeout_s)
            self.info[d] = {"hidden_size": st["workers"][0]["hidden_size"], "dtype": st["dtype"],
                            "call_s": st["bounds"]["call_s"]}
        if len({i["hidden_size"] for i in self.info.values()}) > 1:
            raise ValueError(f"the cohort's deployments disagree on the hidden size: {self.info}")
        # A worker's wait for a layer (dataplane.peer), and a probe's for the driver.
        call_s = max(i["call_s"] for i in self.info.values())
        self.step_timeout_s = step_timeout_s or answer_bound_s(call_s) + PROBE_S

    def join(self) -> None:
        """Seat every worker (an actor that is not an ``AttentionWorker`` fails here)."""
        hidden = next(iter(self.info.values()))["hidden_size"]
        dtypes = {layer: self.info[d]["dtype"] for layer, d in self.by_layer.items()}
        seats = []
        for i, w in enumerate(self.workers):
            try:
                joined = w.cohort_join.remote(i, hidden, dtypes, self.max_tokens, self.epoch)
                seats.append(ray.get(joined, timeout=self.client.timeout_s))
            except Exception as e:
                raise WorkerError(i, repr(w), f"cannot join the cohort (is it an AttentionWorker actor?): "
                                  f"{error_message(e)}") from None
        self.names = [seat["name"] for seat in seats]
        for lease in self.leases.values():
            lease.workers = list(self.names)

    # -- leases and session ---------------------------------------------------------------

    def lease_all(self, wait_s: float, avoid: dict[str, str | None] | None = None) -> bool:
        """Hold the session on every group, or hold nothing (a session spans all of them or none)."""
        avoid = avoid or {}
        if self.ticket is not None:
            return True
        if any(lease.held or lease.due() or d in avoid for d, lease in self.leases.items()) \
                and self.lease_each(wait_s, avoid):
            return self.join_session()
        self.drop_all(next((lease.why_not for lease in self.leases.values() if lease.why_not),
                           "a group's session could not be opened"))
        return False

    def lease_each(self, wait_s: float, avoid: dict[str, str | None]) -> bool:
        """Open the session on every group not held; False at the first that cannot be."""
        for d, lease in self.leases.items():
            if lease.held:
                continue
            if not (lease.due() or d in avoid):
                return False
            wait, lease.next_wait = max(wait_s, lease.next_wait), 0.0
            if not lease.acquire(wait, avoid.get(d)):
                return False
        return True

    def layers_of(self, deployment: str) -> list[int]:
        return [x for x in self.layers if self.by_layer[x] == deployment]

    def join_session(self) -> bool:
        """Every worker joins the session the leases opened, as its peer."""
        groups = tuple(GroupEndpoint.from_grant(lease.grant, self.layers_of(d))
                       for d, lease in self.leases.items())
        ticket = SessionTicket(self.name, len(self.workers), groups)
        try:
            self.gather([w.cohort_session.remote(ticket) for w in self.workers], self.client.timeout_s)
        except Exception as e:
            self.drop_all(f"the workers could not join the session: {error_message(e)}")
            if isinstance(root_cause(e), WorkerError) and root_cause(e).died:
                raise root_cause(e) from None
            return False
        self.ticket = ticket
        self.counts["sessions"] += 1
        return True

    def drop_all(self, why: str) -> None:
        """Leave the session and release every lease (the Serve path until asked again)."""
        grants = [lease.take(why) for lease in self.leases.values() if lease.held]
        if self.ticket is not None:
            self.ticket = None
            with contextlib.suppress(Exception):  # a worker gone: its connections went with it
                ray.get([w.cohort_session.remote(None) for w in self.workers], timeout=PROBE_S)
        for grant in grants:
            GroupLease.release(grant, why)

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
            results = self.attempts(list(inputs))
            self.counts["steps"] += 1
            self.recent_ms = [*self.recent_ms[-63:], round((time.monotonic() - started) * 1e3, 3)]
            return results

    def attempts(self, inputs: list[Any]) -> list[Any]:
        """The retry rule for a step: once more (avoiding the failed groups' replicas) after a
        group broke; an attempt the ranks refused for a lost lease never ran and starts over
        once, the rerun's too."""
        try:
            return self.started_over(inputs, first=True)
        except StepAgain as again:
            self.counts["reruns"] += 1
            try:
                return self.started_over(inputs, first=False, avoid=again.avoid)
            except StepAgain as last:
                raise_for(last.failure.error)

    def started_over(self, inputs: list[Any], first: bool,
                     avoid: dict[str, str | None] | None = None) -> list[Any]:
        """One attempt, and once more if the ranks refused it for a lost lease (it never ran);
        a second lost lease is the caller's error, any other failure raises ``StepAgain``."""
        try:
            return self.attempt(inputs, first, avoid)
        except StepAgain as again:
            if again.failure.kind != "lease":
                raise
        try:
            return self.attempt(inputs, first, avoid)
        except StepAgain as twice:
            if twice.failure.kind == "lease":
                raise_for(twice.failure.error)
            raise

    def attempt(self, inputs: list[Any], first: bool,
                avoid: dict[str, str | None] | None = None) -> list[Any]:
        if self.lease_all(0.0 if first else LEASE_ATTEMPT_S, avoid):
            return self.session_step(inputs)
        return self.serve_step(inputs, avoid if not first else None)

    def session_step(self, inputs: list[Any]) -> list[Any]:
        """One ``cohort_step`` call per worker: each drives its layers on the session."""
        epoch = self.epoch
        layers = list(self.layers)
        refs = [w.cohort_step.remote(epoch, x, layers) for w, x in zip(self.workers, inputs, strict=True)]
        outcomes = self.outcomes(refs)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            self.handle(self.classify_session(failures, outcomes))
        self.counts["session_steps"] += 1
        return outcomes

    def outcomes(self, refs: list[Any]) -> list[Any]:
        """Each worker's result or exception. Waiting ends at the step bound (a worker still
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

    def classify_session(self, failures: list[BaseException], outcomes: list[Any]) -> Failure:
        """Why a session step failed, from every worker's answer (``dataplane.errors.ACTIONS``):
        a worker's own failure names it; otherwise the data plane's verdict decides."""
        causes = [root_cause(e) for e in failures]
        own = next((c for c in causes if isinstance(c, WorkerError)), None)
        if own is not None:
            return Failure("worker", own)
        dead = self.dead_workers()
        if dead:
            return Failure("worker", WorkerError(dead[0], self.names[dead[0]], "its actor died", died=True))
        plane = [c for c in causes if isinstance(c, SessionError)]
        if not plane:  # the step bound passed with no verdict from the data plane
            return self.classify(failures[0])
        # The most telling verdict first: a broken group, then an ended lease, then a peer's.
        order = (Action.RETRY_ELSEWHERE, Action.START_OVER, Action.SESSION_OVER, Action.PEER_ERROR,
                 Action.CALLER_ERROR)
        e = min(plane, key=lambda c: order.index(c.action))
        at_fault = tuple(d for d, lease in self.leases.items() if lease.replica == e.replica)
        if e.action is Action.RETRY_ELSEWHERE:
            at_fault = at_fault or tuple(self.leases)
            timeout = e.failure is PlaneFailure.GROUP_TIMEOUT
            if timeout:
                for d in at_fault:
                    self.leases[d].report_timeout(str(e))
            error = (GroupTimeoutError if timeout else GroupUnavailableError)(str(e), e.replica)
            return Failure("group", error, at_fault)
        if e.action is Action.START_OVER:
            return Failure("lease", e, at_fault)
        if e.peer is not None and 0 <= e.peer < len(self.workers):
            index = e.peer
        else:  # out of step as a whole, or rows refused: the first worker that got it
            index = next(i for i, o in enumerate(outcomes) if isinstance(root_cause(o), SessionError))
        return Failure("worker", WorkerError(index, self.names[index], str(e)),
                       ended=e.action is Action.SESSION_OVER)

    def serve_step(self, inputs: list[Any], avoid: dict[str, str | None] | None) -> list[Any]:
        """The step on the Serve path, still aggregated: per layer one request with every
        worker's rows. ``avoid``: a second attempt (one try per request, never those replicas)."""
        epoch, timeout = self.epoch, self.step_timeout_s
        try:
            self.gather([w.cohort_start.remote(epoch, x) for w, x in zip(self.workers, inputs, strict=True)],
                        timeout)
            for layer in self.layers:
                parts = self.gather([w.cohort_attend.remote(epoch, layer) for w in self.workers], timeout)
                rows = [p.to_torch() if isinstance(p, WireTensor) else p.cpu() for p in parts]
                sizes = [r.shape[0] for r in rows]
                batch = torch.cat([r for r in rows if r.shape[0]]) if any(sizes) else None
                out = rows[0][:0] if batch is None else self.serve_forward(batch, layer, avoid)
                pieces = torch.split(out, sizes)
                self.gather([w.cohort_absorb.remote(epoch, layer, p.clone())
                             for w, p in zip(self.workers, pieces, strict=True)], timeout)
            results = self.gather([w.cohort_finish.remote(epoch) for w in self.workers], timeout)
        except Exception as e:
            self.handle(self.classify(e), serve=True)
        self.counts["serve_steps"] += 1
        return results

    def serve_forward(self, batch: torch.Tensor, layer: int,
                      avoid: dict[str, str | None] | None) -> torch.Tensor:
        if avoid is None:
            return self.client.forward(batch, layer)
        return self.client.forward_once(batch, layer, avoid_replica=avoid.get(self.by_layer[layer]))

    def gather(self, refs: list[Any], timeout: float) -> list[Any]:
        """Every worker's answer; the first failure names its worker."""
        try:
            return ray.get(refs, timeout=timeout)
        except Exception as e:
            if not actor_died(e):
                raise
            dead = self.dead_workers()
            if dead:
                raise WorkerError(dead[0], self.names[dead[0]], "its actor died", died=True) from None
            raise

    # -- failures -------------------------------------------------------------------------

    def classify(self, exc: BaseException) -> Failure:
        """Why a Serve-path step, or a session step without the data plane's verdict, failed."""
        cause = root_cause(exc)
        if isinstance(cause, WorkerError):
            return Failure("worker", cause)
        if isinstance(cause, ServeInputError):
            return Failure("input", cause)
        dead = self.dead_workers()
        if dead:
            return Failure("worker", WorkerError(dead[0], self.names[dead[0]], "its actor died", died=True))
        broken = self.broken_groups()
        if isinstance(cause, ray.exceptions.GetTimeoutError | TimeoutError):
            what = f"a step outlived step_timeout_s = {self.step_timeout_s:.0f} s"
            if broken:
                for d in broken:
                    self.leases[d].report_timeout(f"{what}: {broken[d]}")
                return Failure("group", GroupTimeoutError(f"{what}: {'; '.join(broken.values())}"),
                               tuple(broken), stuck=True)
            stuck = self.stuck_worker()
            if stuck is not None:
                return Failure("worker", stuck, stuck=True)
            unknown = MoEServerError(f"{what}; no rank or worker was found stuck", 504)
            return Failure("unknown", unknown, stuck=True)
        if broken:
            return Failure("group", GroupUnavailableError("; ".join(broken.values())), tuple(broken))
        if isinstance(cause, GroupUnavailableError):  # a Serve-path call met a broken group
            return Failure("group", cause, tuple(self.leases))
        return Failure("unknown", cause)

    def handle(self, failure: Failure, serve: bool = False) -> NoReturn:
        """Abort the step everywhere, then raise what the caller (or the retry rule) gets. A
        worker's own failure leaves the session as it is (every peer got that layer's error and
        is in step); anything else on the data plane -- a broken group, an ended lease or
        session, a stuck step -- leaves the session and its leases (the next step leases again)."""
        error = failure.error
        died = isinstance(error, WorkerError) and error.died
        avoid = {d: self.leases[d].replica for d in failure.deployments}
        if died or failure.stuck or failure.ended or (not serve and failure.kind not in ("worker", "input")):
            self.drop_all(f"step failed: {error_message(error)}")
            for d, lease in self.leases.items():
                if d not in failure.deployments:
                    lease.next_try = 0.0  # nothing wrong there: the re-run leases it again at once
        pending = self.abort(skip=error.index if died else None)
        if died:
            self.closed = f"worker {error.index} ({error.name}) died"
            raise error
        if not serve and failure.kind in ("group", "lease") and not pending:
            raise StepAgain(failure, avoid)
        if pending and not isinstance(error, WorkerError):
            raise pending[0] from error
        raise_for(error)

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

    def dead_workers(self) -> list[int]:
        return dead_actors(self.workers)

    def broken_groups(self) -> dict[str, str]:
        """Leased groups with a dead, silent, failed or stuck rank -> what is wrong."""
        broken = {}
        for d, lease in self.leases.items():
            if not lease.held:
                continue
            try:  # rank 0 runs every forward of the group and hears of every rank's failure
                state = ray.get(lease.grant["ranks"][0].dataplane_health.remote(), timeout=PROBE_S)
            except Exception as e:
                how = "died" if actor_died(e) else "does not answer"
                broken[d] = f"rank 0 of {d!r} (replica {lease.replica}) {how}"
                continue
            if state["failed"]:
                broken[d] = f"{d!r} (replica {lease.replica}): {state['failed']}"
            elif (state["forward_running_s"] or 0.0) > self.info[d]["call_s"]:  # shared: others' run too
                broken[d] = f"rank 0 of {d!r} (replica {lease.replica}) is stuck in its forward"
        return broken

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
            self.drop_all("cohort closed")

    def status(self) -> dict[str, Any]:
        held = all(lease.held for lease in self.leases.values()) and self.ticket is not None
        recent = sorted(self.recent_ms)
        return {"cohort": self.name, "workers": list(self.names), "layers": list(self.layers),
                "max_tokens": self.max_tokens, "path": "session" if held else "serve", "closed": self.closed,
                "step_timeout_s": self.step_timeout_s, **self.counts,
                "step_ms_p50": recent[len(recent) // 2] if recent else None,
                "deployments": {d: lease.status() for d, lease in self.leases.items()}}


class Cohort:
    """M attention workers decoding together on the tier's TP groups; see the module doc.

    Built by :meth:`MoEClient.cohort`; a context manager that releases its leases on exit
    (:meth:`close`, also when the last reference to it goes).
    """

    def __init__(self, client: Any, workers: Sequence[ActorHandle], *, layers: Iterable[int] | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, wait_s: float = DEFAULT_WAIT_S,
                 retry_s: float = DEFAULT_RETRY_S, step_timeout_s: float | None = None,
                 name: str | None = None):
        workers = list(workers)
        if not workers or not all(isinstance(w, ActorHandle) for w in workers):
            raise ValueError(f"workers must be a non-empty list of AttentionWorker actor handles, "
                             f"got {workers!r}")
        if len(set(workers)) != len(workers):  # handles compare and hash by actor id
            raise ValueError("workers lists the same actor twice")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer (rows per worker and step), "
                             f"got {max_tokens!r}")
        check_seconds(wait_s=wait_s, retry_s=retry_s)
        if step_timeout_s is not None:
            check_seconds(step_timeout_s=step_timeout_s)
        self.name = name or f"cohort-{default_client_name()}-{uuid.uuid4().hex[:4]}"
        chosen, by_layer = layers_by_deployment(client, layers)
        core = CohortCore(client, self.name, workers, chosen, by_layer, max_tokens, float(retry_s))
        self._core = core
        self._close = weakref.finalize(self, core.close)
        try:
            core.describe_groups(step_timeout_s)
            core.join()
            core.lease_all(float(wait_s))
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
    def leases(self) -> dict[str, GroupLease]:
        return self._core.leases

    def step(self, inputs: Sequence[Any]) -> list[Any]:
        """One decode step of every worker (``inputs[i]`` to worker ``i``'s ``start``); each
        worker's ``finish()`` result, in order. Blocking."""
        return self._core.step(inputs)

    def status(self) -> dict[str, Any]:
        return self._core.status()

    def close(self) -> None:
        """Leave the session and release every lease (idempotent)."""
        self._close()

    def __enter__(self) -> Cohort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
