"""The replica's side of its TP group: start the workers, forward batches, health.

:class:`TPGroup` starts the ranks and their data plane (``deployments.dataplane``: rank 0 hosts
sessions, the other ranks follow its batches) and sends its own batches as the one peer of a
session of its own: rank 0 runs each on every rank and answers the group's output (sequence
parallel: every rank's rows, in order). Every call is bounded (the group's call bound) and the
first failure marks the group broken, so the replica turns unhealthy and Serve replaces it.
The warm-up measurement of a pending ``auto`` tail on the group is ``serve.tuning``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .. import logger
from ..cluster.liveness import dead_actors
from ..common.errors import (
    GroupTimeoutError,
    GroupUnavailableError,
    actor_died,
    error_message,
)
from ..common.wire import WireTensor
from ..common.workers import WORKER_NAMESPACE, worker_name
from ..config.resolve import ResolvedDeployment
from ..control.accelerator import Accelerator
from ..control.serve_options import worker_resources
from ..dataplane.errors import Action, Failure, SessionError
from ..dataplane.frames import new_secret
from ..dataplane.peer import GroupEndpoint, SessionPeer, SessionTicket
from .worker import TPWorker

# The replica's own session takes any batch it sends (it checked the batch against its live spec).
OWN_SESSION_TOKENS = 2**31 - 1


class _RankFailure(Exception):
    def __init__(self, rank: int, error: BaseException):
        super().__init__(rank, error)
        self.rank, self.error = rank, error


class TPGroup:
    """The replica's handle on its workers: start, forward, health collective, shutdown."""

    def __init__(self, resolved: ResolvedDeployment, workers: list, names: list[str], infos: list[dict],
                 replica: str, peer: SessionPeer):
        self.resolved, self.replica = resolved, replica
        self.workers, self.names, self.infos = workers, names, infos
        self.world = resolved.spec.tp_size
        self.bounds = resolved.spec.bounds
        self.broken: str | None = None
        self._lock = asyncio.Lock()  # one group call at a time: every rank sees the same order
        self._submit_lock = threading.Lock()
        # Called with True when a forward starts running on the ranks, False when it ends.
        self.busy_listeners: list[Callable[[bool], None]] = []
        self.peer = peer  # this replica as the one peer of its own data-plane session
        g = peer.ticket.groups[0]
        self.transport = f"data plane (session {g.session} on rank 0 at {g.host}:{g.port})"

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
        actor_cls = ray.remote(TPWorker)
        resources = worker_resources(spec, accelerator.layout)
        workers, names = [], []
        for rank in range(spec.tp_size):
            name = worker_name(spec.name, replica, rank)
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
            peer = start_dataplane(workers, resolved, tag, infos[0]["hidden_size"], startup_timeout_s)
        except BaseException:
            for w in workers:
                ray.kill(w, no_restart=True)
            raise
        group = cls(resolved, workers, names, infos, replica, peer)
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

    async def _locked_call(self, method: str, args: tuple, what: str, timeout_s: float) -> list:
        async with self._lock:
            self.check_usable()
            if method != "forward":
                return await self._gather(self._submit(method, *args), what, timeout_s)
            for listener in self.busy_listeners:
                listener(True)
            try:
                return [await asyncio.to_thread(self._forward, *args, what)]
            finally:
                for listener in self.busy_listeners:
                    listener(False)

    def _forward(self, layer: int, x_TH: WireTensor, logits: np.ndarray | None, what: str
                 ) -> tuple[WireTensor, str]:
        """One batch through this replica's own session (its thread: the peer's wait blocks)."""
        try:
            return self.peer.forward(x_TH, layer, logits)
        except SessionError as e:
            if e.action is Action.CALLER_ERROR:  # the replica checked it first: not expected
                raise e.input_error() from None
            dead = dead_actors(self.workers)  # the cause, where a rank died: rank 0 saw only its effect
            cause = f"rank {dead[0]} died during {what}" if dead else f"{what} failed"
            reason = self._break(f"{cause} ({e.failure.value}: {e})")
            error = GroupTimeoutError if e.failure is Failure.GROUP_TIMEOUT else GroupUnavailableError
            raise error(f"TP group failed: {reason}", self.replica) from None

    async def _shielded(self, method: str, args: tuple, what: str, timeout_s: float) -> list:
        # A cancelled caller must not release the lock while its call still runs on the ranks.
        task = asyncio.ensure_future(self._locked_call(method, args, what, timeout_s))
        return await asyncio.shield(task)

    async def forward(
        self, layer: int, x_TH: WireTensor, router_logits_TE: np.ndarray | None
    ) -> tuple[WireTensor, str]:
        """``out [T, H]`` of ``layer`` (fp32 ``router_logits_TE`` or None) and the tail that ran."""
        T = x_TH.shape[0]
        (out,) = await self._shielded(
            "forward", (layer, x_TH, router_logits_TE), f"the layer {layer} forward of {T} tokens",
            self.bounds.call_s,
        )
        return out

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
        self.peer.close("the replica is shutting down")
        for w in self.workers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(w, no_restart=True)
        self.workers = []


def start_dataplane(workers: Sequence[Any], resolved: ResolvedDeployment, tag: str, hidden_size: int,
                    timeout_s: float) -> SessionPeer:
    """Rank 0 listens, the other ranks link to it (a fresh group secret), and the replica joins a
    session of its own as its one peer (rows per layer: any the replica sends; it checked them)."""
    secret = new_secret()
    address = ray.get(workers[0].dataplane_listen.remote(secret), timeout=timeout_s)
    ray.get([w.dataplane_link.remote(address, secret) for w in workers[1:]], timeout=timeout_s)
    ray.get(workers[0].dataplane_ready.remote(timeout_s), timeout=timeout_s + 1)
    spec = resolved.spec
    own = ray.get(workers[0].session_open.remote(1, OWN_SESSION_TOKENS, f"{tag}:serve"), timeout=timeout_s)
    group = GroupEndpoint(spec.name, tag, "", own["host"], own["port"], own["secret"], own["session"],
                          tuple(resolved.layers), hidden_size, spec.dtype, spec.bounds.call_s,
                          OWN_SESSION_TOKENS, own["store_port"], own["channel"])
    return SessionTicket(f"{tag}:serve", 1, (group,)).join(0)
