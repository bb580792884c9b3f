"""The replica's side of its TP group: start the workers, forward batches, health, warm-up.

:class:`TPGroup` sends the same batch to every rank, returns rank 0's output (sequence parallel:
every rank's rows, in order), bounds every call by the collective timeout plus a margin, and
marks the group broken on the first failure so the replica turns unhealthy and Serve replaces
it. :func:`tune_group` measures a pending ``auto`` tail on the group at warm-up: every rank
times each legal tail at ``auto_tune_tokens`` (the tails run collectives), rank 0's timings
decide the plan (fastest tail per token range), and every rank adopts it on every served layer.
The measurement's clock is injectable (``tune_clock: "module:callable"``, resolved on the
workers) so tests are deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import ray
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from moe_runtime.logs import log_once
from moe_runtime.tp.plan import Clock, TailPlan, Timings

from .. import logger
from ..cluster import kv
from ..cluster.liveness import dead_actors_async
from ..common.errors import GroupTimeoutError, GroupUnavailableError, actor_died, error_message
from ..common.wire import WireTensor, copy_graph_outputs, join_rank_outputs
from ..config.resolve import ResolvedDeployment
from ..config.timeouts import LIVENESS_POLL_S
from ..control.accelerator import Accelerator
from ..control.decide import MEASURED, REUSED, Decision, TailDecision, measured_plan
from ..control.serve_options import worker_resources
from ..control.warmup import plan_key, plan_key_fields
from .lanes import LANE_GRAPH_SLOTS
from .worker import WORKER_NAMESPACE, TPWorker

INLINE_BYTES = 64 * 1024  # below Ray's inline-argument limit (100 KiB by default)


class _RankFailure(Exception):
    def __init__(self, rank: int, error: BaseException):
        super().__init__(rank, error)
        self.rank, self.error = rank, error


class TPGroup:
    """The replica's handle on its workers: start, forward, health collective, shutdown."""

    def __init__(self, resolved: ResolvedDeployment, workers: list, names: list[str], infos: list[dict],
                 replica: str):
        self.resolved, self.replica = resolved, replica
        self.workers, self.names, self.infos = workers, names, infos
        self.world = resolved.spec.tp_size
        self.bounds = resolved.spec.bounds
        self.broken: str | None = None
        self._lock = asyncio.Lock()  # one group call at a time: every rank sees the same order
        self._submit_lock = threading.Lock()
        # Called with True when a forward starts running on the ranks, False when it ends.
        self.busy_listeners: list[Callable[[bool], None]] = []
        self._dag: Any = None  # the forward hop as a compiled graph (compiled at the first forward)
        self.transport: str | None = None  # how forwards reach the ranks, once decided
        self._logged_transport: str | None = None
        self.last_forward = time.monotonic()
        self.graph_drops = 0  # compiled graphs torn down for idleness
        self._idle_watch: asyncio.Task | None = None

    @classmethod
    def start(cls, resolved: ResolvedDeployment, accelerator: Accelerator, replica: str) -> TPGroup:
        """Start ``tp_size`` workers in bundles ``1..P`` of the current placement group."""
        spec = resolved.spec
        tag = f"{spec.name}:{replica}"
        startup_timeout_s = spec.bounds.startup_s
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError(
                f"deployment {spec.name!r} must run in a placement group of 1 + {spec.tp_size} bundles "
                "(placement_group_bundles in its options, see deployments.control.serve_options)"
            )
        # Graph loops run on the actor's _ray_system threads: its replica's graph, a lane's, and
        # those abandoned by lane clients that died (serve.lanes).
        actor_cls = ray.remote(concurrency_groups={"_ray_system": LANE_GRAPH_SLOTS})(TPWorker)
        resources = worker_resources(spec, accelerator.layout)
        workers, names = [], []
        for rank in range(spec.tp_size):
            name = f"{tag}:rank{rank}"
            workers.append(
                actor_cls.options(
                    name=name,
                    namespace=WORKER_NAMESPACE,
                    num_cpus=resources["num_cpus"],
                    num_gpus=resources["num_gpus"],
                    resources=resources["resources"],
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg,
                        placement_group_bundle_index=1 + rank,
                        placement_group_capture_child_tasks=False,
                    ),
                ).remote(rank, resolved, accelerator.compute)
            )
            names.append(name)
        try:
            addr, port = ray.get(workers[0].rendezvous_address.remote(), timeout=startup_timeout_s)
            infos = ray.get([w.setup.remote(addr, port) for w in workers], timeout=startup_timeout_s)
        except BaseException:
            for w in workers:
                ray.kill(w, no_restart=True)
            raise
        group = cls(resolved, workers, names, infos, replica)
        logger.info(
            "TP group %s up: %d rank(s) on %s (%s), rendezvous %s:%d, shards loaded in %.1f s",
            tag, spec.tp_size, ", ".join(i["device"] for i in infos), infos[0]["backend"], addr, port,
            max(i["load_s"] for i in infos),
        )
        return group

    # -- calls ----------------------------------------------------------------------------

    def _submit(self, method: str, *args: Any) -> list:
        # Every rank gets the same call in the same order (the asyncio lock already serialises
        # group calls; this also keeps a thread from interleaving its submissions).
        with self._submit_lock:
            return [getattr(w, method).remote(*args) for w in self.workers]

    def _break(self, reason: str) -> str:
        if self.broken is None:
            self.broken = reason
            logger.error("TP group %s is broken: %s", self.resolved.spec.name, reason)
        return self.broken

    def mark_broken(self, reason: str) -> None:
        self._break(reason)

    async def hold(self, wait_s: float) -> bool:
        """Take the group's call lock for a lane lease (``serve.lanes``), waiting up to
        ``wait_s``: no Serve forward, health collective or warm-up runs until :meth:`unhold`."""
        if wait_s <= 0:
            if self._lock.locked():
                return False
            await self._lock.acquire()  # free: returns at once
        else:
            try:
                await asyncio.wait_for(self._lock.acquire(), wait_s)
            except TimeoutError:
                return False
        if self.broken is not None:
            self._lock.release()
            self.check_usable()
        return True

    def unhold(self) -> None:
        self._lock.release()

    async def drop_graph(self) -> None:
        """Tear the replica's own compiled graph down (held: nothing runs on it); the next
        forward compiles it again. An idle graph's loops poll their channels and burn a core per
        rank, so a leased group must not keep it beside the lane's."""
        dag, self._dag, self.transport = self._dag, None, None
        if dag is not None:
            with contextlib.suppress(Exception):  # ranks gone: the group is broken anyway
                await asyncio.to_thread(dag.teardown)

    async def _drop_graph_when_idle(self, dag: Any) -> None:
        """Tear ``dag`` down once no forward has started for ``graph_idle_s`` (under the call
        lock, so never under a running forward); ends when the graph goes another way."""
        idle_s = self.bounds.graph_idle_s
        while self._dag is dag:
            wait_s = self.last_forward + idle_s - time.monotonic()
            if wait_s > 0 or self._lock.locked():  # recent, or a forward or a lease holds the group
                await asyncio.sleep(max(wait_s, idle_s / 4))
                continue
            async with self._lock:
                if self._dag is dag and time.monotonic() - self.last_forward >= idle_s:
                    await self.drop_graph()
                    self.graph_drops += 1

    def check_usable(self) -> None:
        if self.broken is not None:
            raise GroupUnavailableError(
                f"the TP group of deployment {self.resolved.spec.name!r} is broken ({self.broken}); "
                "the replica is unhealthy and Serve is replacing it, retry shortly", self.replica
            )

    async def _gather(self, refs: list, what: str, timeout_s: float) -> list:
        async def one(rank: int, ref):
            try:
                return await ref
            except Exception as e:
                raise _RankFailure(rank, e) from None

        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(r, ref) for r, ref in enumerate(refs))), timeout_s
            )
        except TimeoutError:
            reason = self._break(
                f"{what} did not finish within {timeout_s:.0f} s (collective timeout "
                f"{self.resolved.spec.collective_timeout_s:.0f} s + margin)"
            )
            raise GroupTimeoutError(f"TP group timed out: {reason}", self.replica) from None
        except _RankFailure as f:
            died = actor_died(f.error)
            reason = self._break(
                f"rank {f.rank} {'died' if died else 'failed'} during {what}: {error_message(f.error)}"
            )
            raise GroupUnavailableError(f"TP group failed: {reason}", self.replica) from None

    def _compile_forward(self) -> None:
        """The replica -> ranks forward hop as a Ray Compiled Graph (shared-memory channels
        instead of a task submission per rank and call); actor calls when it cannot be built.
        Other calls (health all-reduce, warm-up timing) stay plain actor calls: the lock keeps
        them from overlapping a forward on the ranks."""
        wanted = self.resolved.spec.compiled_graph
        if wanted is False:
            self.transport = "actor calls (compiled_graph is off)"
        elif wanted is None and self.world == 1:
            self.transport = "actor calls (auto: TP 1, where the compiled graph measured slower)"
        else:
            try:
                from ray.dag import InputNode, MultiOutputNode

                with InputNode() as inp:
                    dag = MultiOutputNode([w.forward.bind(inp[0], inp[1], inp[2]) for w in self.workers])
                self._dag = dag.experimental_compile(enable_asyncio=True)
                self.transport = "compiled graph"
                # held here: the event loop keeps only a weak reference to a task
                self._idle_watch = asyncio.ensure_future(self._drop_graph_when_idle(self._dag))
            except Exception as e:  # e.g. an older Ray, or channels not available here
                self.transport = f"actor calls (compiled graph unavailable: {error_message(e)})"
        if self.transport != self._logged_transport:  # once, not at every recompile after idleness
            self._logged_transport = self.transport
            idle = f" (torn down after {self.bounds.graph_idle_s:g} s idle)" if self._dag is not None else ""
            logger.info("TP group %s: forwards reach the ranks by %s%s", self.resolved.spec.name,
                        self.transport, idle)

    async def _gather_compiled(self, args: tuple, what: str, timeout_s: float) -> list:
        async def run() -> list:
            futures = await self._dag.execute_async(*args)
            if isinstance(futures, list):
                return list(await asyncio.gather(*futures))
            return list(await futures)

        # A dead rank does not fail the graph's read (the others wait in their collective), so
        # a forward that outlives LIVENESS_POLL_S checks on the ranks while it waits.
        task = asyncio.ensure_future(run())
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                wait_s = min(LIVENESS_POLL_S, deadline - time.monotonic())
                done, _ = await asyncio.wait({task}, timeout=wait_s)
                if done:
                    results = task.result()
                    break
                dead = await self._dead_ranks()
                if dead:
                    reason = self._break(f"rank {dead[0]} died during {what} (compiled graph)")
                    raise GroupUnavailableError(f"TP group failed: {reason}", self.replica)
                if time.monotonic() >= deadline:
                    reason = self._break(f"{what} did not finish within {timeout_s:.0f} s (compiled graph)")
                    raise GroupTimeoutError(f"TP group timed out: {reason}", self.replica)
        except GroupUnavailableError:
            task.cancel()
            raise
        except Exception as e:
            dead = await self._dead_ranks()
            if dead:  # the cause; the graph's own error then says little (Ray 2.60 may even fail
                # reading the broken channel with "'RayChannelError' object is not iterable")
                reason = self._break(f"rank {dead[0]} died during {what} (compiled graph)")
            else:
                reason = self._break(f"a rank failed during {what} (compiled graph): {error_message(e)}")
            raise GroupUnavailableError(f"TP group failed: {reason}", self.replica) from None
        return copy_graph_outputs(results)

    async def _dead_ranks(self) -> list[int]:
        """Ranks whose actor died (the graph's error does not say which)."""
        return await dead_actors_async(self.workers)

    async def _locked_call(self, method: str, args: tuple, what: str, timeout_s: float) -> list:
        async with self._lock:
            self.check_usable()
            notify = method == "forward"
            if notify:
                for listener in self.busy_listeners:
                    listener(True)
            try:
                if notify:
                    # Under the lock: a compile never overlaps a graph's teardown (idle drop,
                    # lease) or a lease's own graph on these ranks.
                    if self.transport is None:
                        self._compile_forward()
                    if self._dag is not None:
                        return await self._gather_compiled(args, what, timeout_s)
                    args = self._put_large(args)
                return await self._gather(self._submit(method, *args), what, timeout_s)
            finally:
                if notify:
                    for listener in self.busy_listeners:
                        listener(False)

    def _put_large(self, args: tuple) -> tuple:
        """A forward's tensors for actor calls: into the object store once rather than serialised
        for every rank; small batches (decode) travel inline, cheaper than a put and a fetch."""
        layer, x_w, logits_w = args
        if self.world == 1 or x_w.array.nbytes <= INLINE_BYTES:
            return args
        return layer, ray.put(x_w), None if logits_w is None else ray.put(logits_w)

    async def _shielded(self, method: str, args: tuple, what: str, timeout_s: float) -> list:
        # A cancelled caller must not release the lock while its call still runs on the ranks.
        task = asyncio.ensure_future(self._locked_call(method, args, what, timeout_s))
        return await asyncio.shield(task)

    async def forward(
        self, layer: int, x_TH: WireTensor, router_logits_TE: np.ndarray | None
    ) -> tuple[WireTensor, str]:
        """``out [T, H]`` of ``layer`` (fp32 ``router_logits_TE`` or None) and the tail that ran."""
        T = x_TH.shape[0]
        self.last_forward = time.monotonic()
        logits_w = None if router_logits_TE is None else WireTensor(router_logits_TE, "float32")
        results = await self._shielded(
            "forward", (layer, x_TH, logits_w), f"the layer {layer} forward of {T} tokens", self.bounds.call_s
        )
        return join_rank_outputs(results)

    async def health_check(self) -> None:
        """Every worker alive and the group able to run a collective; raises otherwise.

        While a forward holds the group, that forward is itself the proof (and fails on its
        own, within its bound, if a rank is gone), so the probe only checks the broken flag.
        """
        self.check_usable()
        if self._lock.locked():
            return
        await self._shielded(
            "barrier", (), "the health all-reduce", self.bounds.health_s
        )

    def shutdown(self) -> None:
        if self._dag is not None:
            with contextlib.suppress(Exception):  # ranks already gone
                self._dag.teardown(kill_actors=True)
            self._dag = None
        for w in self.workers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(w, no_restart=True)
        self.workers = []


