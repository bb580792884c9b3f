"""TP-group workers (DESIGN §5.1): one Ray actor per rank, driven by the replica that owns them.

The replica runs in bundle 0 of its own placement group and starts rank ``r`` in bundle
``1 + r`` with one (possibly logical) GPU. Rank 0 picks a free port on its node IP; every
rank joins the process group with a finite timeout and loads only its shard of every served
layer, once. :class:`TPGroup` is the replica's side: it sends the same batch to every rank,
returns rank 0's output (sequence parallel: every rank's rows, in order), bounds every call by
the collective timeout plus a margin, and marks the group broken on the first failure so the
replica turns unhealthy and Serve replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from moe_runtime.config import LatentMoEConfig
from moe_runtime.tp.collectives import Collectives, default_backend, free_port, init_group
from moe_runtime.tp.runner import build_rank_runners
from moe_runtime.tp.tuning import apply_plan, measure_runners
from moe_runtime.units import torch_dtype

from . import logger
from .errors import GroupTimeoutError, GroupUnavailableError, error_message
from .options import worker_resources
from .spec import ResolvedDeployment
from .wire import WireTensor

WORKER_NAMESPACE = "latent_moe_serve"
INLINE_BYTES = 64 * 1024  # below Ray's inline-argument limit (100 KiB by default)
LIVENESS_POLL_S = 1.0  # a compiled-graph forward running longer checks that its ranks are alive
# Visibility variables Ray sets per actor (unless told not to): ROCm first, then CUDA.
_VISIBILITY_VARS = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def pick_device(gpu_ids: Sequence[Any], cuda_available: bool, env: Mapping[str, str]) -> str:
    """The torch device of a worker that Ray assigned ``gpu_ids``.

    No usable GPU (a CPU build of torch, or *logical* GPUs on a CPU machine): ``"cpu"``.
    Otherwise the local index of the first assigned id: its position in the process's visible
    list when a visibility variable is set (Ray sets it to the assigned ids, so usually 0), or
    the id itself when none is (ROCm images that preset
    ``RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES`` let every actor see every GPU).
    """
    if not cuda_available or not gpu_ids:
        return "cpu"
    assigned = str(gpu_ids[0])
    for var in _VISIBILITY_VARS:
        visible = env.get(var)
        if visible is None or visible.strip() in ("", "NoDevFiles"):
            continue
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if assigned in ids:
            return f"cuda:{ids.index(assigned)}"
        raise RuntimeError(f"Ray assigned GPU {assigned}, which is not in {var}={visible!r}")
    return f"cuda:{int(assigned)}"


def cpu_threads(world: int, cpus: int | None = None) -> int:
    """Torch threads per worker: the node's CPUs shared by the ``world`` ranks, at least 1."""
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
    return max(1, cpus // world)


class TPWorker:
    """One rank of a TP group (a Ray actor; methods run one at a time, in submission order)."""

    def __init__(self, rank: int, resolved: ResolvedDeployment):
        # A plain actor process: let the runtime's decisions (tail, backend, device) reach its log.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        spec = resolved.spec
        self.rank, self.world, self.resolved = rank, spec.tp_size, resolved
        torch.set_num_threads(cpu_threads(self.world))
        # Ray has set this actor's GPU visibility before __init__ runs: only now touch torch.cuda.
        cuda = torch.cuda.is_available()
        self.device = torch.device(pick_device(ray.get_gpu_ids() if cuda else [], cuda, os.environ))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if spec.worker_nice_increment and self.device.type == "cpu":
            os.nice(spec.worker_nice_increment)
        self.backend = default_backend(self.device)
        self.comm: Collectives | None = None
        self.runners: dict = {}
        self.load_s = 0.0

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: this node's IP and a free port on it for the process-group store."""
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the group (finite timeout) and load this rank's shard of every served layer."""
        r = self.resolved
        if self.world > 1:
            init_group(self.rank, self.world, master_addr, master_port, self.backend,
                       r.spec.collective_timeout_s)
        self.comm = Collectives(self.rank, self.world, self.device)
        start = time.perf_counter()
        cfg = LatentMoEConfig.from_pretrained(r.checkpoint)
        self.runners = build_rank_runners(
            r.checkpoint, cfg, r.layers, self.comm, r.plan,
            dtype=torch_dtype(r.spec.dtype), device=self.device, backend=r.spec.backend,
            preshard_up_proj=r.spec.preshard_up_proj,
            experts_activation_quant=r.spec.experts_activation_quant,
            mxfp4_scale_rule=r.spec.mxfp4_scale_rule,
        )
        self.load_s = time.perf_counter() - start
        return self.info()

    def forward(
        self, layer: int, x_TH: WireTensor, router_logits_TE: WireTensor | None
    ) -> tuple[WireTensor | None, str]:
        """Run ``layer`` on the batch; rank 0 returns ``out [T, H]`` (sequence parallel: every
        rank returns its own rows), the others None; plus the tail that ran."""
        runner = self.runners[layer]
        x = x_TH.to_torch(writable=False).to(self.device, non_blocking=True)
        logits = router_logits_TE
        if logits is not None:
            logits = logits.to_torch(writable=False).to(self.device)
        with torch.inference_mode():
            out = runner.forward(x, logits)
        tail = runner.last_tail
        if self.rank != 0 and tail != "sequence_parallel":
            return None, tail
        return WireTensor.from_torch(out), tail

    def measure_tails(self, settings: Any, tails: list[str]) -> dict[str, dict[int, float]]:
        """Warm-up: time ``tails`` on this rank (every rank at once: the tails run collectives)."""
        return measure_runners(self.runners, settings.token_counts, settings.reps, settings.clock, tails)

    def set_plan(self, plan: Any) -> None:
        """Adopt the controller's (measured) plan on every served layer."""
        apply_plan(self.runners, plan)

    def barrier(self) -> int:
        """The health collective: a tiny all-reduce that every rank must join."""
        self.comm.barrier_check()
        return self.rank

    def info(self) -> dict[str, Any]:
        resident = sum(r.resident_bytes() for r in self.runners.values())
        first = next(iter(self.runners.values()), None)
        by_part: dict[str, int] = {}
        for runner in self.runners.values():
            for part, n in runner.resident_bytes_by_part().items():
                by_part[part] = by_part.get(part, 0) + n
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "device": str(self.device),
            "backend": self.backend,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "torch_threads": torch.get_num_threads(),
            "niceness": os.nice(0),
            "resident_bytes": resident,
            "resident_bytes_by_part": by_part,
            "load_bytes_read": sum(r.load_bytes_read for r in self.runners.values()),
            "load_s": round(self.load_s, 3),
            "experts_backend": first.backend_name if first else None,
            # the load-time probes of non-torch experts backends, with their numbers (backend_check.py)
            "experts_backend_checks": [c.to_dict() for c in first.backend_checks] if first else [],
        }


