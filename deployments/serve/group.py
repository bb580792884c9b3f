"""The replica's side of its TP group: start the workers, forward batches, health, events.

:class:`TPGroup` starts the ranks and their data plane (``deployments.dataplane``: rank 0 hosts
sessions, the other ranks follow its batches) and sends its own batches as the one peer of a
session of its own: rank 0 runs each on every rank (together with other sessions' rows of the
same layer) and answers the group's output (sequence parallel: every rank's rows, in order).
Nothing holds the group: clients' sessions run beside the Serve path. Every call is bounded (the
group's call bound) and the first failure marks the group broken, so the replica turns unhealthy
and Serve replaces it. Health asks each rank about its data plane (rank 0's heartbeats find a
dead or stopped rank with no layer in flight), never a collective, so it never waits on sessions.
The replica hears rank 0's session and group events on a watch connection (:class:`Watcher`):
pushed when they happen, nothing while idle. The warm-up measurement of a pending ``auto`` tail
on the group is ``serve.tuning``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
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
from ..config.timeouts import PROBE_S
from ..control.accelerator import Accelerator
from ..control.serve_options import worker_resources
from ..dataplane import frames
from ..dataplane.errors import Action, Failure, SessionError
from ..dataplane.frames import Kind, Role, new_secret
from ..dataplane.peer import GroupEndpoint, Peer, SessionTicket
from .worker import CONCURRENCY_GROUPS, TPWorker

# The replica's own session takes any batch it sends (it checked the batch against its live spec).
OWN_SESSION_TOKENS = 2**31 - 1


class _RankFailure(Exception):
    def __init__(self, rank: int, error: BaseException):
        super().__init__(rank, error)
        self.rank, self.error = rank, error


class TPGroup:
    """The replica's handle on its workers: start, forward, health collective, shutdown."""

    def __init__(self, resolved: ResolvedDeployment, workers: list, names: list[str], infos: list[dict],
                 replica: str, peer: Peer, group_secret: str):
        self.resolved, self.replica = resolved, replica
        self.workers, self.names, self.infos = workers, names, infos
        self.world = resolved.spec.tp_size
        self.bounds = resolved.spec.bounds
        self.broken: str | None = None
        self._lock = asyncio.Lock()  # the replica's own peer sends one batch at a time
        self._submit_lock = threading.Lock()
        # Called with True when a forward starts running on the ranks, False when it ends.
        self.busy_listeners: list[Callable[[bool], None]] = []
        self.peer = peer  # this replica as the one peer of its own data-plane session
        g = peer.ticket.groups[0]
        self.transport = f"data plane (session {g.session} on rank 0 at {g.host}:{g.port})"
        self.address, self.group_secret = (g.host, g.port), group_secret
        self.watcher: Watcher | None = None

    def watch(self, on_event: Callable[[dict[str, Any]], None]) -> None:
        """Hear rank 0's events (``dataplane.host``) from now on: ``on_event`` runs on the calling
        event loop; a group failure, or the watch connection closing, also breaks the group."""
        loop = asyncio.get_running_loop()

        def deliver(event: dict[str, Any]) -> None:
            if event["event"] == "failed":
                self._break(f"{event.get('cause', '')}{event['failure']}: {event['reason']}")
            elif event["event"] == "closed":
                if not self.workers:  # shutting down: not a failure
                    return
                self._break(f"{event.get('cause', '')}rank 0's data plane closed the replica's watch "
                            f"connection ({event['reason']})")
            on_event(event)

        def hand_over(event: dict[str, Any]) -> None:  # on the watcher's thread: it may block
            if event["event"] in ("failed", "closed") and self.workers:
                dead = dead_actors(self.workers)  # the cause, where a rank died: rank 0 saw its effect
                if dead:
                    event["cause"] = f"rank {dead[0]} died ({'; '.join(f'rank {r}' for r in dead)} dead): "
            loop.call_soon_threadsafe(deliver, event)

        self.watcher = Watcher(self.address, self.group_secret, self.bounds.startup_s, hand_over)

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
        actor_cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(TPWorker)
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
            peer, secret = start_dataplane(workers, resolved, tag, infos[0]["hidden_size"], startup_timeout_s)
        except BaseException:
            for w in workers:
                ray.kill(w, no_restart=True)
            raise
        group = cls(resolved, workers, names, infos, replica, peer, secret)
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
            return self.peer.forward_wire(x_TH, layer, logits)
        except SessionError as e:
            if e.action is Action.CALLER_ERROR:  # the replica checked it first: not expected
                raise e.input_error() from None
            dead = dead_actors(self.workers)  # the cause, where a rank died: rank 0 saw only its effect
            cause = f"rank {dead[0]} died during {what}" if dead else f"{what} failed"
            reason = self._break(f"{cause} ({e.failure.value}: {e.message})")
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
        """Every worker alive and its data plane sound; raises otherwise. No collective and no
        lock: it never waits on a forward or a session. Rank 0's heartbeats find a dead or stopped
        rank with no layer in flight; a forward running past the call bound is a stuck group."""
        self.check_usable()
        refs = [w.dataplane_health.remote() for w in self.workers]
        states = await self._gather(refs, "the health check", self.bounds.health_s)
        failed = next((st for st in states if st["failed"]), None)
        if failed is not None:
            self._break(f"rank {failed['rank']}: {failed['failed']}")
        running = states[0]["forward_running_s"]
        if running is not None and running > self.bounds.call_s:
            self._break(f"rank 0's forward has run {running:.0f} s, past the call bound "
                        f"{self.bounds.call_s:.0f} s")
        self.check_usable()

    def shutdown(self) -> None:
        workers, self.workers = self.workers, []
        if workers and self.broken is None:
            with contextlib.suppress(Exception):  # rank 0 gone or stuck: its peers find out themselves
                ray.get(workers[0].dataplane_stop.remote(f"replica {self.replica} is stopping"),
                        timeout=PROBE_S)
        if self.watcher is not None:
            self.watcher.close()
        self.peer.close("the replica is shutting down")
        for w in workers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(w, no_restart=True)