def tune_group(
    workers: Sequence[Any], decision: Decision, replica: str, clock: Clock = time.time
) -> TailDecision:
    """Replica side: settle a pending ``auto`` tail on the group's workers (``TPWorker`` handles,
    rank-ordered) and return the settled tail decision (unchanged when nothing is pending).

    A plan stored under the same key (``control.warmup``) is reused unless the spec asks to
    remeasure. Otherwise each token count is timed in turn (every rank at once), with a log line
    and a progress record (``status()`` of the ingress: ``warmup``) per finished count; once
    ``warmup_limit_s`` has passed the remaining counts are left to the rule-based tail. The
    measured plan is stored for every later replica with the same key.
    """
    tail, spec = decision.tail, decision.spec
    if not tail.pending:
        return tail

    settings = tail.measure
    fields = plan_key_fields(decision.resolved, decision.accelerator, tail.candidates,
                             settings.token_counts, settings.reps, settings.clock)
    key = kv.PLAN_PREFIX + plan_key(fields)
    progress_key = kv.progress_key(spec.name, replica)
    # Who the record belongs to: Serve names its replica actors in its own namespace.
    owner = {"actor": ray.get_runtime_context().get_actor_name(), "namespace": SERVE_NAMESPACE}
    kv.live_progress()  # records of replicas that ended without deleting theirs go
    timeout_s = spec.bounds.warmup_s
    stored = None if spec.remeasure_tail else kv.get_json(key)
    if stored is not None:
        plan = TailPlan.from_dict(stored["plan"])
        ray.get([w.set_plan.remote(plan) for w in workers], timeout=timeout_s)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(stored["measured_at"]))
        log_once(f"warm-up: deployment {spec.name!r} reuses the tail plan measured at {when} UTC "
                 f"(key {key}): {plan.describe()}", logger)
        kv.put_json(progress_key, {"deployment": spec.name, "replica": replica, "state": REUSED,
                                   "key": key, "measured_at": stored["measured_at"], **owner})
        return tail.with_measurement(plan, REUSED, stored["measured_at"])

    counts = list(settings.token_counts)
    estimate = f"~{tail.estimate_s:.0f} s by the planner's estimate" if tail.estimate_s is not None else \
        "no estimate (memory not planned)"
    logger.info("warm-up: deployment %r replica %s measures tails %s at T = %s, %d reps each: %s "
                "(limit warmup_limit_s = %.0f s)", spec.name, replica, list(tail.candidates), counts,
                settings.reps, estimate, spec.warmup_limit_s)
    start = clock()
    timings: Timings = {t: {} for t in tail.candidates}
    done: list[int] = []
    for T in counts:
        if done and clock() - start > spec.warmup_limit_s:
            break
        one = replace(settings, token_counts=(T,))
        refs = [w.measure_tails.remote(one, list(tail.candidates)) for w in workers]
        rank0 = ray.get(refs, timeout=timeout_s)[0]  # rank 0's: every rank must adopt one plan
        for t, per in rank0.items():
            timings[t].update(per)
        done.append(T)
        elapsed = clock() - start
        left = _remaining_estimate(elapsed, done, counts)
        logger.info("warm-up: deployment %r: T = %d measured (%d/%d) in %.1f s total, ~%.0f s left: %s",
                    spec.name, T, len(done), len(counts), elapsed, left,
                    ", ".join(f"{t} {per[T]:.2f} ms" for t, per in rank0.items()))
        kv.put_json(progress_key, {"deployment": spec.name, "replica": replica, "state": "measuring", **owner,
                                   "measured_tokens": done, "token_counts": counts,
                                   "elapsed_s": round(elapsed, 1),
                                   "remaining_s": round(left, 1), "estimate_s": tail.estimate_s})
    unmeasured = [T for T in counts if T not in done]
    plan = measured_plan(tail, timings, unmeasured)
    ray.get([w.set_plan.remote(plan) for w in workers], timeout=timeout_s)
    now = time.time()
    kv.put_json(key, {"plan": plan.to_dict(), "measured_at": now, "fields": fields})
    kv.put_json(progress_key, {"deployment": spec.name, "replica": replica, "state": MEASURED, **owner,
                               "key": key,
                               "measured_tokens": done, "elapsed_s": round(clock() - start, 1)})
    log_once(f"warm-up: deployment {spec.name!r}: tail {plan.describe()} ({plan.reason}); "
             f"stored as {key}", logger)
    return tail.with_measurement(plan, MEASURED, now)


def _remaining_estimate(elapsed: float, done: Sequence[int], counts: Sequence[int]) -> float:
    """Seconds left if time grows with tokens as it did so far (measured counts' tokens -> time)."""
    left = [T for T in counts if T not in done]
    return elapsed * sum(left) / max(1, sum(done))