class _RankFailure(Exception):
    def __init__(self, rank: int, error: BaseException):
        super().__init__(rank, error)
        self.rank, self.error = rank, error


class TPGroup:
    """The replica's handle on its workers: start, forward, health collective, shutdown."""

    def __init__(self, resolved: ResolvedDeployment, workers: list, names: list[str], infos: list[dict]):
        self.resolved = resolved
        self.workers, self.names, self.infos = workers, names, infos
        self.world = resolved.spec.tp_size
        self.call_timeout_s = resolved.spec.call_timeout_s
        self.broken: str | None = None
        self._lock = asyncio.Lock()  # one group call at a time: every rank sees the same order
        self._submit_lock = threading.Lock()
        # Called with True when a forward starts running on the ranks, False when it ends.
        self.busy_listeners: list[Callable[[bool], None]] = []
        self._dag: Any = None  # the forward hop as a compiled graph (compiled at the first forward)
        self.transport: str | None = None  # how forwards reach the ranks, once decided

    @classmethod
    def start(cls, resolved: ResolvedDeployment, tag: str) -> TPGroup:
        """Start ``tp_size`` workers in bundles ``1..P`` of the current placement group."""
        spec = resolved.spec
        startup_timeout_s = spec.startup_bound_s
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError(
                f"deployment {spec.name!r} must run in a placement group of 1 + {spec.tp_size} bundles "
                "(placement_group_bundles in its options, see deployments.options)"
            )
        actor_cls = ray.remote(TPWorker)
        resources = worker_resources(spec)
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
                ).remote(rank, resolved)
            )
            names.append(name)
        try:
            addr, port = ray.get(workers[0].rendezvous_address.remote(), timeout=startup_timeout_s)
            infos = ray.get([w.setup.remote(addr, port) for w in workers], timeout=startup_timeout_s)
        except BaseException:
            for w in workers:
                ray.kill(w, no_restart=True)
            raise
        group = cls(resolved, workers, names, infos)
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

    def check_usable(self) -> None:
        if self.broken is not None:
            raise GroupUnavailableError(
                f"the TP group of deployment {self.resolved.spec.name!r} is broken ({self.broken}); "
                "the replica is unhealthy and Serve is replacing it, retry shortly"
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
            raise GroupTimeoutError(f"TP group timed out: {reason}") from None
        except _RankFailure as f:
            died = isinstance(f.error, ray.exceptions.RayActorError)
            reason = self._break(
                f"rank {f.rank} {'died' if died else 'failed'} during {what}: {error_message(f.error)}"
            )
            raise GroupUnavailableError(f"TP group failed: {reason}") from None

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
            except Exception as e:  # e.g. an older Ray, or channels not available here
                self.transport = f"actor calls (compiled graph unavailable: {error_message(e)})"
        logger.info("TP group %s: forwards reach the ranks by %s", self.resolved.spec.name, self.transport)

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
                    raise GroupUnavailableError(f"TP group failed: {reason}")
                if time.monotonic() >= deadline:
                    reason = self._break(f"{what} did not finish within {timeout_s:.0f} s (compiled graph)")
                    raise GroupTimeoutError(f"TP group timed out: {reason}")
        except GroupUnavailableError:
            task.cancel()
            raise
        except Exception as e:
            dead = await self._dead_ranks()
            who = f"rank {dead[0]} died" if dead else "a rank failed"
            reason = self._break(f"{who} during {what} (compiled graph): {error_message(e)}")
            raise GroupUnavailableError(f"TP group failed: {reason}") from None
        # Outputs may be views of the channel's buffer, which the next forward reuses.
        return [(None if out is None else WireTensor(out.array.copy(), out.dtype), tail)
                for out, tail in results]

    async def _dead_ranks(self, timeout_s: float = 5.0) -> list[int]:
        """Ranks whose actor no longer answers (the graph's error does not say which)."""

        async def dead(worker) -> bool:
            try:
                await asyncio.wait_for(worker.__ray_ready__.remote(), timeout_s)
            except ray.exceptions.RayActorError:
                return True
            except Exception:  # slow to answer (a loaded machine) is not dead
                pass
            return False

        flags = await asyncio.gather(*(dead(w) for w in self.workers))
        return [r for r, gone in enumerate(flags) if gone]

    async def _locked_call(self, method: str, args: tuple, what: str, timeout_s: float) -> list:
        async with self._lock:
            self.check_usable()
            notify = method == "forward"
            if notify:
                for listener in self.busy_listeners:
                    listener(True)
            try:
                if notify and self._dag is not None:
                    return await self._gather_compiled(args, what, timeout_s)
                return await self._gather(self._submit(method, *args), what, timeout_s)
            finally:
                if notify:
                    for listener in self.busy_listeners:
                        listener(False)

    async def _shielded(self, method: str, args: tuple, what: str, timeout_s: float) -> list:
        # A cancelled caller must not release the lock while its call still runs on the ranks.
        task = asyncio.ensure_future(self._locked_call(method, args, what, timeout_s))
        return await asyncio.shield(task)

    async def forward(
        self, layer: int, x_TH: torch.Tensor, router_logits_TE: torch.Tensor | None
    ) -> tuple[torch.Tensor, str]:
        """``out [T, H]`` of ``layer`` and the tail that ran."""
        T = x_TH.shape[0]
        if self.transport is None:
            self._compile_forward()
        x_w = WireTensor.from_torch(x_TH)
        logits_w = None if router_logits_TE is None else WireTensor.from_torch(router_logits_TE)
        if self._dag is None and self.world > 1 and x_w.array.nbytes > INLINE_BYTES:
            # Into the object store once rather than serialised for every rank; small batches
            # (decode) travel inline in the call, which costs less than a put and a fetch.
            x_w = ray.put(x_w)
            logits_w = None if logits_w is None else ray.put(logits_w)
        results = await self._shielded(
            "forward", (layer, x_w, logits_w), f"the layer {layer} forward of {T} tokens", self.call_timeout_s
        )
        tail = results[0][1]
        if tail == "sequence_parallel":
            return torch.cat([out.to_torch() for out, _ in results]), tail
        return results[0][0].to_torch(), tail

    async def health_check(self) -> None:
        """Every worker alive and the group able to run a collective; raises otherwise.

        While a forward holds the group, that forward is itself the proof (and fails on its
        own, within its bound, if a rank is gone), so the probe only checks the broken flag.
        """
        self.check_usable()
        if self._lock.locked():
            return
        await self._shielded(
            "barrier", (), "the health all-reduce", self.resolved.spec.collective_timeout_s + 5.0
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
