"""Cohorts: many attention workers share the tier's TP groups on the fast path, one expert batch
per MoE layer.

    workers = [ray.remote(MyWorker).remote(...) for _ in range(M)]   # AttentionWorker actors
    with MoEClient("default").cohort(workers, max_tokens=4) as cohort:
        results = cohort.step(inputs)        # one input per worker -> one result per worker
        cohort.status()

The reason a separate MoE tier exists is aggregation: every expert GEMM should see the summed
batch of many attention instances. A cohort is the process that owns M attention workers
(``client.attention.AttentionWorker`` actors) driving them through decode steps: per step, **one
execution of one Ray Compiled Graph** over the M workers and the ranks of every TP group that
serves the cohort's layers (the app's routing table, across deployments):

    driver -> each worker: begin (start, attend(first layer))
           -> per MoE layer, in order: the serving group's ranks gather the M workers' rows
              into one batch and run one forward (``TPWorker.lane_forward``: collectives once)
           -> each worker: next (absorb its own rows, attend(next layer)) ... end (absorb, finish)
           -> driver (one result per worker)

A lane (``client.lane``) is the one-caller case: the same leases (``client.leases``), the same
graph builder and rank method, with the caller as its own worker.

**One execution per step, not per layer.** Per-layer executions would put a driver round trip
(driver -> workers -> ... -> driver) on every layer; one execution per step keeps the driver out
of the layer loop, and the per-layer exchange runs between the workers and the ranks only.
``scripts/bench_cohort.py`` measures both shapes on Ray's own echo actors (the floor) beside the
cohort, and docs/benchmarks.md records the numbers behind this choice.

**Ray's limits, designed for** (Ray 2.60): only the compiling process executes a graph (the
cohort's owner does both); an actor runs one graph loop at a time per concurrency group (a
worker is in one cohort at a time; the ranks host several loops, ``serve.lanes``); every graph
loop polls its channels and keeps a core busy while the graph exists (an idle cohort drops its
graph and leases after half a lease term, and leases again at its next step); an actor's death
tears the whole graph down (the cohort recompiles, see faults); Ray's default channel buffer is
1 MB, so the cohort sizes its channels to its own messages (they grow on first use if larger).

**Size** (L MoE layers, M workers, TP groups g of P_g ranks serving L_g of the layers):
nodes = M·(L + 1) + Σ_g P_g·L_g; channels between processes = L·(M + 1) + 1 + M + Σ_g (P_g − 1)
(per layer M worker→ranks channels, each read by the group's P ranks from one buffer, and one
rank 0→workers channel; under sequence parallelism P of those); shared memory = (channels +
L·(M − 1))·b with b = T·H·s + envelope (one worker's rows, T = ``max_tokens``, s = dtype bytes):
every channel starts at b and rank 0's per-layer channel grows to M·b. For Kimi-K3 (L = 92,
M = 8, TP 8, H = 7168, bf16, T = 4): 1,480 nodes, 844 channels, ~91 MB. ``status()["graph"]``
reports the live graph's counts and its compile time.

**Leases and membership.** The cohort leases every deployment serving its layers as a lane does
(``lane_lease_s`` term, renewals, expiry, ``status()["lanes"]`` of the replica lists the lease
with its workers). Membership is fixed: new workers need a new cohort. The graph runs only when
the cohort holds a lease of every group it needs; otherwise (a group held by others, ``lanes:
false``, a lease lost) it releases what it holds and runs the step on the **Serve path, still
aggregated**: the driver gathers every worker's rows per layer and sends them as one request,
asking for the leases again every ``retry_s``.

**Faults.** The retry rule is the tier's one (``common.retry``). A step the graph cannot finish
because a group broke -- a rank died, a rank's forward failed, or the step outlived
``step_timeout_s`` (default twice the groups' call bound) and a rank of the group is stalled or
stuck in its forward -- is aborted on every worker (``abort()``; calls of the aborted attempt
are refused) and run once more, on another replica of that deployment (a new lease and graph)
or else on the Serve path, never on the failed replica: the caller sees no error and the same
tokens while a healthy replica exists. A worker whose own code raised, sent bad rows, stalled or
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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import ray
import torch
from ray.actor import ActorHandle
from ray.dag import InputNode, MultiOutputNode

from moe_runtime.units import torch_dtype

from ..cluster.liveness import dead_actors
from ..common.errors import (
    GroupTimeoutError,
    GroupUnavailableError,
    ServeInputError,
    actor_died,
    error_message,
    root_cause,
)
from ..common.wire import WireTensor, failure_in
from ..config.timeouts import LEASE_ATTEMPT_S, PROBE_S, TEARDOWN_S
from .errors import MoEServerError, WorkerError, raise_for
from .leases import (
    DEFAULT_RETRY_S,
    DEFAULT_WAIT_S,
    GroupLease,
    LeaseHolder,
    bind_group_forward,
    check_seconds,
    default_client_name,
    kept_renewed,
    lease_ended,
    served_layers,
    teardown_then,
)

DEFAULT_MAX_TOKENS = 1  # rows per worker and step (decode: one token per sequence)
MESSAGE_OVERHEAD_BYTES = 4096  # a message's pickled envelope around its rows


def row_bytes(max_tokens: int, hidden: int, itemsize: int) -> int:
    """One worker's rows per layer with their envelope: every channel of the graph starts there."""
    return max_tokens * hidden * itemsize + MESSAGE_OVERHEAD_BYTES


