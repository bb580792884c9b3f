"""An engine that runs out of requests tells its elastic session at once.

vLLM steps an engine only while it has requests: after the last one the model simply stops
calling the tier, and the session's other engines would wait ``idle_after_s`` at their next step's
start before going on without it. :class:`TierScheduler` is vLLM's scheduler (its ``scheduler_cls``
seam, outside the model's forward) that notices the moment its unfinished requests reach 0 and
tells the engine's peer: the worker of TP rank 0, in this process or another, listening on a local
datagram socket named after its session and peer index. The peer sends ``IDLE`` to its groups
between two calls (``dataplane.Peer.idle``), and rank 0 parks it at once (``dataplane.steps``)::

    LLM(..., scheduler_cls="deployments.vllm_plugin.idle.TierScheduler")
    vllm serve ... --scheduler-cls deployments.vllm_plugin.idle.TierScheduler

(:class:`TierAsyncScheduler` where vLLM schedules asynchronously: on GPUs, not on CPUs.) A late
notice (a request came meanwhile) changes nothing: rank 0 ignores it once the peer stepped again.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ..dataplane.peer import SessionTicket
from .settings import TierSettings

log = logging.getLogger(__name__)


def address(ticket: SessionTicket, peer: int) -> bytes:
    """The local (abstract, Linux) datagram address of ``peer``'s idle notices: named after the
    session's secrets, so only its engine's scheduler finds it."""
    secrets = "/".join([ticket.name, ticket.secret, *(g.secret for g in ticket.groups)])
    return f"\0latent-moe-idle/{hashlib.sha256(secrets.encode()).hexdigest()[:32]}/{peer}".encode()


def engine_peer(vllm_config: Any, settings: TierSettings) -> int:
    """The engine's peer index: the setting, else its data-parallel rank."""
    return settings.peer if settings.peer is not None else vllm_config.parallel_config.data_parallel_rank


class IdleListener:
    """The peer's side: calls ``on_idle`` for every notice, on a thread of its own (the peer's
    ``idle`` sends nothing while a call is in flight)."""

    def __init__(self, where: bytes, on_idle: Callable[[], Any]):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(where)
        self.on_idle = on_idle
        threading.Thread(target=self._serve, name="latent-moe-idle", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                self.sock.recv(16)
            except OSError:  # the socket is gone: no more notices
                return
            try:
                self.on_idle()
            except Exception:  # one lost notice must not stop the ones after it
                log.exception("latent-MoE tier: an idle notice could not be passed on")


class TellsIdle:
    """The scheduler's side, mixed into vLLM's scheduler classes below."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        config = self.vllm_config
        settings = TierSettings.parse(config.additional_config)
        self.latent_moe_busy = self.latent_moe_warned = False
        self.latent_moe_idle = None  # where the engine's peer listens (None: in-process tier)
        if settings.ticket is not None:
            self.latent_moe_idle = address(settings.ticket, engine_peer(config, settings))
            self.latent_moe_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        self.latent_moe_busy = True

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().update_from_output(*args, **kwargs)
        self.latent_moe_tell_idle()
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        finished = super().finish_requests(*args, **kwargs)
        self.latent_moe_tell_idle()
        return finished

    def latent_moe_tell_idle(self) -> None:
        if not self.latent_moe_busy or self.get_num_unfinished_requests():
            return
        self.latent_moe_busy = False
        if self.latent_moe_idle is not None:
            try:
                self.latent_moe_sock.sendto(b"idle", self.latent_moe_idle)
            except OSError as e:  # no listener on this node (rank 0's worker elsewhere, or gone)
                if not self.latent_moe_warned:
                    self.latent_moe_warned = True
                    log.warning("latent-MoE tier: the engine's idle notice found no peer listening on this "
                                "node (%s); the session's other engines wait idle_after_s for it", e)


class TierScheduler(TellsIdle, Scheduler):
    """vLLM's scheduler, telling the engine's elastic session when its requests run out."""


class TierAsyncScheduler(TellsIdle, AsyncScheduler):
    """vLLM's asynchronous scheduler, telling the engine's elastic session when its requests run out."""


def tells_idle(vllm_config: Any) -> bool:
    """Whether the engine's scheduler is one of the above."""
    return issubclass(vllm_config.scheduler_config.get_scheduler_cls(), TellsIdle)
