"""The TP-group deployment (DESIGN §5.2): one replica = one TP group serving MoE layers.

Handle API: ``forward(hidden_states, layer, router_logits=None)`` and ``status()``.

Input kinds: a torch tensor must already have the deployment's dtype (so must a
:class:`~deployments.common.wire.WireTensor`, the faster internal form the clients send). A numpy
array must be float32 (numpy has no bfloat16): a float32 deployment takes it as is, a bfloat16
deployment rounds it to bfloat16 on the replica (round-to-nearest-even, as ``torch.Tensor.to`` does).
The output comes back in the kind that came in: a torch tensor in the deployment dtype, or a
float32 numpy array (bfloat16 results widened exactly). Router logits may be any floating
dtype (the router works in fp32). The replica checks, batches and splits rows with numpy and
never loads torch itself (its ranks compute): a caller's torch tensor loads it on arrival.

Batching: concurrent requests for the same layer wait in that layer's queue (``@serve.batch``
with a token-counting ``batch_size_fn``) for up to ``batch_wait_timeout_s`` and run as one
forward of at most ``max_batch_tokens`` tokens; each caller gets exactly its rows back.
Requests that arrive while the TP group is busy wait at an admission gate and are released
together when it frees up (continuous batching), so they fill the next batch instead of
trickling into small ones. A request larger than ``max_batch_tokens`` (but within
``max_tokens_per_request``) runs alone. Layers never share a forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from ray import serve

from moe_runtime.families import load_layer_config
from moe_runtime.units import format_layers

from .. import logger
from ..cluster import kv
from ..common.errors import GroupUnavailableError, ServeInputError, error_message, http_status
from ..common.requests import is_torch_tensor, validate_forward
from ..common.wire import WireTensor, concat_rows
from ..config.spec import DeploymentSpec, with_batching
from ..control.autoscaling import OPEN_SESSIONS, QUEUED_TOKENS, TOKENS_PER_S
from ..control.decide import Decision
from .group import TPGroup
from .metrics import ReplicaStats
from .sessions import GroupSessions
from .tuning import tune_group


@dataclass
class LayerRequest:
    """One validated request, ready to be merged into a batch."""

    layer: int
    x_TH: WireTensor  # deployment dtype
    router_logits_TE: np.ndarray | None  # float32
    kind: str  # what came in and goes back out: "torch", "numpy" or "wire" (WireTensor)

    @property
    def tokens(self) -> int:
        return self.x_TH.shape[0]


def count_tokens(requests: list[LayerRequest]) -> int:
    """``batch_size_fn`` of the layer queues: a batch's size is its token count."""
    return sum(r.tokens for r in requests)


def check_planned_tokens(spec: DeploymentSpec, decision: Decision) -> None:
    """A live batching change must stay within the forward size the memory planner sized the
    deployment for at build time (ValueError with the numbers otherwise; lowering is free)."""
    plan = decision.memory
    if plan is not None and spec.max_forward_tokens > plan.workspace.tokens:
        raise ValueError(
            f"user_config of deployment {spec.name!r}: forwards of up to {spec.max_forward_tokens} tokens "
            f"(max of max_batch_tokens {spec.max_batch_tokens}, max_tokens_per_request "
            f"{spec.max_tokens_per_request}) exceed the {plan.workspace.tokens} tokens whose activations "
            "the memory planner budgeted at build time; redeploy with the new limits so it checks them"
        )