class Watcher:
    """The replica's watch connection to rank 0 (``frames.Role.WATCH``): a thread blocked on it
    hands each event to ``deliver`` (``{"event": "closed"}`` when the connection ends)."""

    def __init__(self, address: tuple[str, int], group_secret: str, timeout_s: float,
                 deliver: Callable[[dict[str, Any]], None]):
        self.deliver, self.closing = deliver, False
        self.sock = frames.connect(address, group_secret, Role.WATCH, 0, timeout_s)
        self.thread = threading.Thread(target=self._read, name="dataplane-watch", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                frame = frames.recv(self.sock)
            except (frames.ConnectionLost, OSError) as e:
                if not self.closing:
                    self.deliver({"event": "closed", "reason": str(e)})
                return
            if frame.kind is Kind.EVENT:
                self.deliver(json.loads(frame.text))

    def close(self) -> None:
        self.closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def start_dataplane(workers: Sequence[Any], resolved: ResolvedDeployment, tag: str, hidden_size: int,
                    timeout_s: float) -> tuple[Peer, str]:
    """Rank 0 listens, the other ranks link to it (a fresh group secret), and the replica joins a
    session of its own as its one peer (rows per layer: any the replica sends; it checked them).
    The peer, and the group's secret (the replica's watch connection is admitted by it)."""
    secret = new_secret()
    address = ray.get(workers[0].dataplane_listen.remote(secret), timeout=timeout_s)
    ray.get([w.dataplane_link.remote(address, secret) for w in workers[1:]], timeout=timeout_s)
    ray.get(workers[0].dataplane_ready.remote(timeout_s), timeout=timeout_s + 1)
    spec = resolved.spec
    own = ray.get(workers[0].session_open.remote(1, OWN_SESSION_TOKENS, f"{tag}:serve"), timeout=timeout_s)
    group = GroupEndpoint(spec.name, tag, "", own["host"], own["port"], own["secret"], own["session"],
                          tuple(resolved.layers), hidden_size, spec.dtype, spec.bounds.call_s,
                          OWN_SESSION_TOKENS, own["store_port"], own["channel"])
    return SessionTicket(f"{tag}:serve", 1, (group,)).join(0), secret
