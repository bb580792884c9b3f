"""A TP-group worker (DESIGN §5.1): one Ray actor per rank (worker process code only).

The replica (``serve.group.TPGroup``) starts rank ``r`` in bundle ``1 + r`` of its placement
group. Rank 0 picks a free port on its node IP; every rank joins the process group with a
finite timeout and loads only its shard of every served layer, once. Where it computes is the
controller's decision (``control.accelerator``): ``cpu``, or ``gpu`` on the device Ray assigned.

The group replica imports this module to start the ranks and never loads torch (see
``serve.deployment``), so torch and the runtime are imported inside the methods, which run in
the rank's own process.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray

from moe_runtime.config import LatentMoEConfig

from .. import logger
from ..common.errors import ServeInputError, error_message
from ..common.requests import as_rows, check_layer, check_layout, validate_forward
from ..common.wire import WireTensor, concat_rows, failure_in, part_tokens
from ..config.resolve import ResolvedDeployment
from .lanes import LaneSeat

if TYPE_CHECKING:
    import torch

    from moe_runtime.tp.collectives import Collectives

WORKER_NAMESPACE = "latent_moe_serve"
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


class TPWorker:
    """One rank of a TP group (a Ray actor; methods run one at a time, in submission order)."""

    def __init__(self, rank: int, resolved: ResolvedDeployment, compute: str):
        """``compute``: the controller's decision, ``gpu`` or ``cpu``."""
        import torch

        from moe_runtime.tp.collectives import default_backend, threads_per_rank

        # A plain actor process: let the runtime's decisions (tail, backend, device) reach its log.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        spec = resolved.spec
        self.rank, self.world, self.resolved = rank, spec.tp_size, resolved
        self.threads = threads_per_rank(self.world)
        torch.set_num_threads(self.threads)
        self.device_note: str | None = None
        if compute == "cpu":
            self.device = torch.device("cpu")
        else:
            # Ray has set this actor's GPU visibility before __init__ runs: only now touch torch.cuda.
            cuda = torch.cuda.is_available()
            self.device = torch.device(pick_device(ray.get_gpu_ids() if cuda else [], cuda, os.environ))
            if self.device.type == "cpu":
                self.device_note = (
                    "the controller decided GPU compute, but this process sees no usable GPU "
                    f"(torch.cuda available: {cuda}, Ray GPU ids: {ray.get_gpu_ids()}): computing on CPU"
                )
                logger.warning("rank %d of %r: %s", rank, spec.name, self.device_note)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if spec.worker_nice_increment and self.device.type == "cpu":
            os.nice(spec.worker_nice_increment)
        self.backend = default_backend(self.device)
        self.comm: Collectives | None = None
        self.runners: dict = {}
        self.load_s = 0.0
        self.max_tokens = spec.max_tokens_per_request  # the lane's limit, kept live by the replica
        self.lane = LaneSeat()

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: this node's IP and a free port on it for the process-group store."""
        from moe_runtime.tp.collectives import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the group (finite timeout) and load this rank's shard of every served layer."""
        from moe_runtime.tp.collectives import Collectives, init_group
        from moe_runtime.tp.runner import build_rank_runners
        from moe_runtime.units import torch_dtype

        r = self.resolved
        if self.world > 1:
            # Until every rank has loaded, the group's timeout is the startup bound: a rank that
            # loads more slowly than its peer must not trip the forward's collective timeout.
            init_group(self.rank, self.world, master_addr, master_port, self.backend,
                       r.spec.bounds.startup_s)
        self.comm = Collectives(self.rank, self.world, self.device)
        start = time.perf_counter()
        self.cfg = cfg = LatentMoEConfig.from_pretrained(r.checkpoint)
        self.runners = build_rank_runners(
            r.checkpoint, cfg, r.layers, self.comm, r.plan,
            dtype=torch_dtype(r.spec.dtype), device=self.device, backend=r.spec.backend,
            preshard_up_proj=r.spec.preshard_up_proj,
            experts_activation_quant=r.spec.experts_activation_quant,
            mxfp4_scale_rule=r.spec.mxfp4_scale_rule,
        )
        self.load_s = time.perf_counter() - start
        self.comm.loaded(r.spec.collective_timeout_s)  # then every collective gets its own bound
        return self.info()

    def forward(
        self, layer: int, x_TH: WireTensor, router_logits_TE: WireTensor | None
    ) -> tuple[WireTensor | None, str]:
        """Run ``layer`` on the batch (the replica validated it); rank 0 returns ``out [T, H]``
        (sequence parallel: every rank returns its own rows), the others None; plus the tail."""
        logits = None if router_logits_TE is None else router_logits_TE.to_torch(writable=False)
        return self._run(layer, x_TH.to_torch(writable=False), logits)

    def _run(self, layer: int, x: torch.Tensor, logits: torch.Tensor | None) -> tuple[WireTensor | None, str]:
        import torch

        runner = self.runners[layer]
        x = x.to(self.device, non_blocking=True)
        if logits is not None:
            logits = logits.to(self.device)
        with torch.inference_mode():
            out = runner.forward(x, logits)
        tail = runner.last_tail
        if self.rank != 0 and tail != "sequence_parallel":
            return None, tail
        return WireTensor.from_torch(out), tail

    # -- leases (deployments.serve.lanes): a lane's or a cohort's compiled graph calls this --

    def lane_forward(
        self, lease_id: str, layer: Any, router_logits_TE: Any, after: Any, *parts: Any
    ) -> tuple[WireTensor | None, str, list[int]]:
        """One forward of every part's rows, concatenated in order, for the client holding
        ``lease_id``: a lane sends one part, a cohort one per attention worker (0 rows allowed:
        it adds nothing). ``after``: this rank's previous node in a cohort's graph (ignored:
        it only orders the graph). Returns :meth:`forward`'s ``(out, tail)`` for the whole batch plus
        each part's token count (``common.wire.part_rows`` splits it back). Every rank checks the
        input the same way, so a bad one fails on every rank before any collective; a failure
        that is not the input's marks the lease failed, and the replica breaks the group."""
        import torch

        self.lane.check(lease_id)
        failed = failure_in(parts)
        if failed is not None:  # a cohort worker failed this step: nothing runs, the graph goes on
            self.lane.calls += 1
            return failed, "none", [0] * len(parts)
        if torch.get_num_threads() != self.threads:
            # Graph loops run on their own thread, where OpenMP starts from its default count;
            # the same count as the Serve path's forward keeps the two bit-identical.
            torch.set_num_threads(self.threads)
        start = time.perf_counter()
        sizes = [part_tokens(p) for p in parts]
        tokens = sum(sizes)
        self.lane.in_flight_tokens = tokens
        try:
            layer, x, logits = self._lease_batch(layer, parts, router_logits_TE)
            if x is None:  # every part empty: nothing to run, every rank agrees
                empty = torch.empty(0, self.cfg.hidden_size, dtype=getattr(torch, self.resolved.spec.dtype))
                result = (WireTensor.from_torch(empty), "none")
            else:
                result = self._run(layer, x.to_torch(writable=False),
                                   None if logits is None else torch.from_numpy(logits))
                self.lane.forwards += 1
                self.lane.requests += sum(1 for n in sizes if n)
                self.lane.tails[result[1]] += 1
                self.lane.layer_forwards[layer] += 1
                self.lane.layer_requests[layer] += sum(1 for n in sizes if n)
                self.lane.layer_tokens[layer] += tokens
                self.lane.batch_tokens[f"{layer}:{tokens}"] += 1
        except ServeInputError:
            raise
        except Exception as e:
            self.lane.failed = (f"lease forward of layer {layer} failed on rank {self.rank}: "
                                f"{error_message(e)}")
            raise
        finally:
            self.lane.in_flight_tokens = 0
            self.lane.calls += 1  # attempted: every rank counts the same calls (serve.lanes)
        self.lane.tokens += tokens
        self.lane.busy_s += time.perf_counter() - start
        out, tail = result
        if self.rank != 0 and tail != "sequence_parallel":
            return None, tail, sizes
        return out, tail, sizes

    def _lease_batch(self, layer: Any, parts: tuple, router_logits_TE: Any
                     ) -> tuple[int, WireTensor | None, Any]:
        """The checked layer, the parts' rows as one batch (None when no part has rows) and the
        fp32 router logits (numpy) or None."""
        if not parts:
            raise ServeInputError("a lease forward needs at least one part")
        dtype, H = self.resolved.spec.dtype, self.cfg.hidden_size
        rows = []
        for i, part in enumerate(parts):
            what = "hidden_states" if len(parts) == 1 else f"hidden_states of part {i}"
            x = as_rows(part, what, dtype)
            if x.shape != (0, H):  # else a worker with nothing to send this step
                rows.append((x, what))
        if not rows:
            return check_layer(layer, self.cfg, self.runners, self.resolved.spec.name), None, None
        if router_logits_TE is not None and len(parts) > 1:
            raise ServeInputError("router_logits go with a single part (a lane call), not a cohort's")
        if len(rows) > 1:  # parts join only in one layout; the batch's check below does the rest
            for x, what in rows:
                check_layout(x, H, dtype, what)
        return validate_forward(
            concat_rows([x for x, _ in rows]), layer, router_logits_TE, cfg=self.cfg, dtype=dtype,
            served=self.runners, deployment=self.resolved.spec.name, max_tokens=self.max_tokens,
        )

    def lane_open(self, lease_id: str, client: str) -> None:
        self.lane.open(lease_id, client)

    def lane_close(self, lease_id: str) -> dict[str, Any]:
        state = self.lane.state()
        self.lane.close(lease_id)
        return state

    def lane_renew(self, lease_id: str) -> bool:
        return self.lane.renew(lease_id)

    def lane_expire(self, lease_id: str, term_s: float) -> bool:
        return self.lane.expire(lease_id, term_s)

    def lane_release(self, lease_id: str) -> None:
        self.lane.release(lease_id)

    def lane_revoke(self, lease_id: str) -> None:
        self.lane.revoke(lease_id)

    def lane_fail(self, lease_id: str, reason: str) -> None:
        """The client's report that a call of ``lease_id`` outlived its bound (main thread: it
        answers while the graph's loop is stuck)."""
        self.lane.fail(lease_id, reason)

    def lane_state(self) -> dict[str, Any]:
        return self.lane.state()

    def set_max_tokens(self, max_tokens: int) -> None:
        """A live ``max_tokens_per_request`` (the replica's ``reconfigure``) for lane calls."""
        self.max_tokens = max_tokens

    def measure_tails(self, settings: Any, tails: list[str]) -> dict[str, dict[int, float]]:
        """Warm-up: time ``tails`` on this rank (every rank at once: the tails run collectives)."""
        from moe_runtime.tp.tuning import measure_runners

        return measure_runners(self.runners, settings.token_counts, settings.reps, settings.clock, tails)

    def set_plan(self, plan: Any) -> None:
        """Adopt the controller's (measured) plan on every served layer."""
        from moe_runtime.tp.tuning import apply_plan

        apply_plan(self.runners, plan)

    def barrier(self) -> int:
        """The health collective: a tiny all-reduce that every rank must join."""
        self.comm.barrier_check()
        return self.rank

    def info(self) -> dict[str, Any]:
        import torch

        resident = sum(r.resident_bytes() for r in self.runners.values())
        first = next(iter(self.runners.values()), None)
        by_part: dict[str, int] = {}
        for runner in self.runners.values():
            for part, n in runner.resident_bytes_by_part().items():
                by_part[part] = by_part.get(part, 0) + n
        return {
            "rank": self.rank,
            "hidden_size": self.cfg.hidden_size,
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "device": str(self.device),
            "device_note": self.device_note,
            "backend": self.backend,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "torch_threads": torch.get_num_threads(),
            "niceness": os.nice(0),
            "resident_bytes": resident,
            "resident_bytes_by_part": by_part,
            "load_bytes_read": sum(r.load_bytes_read for r in self.runners.values()),
            "load_s": round(self.load_s, 3),
            "experts_backend": first.backend_name if first else None,
            "experts_backend_warning": first.backend_warning if first else None,
            # packed experts: the fused CPU kernel, or the decode path and why
            "experts_path": f"{first.experts_path} ({first.experts_path_reason})" if first else None,
            # the load-time probes of non-torch experts backends, with their numbers (backend_check.py)
            "experts_backend_checks": [c.to_dict() for c in first.backend_checks] if first else [],
        }