class _TokenBudgetWarningFilter(logging.Filter):
    """``@serve.batch`` warns when ``max_batch_size`` exceeds ``max_ongoing_requests``, as if
    both counted requests; here ``max_batch_size`` counts tokens, so the warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is larger than `max_ongoing_requests`" not in record.getMessage()


def install_token_budget_filter() -> None:
    """Once per process (a replica process may host replicas one after another)."""
    serve_logger = logging.getLogger("ray.serve")
    if not any(isinstance(f, _TokenBudgetWarningFilter) for f in serve_logger.filters):
        serve_logger.addFilter(_TokenBudgetWarningFilter())


class MoEGroupDeployment:
    """One replica: a TP group of ``tp_size`` workers serving the deployment's layers."""

    def __init__(self, decision: Decision):
        """``decision``: the controller's, made at build time; a pending ``auto`` tail is
        measured on this replica's group now (warm-up)."""
        resolved = decision.resolved
        spec = resolved.spec
        self.resolved, self.spec = resolved, spec
        self.cfg = load_layer_config(resolved.checkpoint)
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id if ctx is not None else "local"
        self.group = TPGroup.start(resolved, decision.accelerator, self.replica)
        try:
            tail = tune_group(self.group.workers, decision, self.replica)
        except BaseException:
            self.group.shutdown()
            raise
        # The build-time decision with this replica's tail (measured when auto): status() reports it.
        self.decision = decision.with_tail(tail)
        self.plan = tail.plan
        self.stats = ReplicaStats()
        self.stats.decision(self.plan)
        install_token_budget_filter()
        self._queues = {layer: self._layer_queue(layer) for layer in resolved.layers}
        # Admission gate of the batch queues: open while the group is idle (see forward()).
        self._group_idle = asyncio.Event()
        self._group_idle.set()
        self.group.busy_listeners.append(self._on_group_busy)
        self._in_flight = 0  # requests admitted and not yet answered, every layer
        self.sessions = GroupSessions(self.group, lambda: self.spec, self.stats, self.replica)
        self._watching = False
        logger.info(
            "replica %s of deployment %r: TP %d, layers %s, tail %s (%s); %s",
            self.replica, spec.name, spec.tp_size, format_layers(resolved.layers), self.plan.describe(),
            self.plan.reason, self._batching(),
        )

    def _batching(self) -> str:
        s = self.spec
        return (f"max_batch_tokens {s.max_batch_tokens}, max_tokens_per_request {s.max_tokens_per_request}, "
                f"batch wait {s.batch_wait_timeout_s:.3f} s (none for a lone request on an idle group)")

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's ``user_config`` hook: apply new batching knobs (``spec.BATCHING_KNOBS``) to the
        running replica -- no restart, no reload; a bad value raises ``ValueError``. Done once
        the ranks hold the new ``max_tokens_per_request`` too (rank 0 checks sessions' rows with it,
        and shares forwards among sessions within the largest forward)."""
        spec = with_batching(self.spec, user_config)
        if spec == self.spec:
            return
        check_planned_tokens(spec, self.decision)
        pushes = [w.set_limits.remote(spec.max_tokens_per_request, spec.max_forward_tokens)
                  for w in self.group.workers]
        try:
            await asyncio.wait_for(asyncio.gather(*pushes), spec.bounds.call_s)
        except Exception as e:  # a rank that does not answer within a call's bound is broken
            logger.warning("replica %s of deployment %r: a rank did not take max_tokens_per_request "
                           "%d within %.0f s (%s); its health check decides", self.replica, spec.name,
                           spec.max_tokens_per_request, spec.bounds.call_s, error_message(e))
        # Only now: status() reporting the new limit means the ranks (which check sessions' rows) hold it.
        self.spec = spec
        for queue in self._queues.values():
            queue.set_max_batch_size(spec.max_batch_tokens)
            queue.set_batch_wait_timeout_s(spec.batch_wait_timeout_s)
        logger.info("replica %s of deployment %r reconfigured: %s", self.replica, spec.name, self._batching())

    def _layer_queue(self, layer: int):
        # One @serve.batch queue per layer: layers never share a forward.
        async def run_layer_batch(requests: list[LayerRequest]) -> list[WireTensor]:
            return await self._run_batch(layer, requests)

        run_layer_batch.__name__ = f"layer_{layer}_batch"
        return serve.batch(
            max_batch_size=self.spec.max_batch_tokens,
            batch_wait_timeout_s=self.spec.batch_wait_timeout_s,
            batch_size_fn=count_tokens,
        )(run_layer_batch)

    def _on_group_busy(self, busy: bool) -> None:
        if busy:
            self._group_idle.clear()
        else:
            self._group_idle.set()

    # -- validation -----------------------------------------------------------------------

    def _validate(self, hidden_states: Any, layer: Any, router_logits: Any) -> LayerRequest:
        layer, x, logits = validate_forward(
            hidden_states, layer, router_logits, cfg=self.cfg, dtype=self.spec.dtype, served=self._queues,
            deployment=self.spec.name, max_tokens=self.spec.max_tokens_per_request,
        )
        kind = "torch" if is_torch_tensor(hidden_states) else "wire"
        if isinstance(hidden_states, np.ndarray):
            kind = "numpy"
        return LayerRequest(layer, x, logits, kind)

    # -- handle API -----------------------------------------------------------------------

    async def forward(self, hidden_states: Any, layer: int, router_logits: Any = None,
                      avoid_replica: str | None = None) -> Any:
        """``[T, H]`` output of MoE ``layer`` on ``hidden_states`` (same kind as the input).
        ``avoid_replica``: a re-sent call names the replica whose group failed it
        (``common.retry``); the router sends it elsewhere, and that replica refuses it."""
        if avoid_replica == self.replica:
            self.stats.error("server")
            raise GroupUnavailableError(
                f"a call re-sent after replica {self.replica} of {self.spec.name!r} failed reached that "
                f"replica again (no other replica was usable): {self.group.broken or 'its group failed'}",
                self.replica,
            )
        try:
            req = self._validate(hidden_states, layer, router_logits)
        except ServeInputError:
            self.stats.error("client")
            raise
        # A lone request on an idle group runs at once: nothing could join its batch, so
        # waiting batch_wait_timeout_s would be pure latency (a decode step's single call).
        alone = self._in_flight == 0 and self._group_idle.is_set()
        self._in_flight += 1
        self.stats.admitted(req.tokens)
        answered = False
        try:
            if req.tokens > self.spec.max_batch_tokens:
                self.stats.solo_oversize += 1
                out = (await self._run_batch(req.layer, [req]))[0]
            elif alone:
                out = (await self._run_batch(req.layer, [req]))[0]
            else:
                # Continuous batching: ``@serve.batch`` seals a batch ``batch_wait_timeout_s``
                # after its first request, even while the group is still busy; requests
                # arriving later would wait a whole extra forward. So requests queue for the
                # layer batchers only while the group is idle: those that arrive during a
                # forward are released together when it ends and fill the next batch.
                await self._group_idle.wait()
                out = await self._queues[req.layer](req)
            answered = True
        except Exception as e:
            self.stats.error("server" if http_status(e) >= 500 else "client")
            if self.group.broken is not None:
                self.stats.group_broken()
            raise
        finally:
            self._in_flight -= 1
            self.stats.released(req.tokens, answered)
        if req.kind == "numpy":
            return out.float32()
        return out.to_torch() if req.kind == "torch" else out

    async def open_session(self, client: str, max_tokens: int, workers: list[str] | None = None,
                           avoid_replica: str | None = None, peers: int = 1,
                           idle_after_s: float | None = None, linger_s: float | None = None
                           ) -> dict[str, Any]:
        """Open a session of ``peers`` peers on this replica's TP group for a lane, cohort or
        independent peers (``serve.sessions``; the client side is ``deployments.client.session``):
        ``{"granted": True, ...}`` with the session's ticket for this group, or ``{"granted":
        False, "reason": ...}`` when it is not admitted. ``avoid_replica``: as :meth:`forward`'s
        (a session opened again after this replica failed)."""
        if avoid_replica == self.replica:
            return {"granted": False, "replica": self.replica,
                    "reason": "this replica failed the client's last call (no other replica was free)"}
        self._watch()
        return await self.sessions.open(client, max_tokens, peers, idle_after_s, linger_s, workers)

    def _watch(self) -> None:
        """Start hearing rank 0's events (on the replica's event loop: the first async call)."""
        if not self._watching:
            self._watching = True
            self.group.watch(self.sessions.on_event)

    async def _run_batch(self, layer: int, requests: list[LayerRequest]) -> list[WireTensor]:
        """One forward per router-logits kind (given or computed), split back per request."""
        results: list[WireTensor | None] = [None] * len(requests)
        for with_logits in (False, True):
            idx = [i for i, r in enumerate(requests) if (r.router_logits_TE is not None) == with_logits]
            if not idx:
                continue
            part = [requests[i] for i in idx]
            x = concat_rows([r.x_TH for r in part])
            logits = None
            if with_logits:
                logits = np.concatenate([r.router_logits_TE for r in part])
            start = time.perf_counter()
            out, tail = await self.group.forward(layer, x, logits)
            seconds = time.perf_counter() - start
            self.stats.forward_done(layer, x.shape[0], len(part), tail, seconds)
            if len(part) == 1:
                results[idx[0]] = out
                continue
            start = 0
            for i, r in zip(idx, part, strict=True):
                results[i] = out.rows(start, start + r.tokens)
                start += r.tokens
        return results

    async def status(self) -> dict[str, Any]:
        spec = self.spec
        self._watch()
        try:
            sessions = await self.sessions.status()
        except Exception as e:  # a broken group still reports the rest
            sessions = {"error": error_message(e), "open": [], "history": list(self.sessions.history)}
        return {
            "deployment": spec.name,
            "role": spec.role,
            "replica": self.replica,
            "healthy": self.group.broken is None,
            "broken_reason": self.group.broken,
            "tp_size": spec.tp_size,
            "tail": spec.tail,
            "sequence_parallel": spec.sequence_parallel,
            "preshard_up_proj": spec.preshard_up_proj,
            "tail_plan": self.plan.to_dict(),
            "tail_reason": self.plan.reason,
            "controller": self.decision.to_dict(),
            "layers": list(self.resolved.layers),
            "dtype": spec.dtype,
            "device": self.group.infos[0]["device"],
            "backend": self.group.infos[0]["backend"],
            "group_transport": self.group.transport,
            "experts_backend": self.group.infos[0]["experts_backend"],
            "experts_backend_warning": self.group.infos[0]["experts_backend_warning"],
            "experts_path": self.group.infos[0]["experts_path"],
            "checkpoint": self.resolved.checkpoint,
            "max_batch_tokens": spec.max_batch_tokens,
            "max_tokens_per_request": spec.max_tokens_per_request,
            "batch_wait_timeout_s": spec.batch_wait_timeout_s,
            "collective_timeout_s": spec.collective_timeout_s,
            "bounds": asdict(spec.bounds),
            "workers": [dict(info, name=name) for info, name in zip(self.group.infos, self.group.names,
                                                                     strict=True)],
            "counters": self.stats.to_dict(),
            "sessions": sessions,
            "memory": self._memory_status(),
        }

    def _memory_status(self) -> dict[str, Any]:
        """The planner's bytes per rank by part and headroom (build time), and what each rank
        reports it holds."""
        plan = self.decision.memory
        return {
            "planned": None if plan is None else plan.to_dict(),
            "note": self.decision.memory_note,
            "resident_bytes_per_rank": [info.get("resident_bytes") for info in self.group.infos],
        }

    def health(self) -> dict[str, Any]:
        """Cheap health view for the ingress's ``/healthz`` (no collective)."""
        broken = self.group.broken
        return {"healthy": broken is None, "replica": self.replica, "broken_reason": broken}

    async def check_health(self) -> None:
        """Serve's health probe: every worker alive and its data plane sound (no collective: it
        never waits on a forward or a session)."""
        self._watch()
        try:
            await self.group.health_check()
        except Exception:
            self.stats.group_broken()
            raise

    def record_routing_stats(self) -> dict[str, Any]:
        """Read by ``deployments.serve.router.HealthyReplicaRouter``: route around a broken group."""
        return {"healthy": self.group.broken is None, "session_rows": self.sessions.rows_per_step()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Token-level load for the token-aware autoscaling policy (``deployments.control.autoscaling``)."""
        return {QUEUED_TOKENS: float(self.stats.queued_tokens), TOKENS_PER_S: self.stats.tokens_per_s(),
                OPEN_SESSIONS: float(len(self.sessions.open_now))}

    def __del__(self) -> None:
        if getattr(self, "spec", None) is not None:
            with contextlib.suppress(Exception):  # the GCS may be gone with the cluster
                kv.delete(kv.progress_key(self.spec.name, self.replica))
        group = getattr(self, "group", None)
        if group is not None:
            group.shutdown()


MoEGroup = serve.deployment(MoEGroupDeployment)