def graph_size_formula(layers: int, workers: int, groups: Sequence[tuple[int, int]],
                       row: int) -> dict[str, int]:
    """The size formula of the module docstring, without sequence parallelism (what
    :func:`graph_size` measures on a live graph): ``groups`` holds (ranks, layers served) per TP
    group, ``row`` is :func:`row_bytes`."""
    channels = layers * (workers + 1) + 1 + workers + sum(ranks - 1 for ranks, _ in groups)
    return {"nodes": workers * (layers + 1) + sum(ranks * served for ranks, served in groups),
            "channels": channels, "shm_bytes_in_use": (channels + layers * (workers - 1)) * row}


@dataclass
class Failure:
    """Why a step failed, as the cohort handles it."""

    kind: str  # "worker" | "input" | "lease" | "group" | "unknown"
    error: BaseException
    deployments: tuple[str, ...] = ()  # the leased groups at fault ("group", "lease")
    stuck: bool = False  # the graph did not finish: it cannot be used again


class StepAgain(Exception):
    """The step was aborted everywhere and may run again (its first attempt met ``failure``)."""

    def __init__(self, failure: Failure, avoid: dict[str, str | None]):
        super().__init__(failure.kind)
        self.failure, self.avoid = failure, avoid


class CohortCore(LeaseHolder):
    """A cohort's workers, leases, graph and counters (what :class:`Cohort` delegates to)."""

    def __init__(self, client: Any, name: str, workers: list[ActorHandle], layers: tuple[int, ...],
                 by_layer: dict[int, str], max_tokens: int, retry_s: float):
        deployments = sorted(set(by_layer.values()))
        self.client, self.workers, self.layers, self.by_layer = client, workers, layers, by_layer
        self.max_tokens, self.names = max_tokens, [f"worker-{i}" for i in range(len(workers))]
        super().__init__(name, {d: GroupLease(client, d, name, max_tokens * len(workers), retry_s, self.names)
                                for d in deployments})
        self.dag: Any = None
        self.epoch = 0  # moves on at every abort: the aborted attempt's calls are refused
        self.closed: str | None = None  # why the cohort can no longer step (a worker died)
        self.info: dict[str, dict[str, Any]] = {}  # deployment -> hidden size, dtype, call bound
        self.devices = ["cpu"] * len(workers)  # where each worker's rows travel from
        self.step_timeout_s = 0.0
        self.graph: dict[str, Any] = {}
        self.counts = {"steps": 0, "graph_steps": 0, "serve_steps": 0, "reruns": 0, "compiles": 0,
                       "aborts": 0}
        self.recent_ms: list[float] = []

    # -- set-up ---------------------------------------------------------------------------

    def describe_groups(self, step_timeout_s: float | None) -> None:
        """Each deployment's hidden size, dtype and call bound (its own ``status()``)."""
        for d in self.leases:
            st = self.client.group_handle(d).status.remote().result(timeout_s=self.client.timeout_s)
            self.info[d] = {"hidden_size": st["workers"][0]["hidden_size"], "dtype": st["dtype"],
                            "call_s": st["bounds"]["call_s"], "device": st["device"]}
        if len({i["hidden_size"] for i in self.info.values()}) > 1:
            raise ValueError(f"the cohort's deployments disagree on the hidden size: {self.info}")
        self.step_timeout_s = step_timeout_s or 2 * max(i["call_s"] for i in self.info.values())

    def join(self) -> None:
        """Seat every worker (an actor that is not an ``AttentionWorker`` fails here)."""
        hidden = next(iter(self.info.values()))["hidden_size"]
        dtypes = {layer: self.info[d]["dtype"] for layer, d in self.by_layer.items()}
        device = next(iter(self.info.values()))["device"]
        seats = []
        for i, w in enumerate(self.workers):
            try:
                joined = w.cohort_join.remote(i, hidden, dtypes, self.max_tokens, self.epoch, device)
                seats.append(ray.get(joined, timeout=self.client.timeout_s))
            except Exception as e:
                raise WorkerError(i, repr(w), f"cannot join the cohort (is it an AttentionWorker actor?): "
                                  f"{error_message(e)}") from None
        self.names = [seat["name"] for seat in seats]
        self.devices = [seat["device"] for seat in seats]
        for lease in self.leases.values():
            lease.workers = list(self.names)

    # -- leases and graph -----------------------------------------------------------------

    def lease_all(self, wait_s: float, avoid: dict[str, str | None] | None = None) -> bool:
        """Hold a lease of every group and a graph over them, or hold nothing (the Serve path
        must not wait behind this cohort's own idle leases)."""
        avoid = avoid or {}
        if self.dag is not None:  # every group held (a graph is built over all of them or none)
            if all(lease.renew() for lease in self.leases.values() if lease.renew_due()):
                return True
        elif any(lease.held or lease.due() or d in avoid for d, lease in self.leases.items()):
            # Leasing each group (each may wait for it) and compiling make no call: the leases
            # already held are renewed meanwhile. (Nothing held and nothing to ask for yet: the
            # Serve path until retry_s, without starting that thread at every step.)
            with kept_renewed(self.leases.values()):
                if self.lease_each(wait_s, avoid):
                    return self.compile()
        self.drop_all(next((lease.why_not for lease in self.leases.values() if lease.why_not),
                           "a group could not be leased"))
        return False

    def lease_each(self, wait_s: float, avoid: dict[str, str | None]) -> bool:
        """Lease every group not held (renewing the held ones when due); False at the first that
        cannot be."""
        for d, lease in self.leases.items():
            if lease.held:
                if lease.renew_due() and not lease.renew():
                    return False
                continue
            if not (lease.due() or d in avoid):
                return False
            wait, lease.next_wait = max(wait_s, lease.next_wait), 0.0
            if not lease.acquire(wait, avoid.get(d)):
                return False
        return True

    def compile(self) -> bool:
        try:
            started = time.perf_counter()
            dag = self.bind()
            # One execution at a time: one buffer per channel (Ray keeps max_inflight of them).
            ranks = [rank for lease in self.leases.values() for rank in lease.grant["ranks"]]
            with channel_buffers(self.workers + ranks, self.buffer_bytes(), self.client.timeout_s):
                self.dag = dag.experimental_compile(_max_inflight_executions=1)
            compile_s = time.perf_counter() - started
            rank0 = {lease.grant["ranks"][0]._actor_id.hex() for lease in self.leases.values()}
            batch = len(self.workers) * self.buffer_bytes()
            self.graph = {**graph_size(self.dag, dict.fromkeys(rank0, batch)),
                          "compile_s": round(compile_s, 3)}
        except Exception as e:
            self.drop_all(f"compiled graph unavailable: {error_message(e)}")
            for lease in self.leases.values():
                lease.next_try = float("inf")  # a graph that cannot be built will not be built later
            return False
        self.counts["compiles"] += 1
        self.last_call = time.monotonic()  # idle time counts from the graph, not from before the compile
        return True

    def bind(self) -> Any:
        """The step's graph (module doc): begin -> per layer, the group's ranks -> next ... end."""
        grants = {d: lease.grant for d, lease in self.leases.items()}
        accelerator = self.transport() == "accelerator"
        after: dict[str, list[Any] | None] = dict.fromkeys(grants)
        with InputNode() as step:  # (epoch, one input per worker)
            xs = [w.cohort_begin.bind(step, self.layers[0]) for w in self.workers]
            for i, layer in enumerate(self.layers):
                d = self.by_layer[layer]
                if accelerator:
                    xs = [x.with_tensor_transport("accelerator") for x in xs]
                ranks = after[d] = bind_group_forward(grants[d], layer, None, xs, after[d])
                outs = ranks if grants[d]["sequence_parallel"] else ranks[:1]
                if accelerator:
                    outs = [out.with_tensor_transport("accelerator") for out in outs]
                if i + 1 < len(self.layers):
                    xs = [w.cohort_next.bind(layer, self.layers[i + 1], *outs) for w in self.workers]
                else:
                    ends = [w.cohort_end.bind(layer, *outs) for w in self.workers]
            # every rank's last node that no worker reads (rank r > 0 outside sequence parallel)
            rest = [n for d, nodes in after.items() if nodes and not grants[d]["sequence_parallel"]
                    for n in nodes[1:]]
            return MultiOutputNode(ends + rest)

    def transport(self) -> str:
        """``accelerator`` (NCCL/RCCL between workers and ranks) where every worker and every
        leased group's ranks are on GPUs; else ``shm`` (the driver only sends step inputs)."""
        ranks = [lease.grant["device"] if lease.grant is not None else "" for lease in self.leases.values()]
        gpus = all(d.startswith("cuda") for d in self.devices + ranks)
        return "accelerator" if gpus else "shm"

    def buffer_bytes(self) -> int:
        """One worker's rows per layer (+ envelope): channels start there; rank 0's batch grows
        its channel to M times that on first use."""
        itemsize = max(torch_dtype(i["dtype"]).itemsize for i in self.info.values())
        return row_bytes(self.max_tokens, next(iter(self.info.values()))["hidden_size"], itemsize)

    def drop_all(self, why: str, wait_s: float = 0.5) -> None:
        """Tear the graph down and release every lease (aside; the Serve path until asked again)."""
        grants = [lease.take(why) for lease in self.leases.values() if lease.held]
        dag, self.dag = self.dag, None

        def release() -> None:
            for grant in grants:
                GroupLease.release(grant)

        if dag is not None:
            teardown_then(dag, release, TEARDOWN_S if self.closing else wait_s, self.name)
        else:
            release()

    def drop_graph(self) -> None:
        """Tear the graph down, keeping the leases (waits: a new graph over the same actors must
        not be compiled while the old one's loops still run)."""
        dag, self.dag = self.dag, None
        if dag is not None:
            teardown_then(dag, lambda: None, TEARDOWN_S, self.name)

    def drop_idle(self, why: str) -> None:
        self.drop_all(why)

    # -- steps ----------------------------------------------------------------------------

    def step(self, inputs: Sequence[Any]) -> list[Any]:
        if self.closing or self.closed:
            raise RuntimeError(f"cohort {self.name} is closed{': ' + self.closed if self.closed else ''}")
        if not isinstance(inputs, list | tuple) or len(inputs) != len(self.workers):
            got = len(inputs) if isinstance(inputs, list | tuple) else repr(inputs)
            raise ValueError(f"cohort {self.name} has {len(self.workers)} workers: step() takes one input "
                             f"per worker, got {got}")
        with self.lock:
            self.last_call = started = time.monotonic()
            results = self.attempts(list(inputs))
            self.counts["steps"] += 1
            self.recent_ms = [*self.recent_ms[-63:], round((time.monotonic() - started) * 1e3, 3)]
            self.last_call = time.monotonic()
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
            return self.graph_step(inputs)
        return self.serve_step(inputs, avoid if not first else None)

    def graph_step(self, inputs: list[Any]) -> list[Any]:
        try:
            results = ray.get(self.dag.execute((self.epoch, inputs)), timeout=self.step_timeout_s)
        except Exception as e:
            self.handle(self.classify(e))
        failed = failure_in(results)
        if failed is not None:  # the graph finished the step around a worker's failure: it stays
            error = WorkerError(failed.index, failed.name, failed.message)
            self.handle(Failure("worker", error), graph_ok=True)
        self.counts["graph_steps"] += 1
        return list(results[: len(self.workers)])

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
        cause = root_cause(exc)
        if isinstance(cause, WorkerError):
            return Failure("worker", cause)
        if isinstance(cause, ServeInputError):
            return Failure("input", cause)
        if lease_ended(cause):
            return Failure("lease", cause, tuple(d for d, lease in self.leases.items()
                                                 if lease.held and lease.grant["lease_id"] in str(cause)))
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

    def handle(self, failure: Failure, serve: bool = False, graph_ok: bool = False) -> NoReturn:
        """Abort the step everywhere, then raise what the caller (or the retry rule) gets.

        A worker's failure reaches the driver as a value the graph carried to the end
        (``graph_ok``): the graph stays. Any other failed graph step tears it down: a group's
        failure or a stuck step leaves it broken (its leases go too), and after an exception
        inside a graph Ray 2.60 leaves the channel buffer a skipped node had read held for good,
        so that the graph hangs once its writer comes back to it (measured: the next step with
        one buffer per channel). The next step compiles a new graph on the leases it still holds."""
        error = failure.error
        died = isinstance(error, WorkerError) and error.died
        avoid = {d: self.leases[d].replica for d in failure.deployments}
        if died or failure.stuck or (not serve and failure.kind not in ("worker", "input")):
            self.drop_all(f"step failed: {error_message(error)}")
            for d, lease in self.leases.items():
                if d not in failure.deployments:
                    lease.next_try = 0.0  # nothing wrong there: the re-run leases it again at once
        elif not serve and not graph_ok:
            self.drop_graph()
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
            refs = [rank.lane_state.remote() for rank in lease.grant["ranks"]]
            for r, ref in enumerate(refs):
                try:
                    state = ray.get(ref, timeout=PROBE_S)
                except Exception as e:
                    how = "died" if actor_died(e) else "does not answer"
                    broken[d] = f"rank {r} of {d!r} (replica {lease.replica}) {how}"
                    break
                if state["failed"]:
                    broken[d] = f"{d!r} (replica {lease.replica}): {state['failed']}"
                    break
                if state["in_flight_tokens"]:
                    broken[d] = f"rank {r} of {d!r} (replica {lease.replica}) is stuck in its forward"
                    break
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
        held = all(lease.held for lease in self.leases.values()) and self.dag is not None
        recent = sorted(self.recent_ms)
        return {"cohort": self.name, "workers": list(self.names), "layers": list(self.layers),
                "max_tokens": self.max_tokens, "path": "graph" if held else "serve",
                "transport": self.transport() if held else None, "closed": self.closed,
                "step_timeout_s": self.step_timeout_s, "graph": dict(self.graph), **self.counts,
                "step_ms_p50": recent[len(recent) // 2] if recent else None,
                "deployments": {d: lease.status() for d, lease in self.leases.items()}}


def set_channel_buffer(_actor: Any, size: int) -> int:
    """Runs in an actor (``__ray_call__``): its graph channels start at ``size`` bytes; returns
    the size before."""
    from ray.dag import DAGContext

    ctx = DAGContext.get_current()
    before, ctx.buffer_size_bytes = ctx.buffer_size_bytes, size
    return before


@contextmanager
def channel_buffers(actors: Sequence[ActorHandle], size: int, timeout_s: float):
    """Channels compiled meanwhile start with ``size``-byte buffers. Ray 2.60 allocates a node's
    output channel in its actor's process at the size of that process's ``DAGContext``
    (``experimental_compile``'s ``_buffer_size_bytes`` reaches only the driver's input channel),
    so the context is set on every actor of the graph around the compile, then restored."""
    before = ray.get([a.__ray_call__.remote(set_channel_buffer, size) for a in actors], timeout=timeout_s)
    driver = set_channel_buffer(None, size)
    try:
        yield
    finally:
        set_channel_buffer(None, driver)
        with contextlib.suppress(Exception):  # an actor gone: its channels went with it
            restore = zip(actors, before, strict=True)
            ray.get([a.__ray_call__.remote(set_channel_buffer, b) for a, b in restore], timeout=timeout_s)


def graph_size(dag: Any, message_bytes: dict[str, int]) -> dict[str, int]:
    """Nodes, channels between processes (their shared-memory buffers) and bytes of a compiled
    graph: ``shm_bytes`` as compiled, ``shm_bytes_in_use`` once each channel has grown to the
    largest message its writer sends (``message_bytes``: writer actor id -> bytes)."""
    from ray.experimental.channel.shared_memory_channel import (
        BufferedSharedMemoryChannel,
        Channel,
        CompositeChannel,
    )

    channels: dict[int, tuple[list[Any], str]] = {}  # a channel's buffers and its writer
    outputs = [ch for task in dag.idx_to_task.values() for ch in getattr(task, "output_channels", None) or []]
    for ch in outputs + list(dag.dag_input_channels):
        for c in ch._channels if isinstance(ch, CompositeChannel) else [ch]:
            buffers = c._buffers if isinstance(c, BufferedSharedMemoryChannel) else [c]
            if isinstance(buffers[0], Channel):  # not an in-process channel
                writer = buffers[0]._writer
                channels[id(c)] = (buffers, "driver" if writer is None else writer._actor_id.hex())
    nodes = sum(1 for t in dag.idx_to_task.values() if getattr(t, "dag_node", None) is not None
                and type(t.dag_node).__name__ == "ClassMethodNode")
    size = sum(b._typ.buffer_size_bytes for bs, _ in channels.values() for b in bs)
    in_use = sum(max(b._typ.buffer_size_bytes, message_bytes.get(w, 0))
                 for bs, w in channels.values() for b in bs)
    return {"nodes": nodes, "channels": len(channels), "buffers": sum(len(bs) for bs, _ in channels.values()),
            "shm_bytes": size, "shm_bytes_in_use": in_use}


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
        if len({w._actor_id for w in workers}) != len(workers):
            raise ValueError("workers lists the same actor twice")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer (rows per worker and step), "
                             f"got {max_tokens!r}")
        check_seconds(wait_s=wait_s, retry_s=retry_s)
        if step_timeout_s is not None:
            check_seconds(step_timeout_s=step_timeout_s)
        self.name = name or f"cohort-{default_client_name()}-{uuid.uuid4().hex[:4]}"
        if client.deployment is not None:
            status = client.group_handle(client.deployment).status.remote().result(timeout_s=client.timeout_s)
            served = tuple(status["layers"])
            chosen = served if layers is None else tuple(sorted({int(x) for x in layers}))
            unknown = sorted(set(chosen) - set(served))
            if unknown:
                raise ValueError(f"layer(s) {unknown} are not served by deployment {client.deployment!r} "
                                 f"(it serves {list(served)})")
            by_layer = dict.fromkeys(chosen, client.deployment)
        else:
            chosen = served_layers(client, layers)
            routes = client.layer_routes()
            by_layer = {x: routes.choose(x, None) for x in chosen}
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
        core.watch_idle()

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
        """Tear the graph down and release every lease (idempotent)."""
        self._close()

    def __enter__(self) -> Cohort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
