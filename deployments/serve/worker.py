"""A TP-group worker (DESIGN §5.1): one Ray actor per rank (worker process code only).

The replica (``serve.group.TPGroup``) starts rank ``r`` in bundle ``1 + r`` of its placement
group. Rank 0 picks a free port on its node IP; every rank joins the process group with a
finite timeout and loads only its shard of every served layer, once, in the runner of the
checkpoint's layer family (``moe_runtime.families``: the latent runner, or the standard one).
Where it computes is the controller's decision (``control.accelerator``): ``cpu``, or ``gpu`` on
the device Ray assigned.

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

from moe_runtime.families import is_standard, load_layer_config
from moe_runtime.units import dtype_name

from .. import logger
from ..common.requests import check_layer, check_layout, validate_forward
from ..common.wire import DeviceRows, WireTensor
from ..config.resolve import ResolvedDeployment

if TYPE_CHECKING:
    import torch

    from moe_runtime.tp.collectives import Collectives

    from ..dataplane.host import GroupHost, RankLink

# Reads of a rank's data-plane state run on threads of their own (a Ray concurrency group): a
# health check or a status read never queues behind another call to the rank, nor blocks one.
OBSERVE = "observe"
CONCURRENCY_GROUPS = {OBSERVE: 2}

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
        self.max_tokens = spec.max_tokens_per_request  # a part's limit, kept live by the replica
        self.max_forward = spec.max_forward_tokens  # a forward's rows, kept live by the replica
        self.reported: str | None = None  # a client's report that a call outlived its bound
        self.host: GroupHost | None = None  # rank 0's data plane
        self.link: RankLink | None = None  # a rank > 0's link to rank 0

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: this node's IP and a free port on it for the process-group store."""
        from moe_runtime.tp.collectives import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the group (finite timeout) and load this rank's shard of every served layer."""
        from moe_runtime.standard import build_standard_runners
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
        self.cfg = cfg = load_layer_config(r.checkpoint)
        dtype = torch_dtype(r.spec.dtype)
        if is_standard(cfg):  # one fixed plan; the controller refused every latent-only option
            self.runners = build_standard_runners(r.checkpoint, cfg, r.layers, self.comm, dtype=dtype,
                                                  device=self.device, backend=r.spec.backend)
        else:
            self.runners = build_rank_runners(
                r.checkpoint, cfg, r.layers, self.comm, r.plan,
                dtype=dtype, device=self.device, backend=r.spec.backend,
                preshard_up_proj=r.spec.preshard_up_proj,
                experts_activation_quant=r.spec.experts_activation_quant,
                mxfp4_scale_rule=r.spec.mxfp4_scale_rule,
            )
        self.load_s = time.perf_counter() - start
        self.comm.loaded(r.spec.collective_timeout_s)  # then every collective gets its own bound
        return self.info()

    def run_layer(self, layer: int, x: torch.Tensor, logits: torch.Tensor | None, on_device: bool = False
                  ) -> tuple[WireTensor | DeviceRows | None, str]:
        """Run ``layer`` on a checked batch: rank 0's ``out [T, H]`` (sequence parallel: every rank
        its own rows), the others None; plus the tail. ``on_device``: ``out`` stays on this rank's
        device (it leaves on a device channel)."""
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
        return (DeviceRows(out, dtype_name(out.dtype)) if on_device else WireTensor.from_torch(out)), tail

    # -- the data plane (deployments.dataplane): rank 0 hosts sessions, the others follow --------

    def dataplane_listen(self, group_secret: str) -> tuple[str, int]:
        """Rank 0: start the group's data-plane host on this node's address; where it listens."""
        from ..dataplane.host import GroupHost

        spec = self.resolved.spec
        self.host = GroupHost(ray.util.get_node_ip_address(), group_secret, self.world, SessionCompute(self),
                              spec.bounds.call_s, self.cfg.hidden_size, spec.dtype, f"{spec.name}-rank0",
                              channel_device=str(self.device))
        return self.host.address

    def dataplane_link(self, address: tuple[str, int], group_secret: str) -> None:
        """Ranks > 0: follow rank 0's batches (they run in the order rank 0 sends them)."""
        from ..dataplane.host import RankLink

        self.link = RankLink(tuple(address), group_secret, self.rank, SessionCompute(self),
                             self.resolved.spec.bounds.startup_s)

    def dataplane_ready(self, timeout_s: float) -> None:
        """Rank 0: every other rank has linked."""
        self.host.wait_ranks(timeout_s)

    def session_open(self, peers: int, max_tokens: int | None, name: str, idle_after_s: float | None = None,
                     linger_s: float | None = None, max_sessions: int | None = None) -> dict[str, Any]:
        """Rank 0: a new session (its number, secret and where to connect); ``max_tokens``: rows
        per part, None: the deployment's live ``max_tokens_per_request`` (``set_limits``);
        ``idle_after_s``: an elastic session, ``linger_s`` and ``max_sessions``: ``dataplane.host``."""
        number, secret = self.host.open(peers, max_tokens, name, idle_after_s, linger_s, max_sessions)
        host, port = self.host.address
        return {"session": number, "secret": secret, "host": host, "port": port,
                "store_port": self.host.store_port, "channel": self.host.channel_backend}

    def dataplane_stop(self, reason: str) -> None:
        """Rank 0: end every session as a broken group's (``host.fail``) before the replica stops
        its ranks, between two batches: a rank killed half-way through answering a forward would
        leave the peers it answered a layer ahead of the others."""
        self.host.fail(reason, self.resolved.spec.bounds.call_s)

    def session_close(self, number: int, reason: str) -> dict[str, Any] | None:
        """Rank 0: end session ``number`` (its peers are told ``reason``); its last state."""
        return self.host.close(number, reason, self.resolved.spec.bounds.close_s)

    @ray.method(concurrency_group=OBSERVE)
    def sessions_snapshot(self) -> dict[str, Any]:
        """Rank 0: every open session's state and the group's counters, exact at this moment."""
        return self.host.snapshot(self.resolved.spec.bounds.call_s)

    @ray.method(concurrency_group=OBSERVE)
    def dataplane_failed(self) -> str | None:
        """Why this rank's data plane broke (a forward failed, rank 0's link closed, a heartbeat
        went unanswered), if it did."""
        parts = (self.host, self.link)
        return next((part.failed for part in parts if part is not None and part.failed), None)

    @ray.method(concurrency_group=OBSERVE)
    def dataplane_health(self) -> dict[str, Any]:
        """This rank's data-plane health (the replica's health check: no collective, so it never
        waits on sessions): ``failed`` and, on rank 0, how long the forward under way has run."""
        health = self.host.health() if self.host is not None else {"failed": None, "forward_running_s": None}
        failed = health["failed"] or self.dataplane_failed() or self.reported
        return {**health, "rank": self.rank, "failed": failed}

    @ray.method(concurrency_group=OBSERVE)
    def dataplane_report(self, reason: str) -> None:
        """A client saw a call outlive its bound (main thread: it answers while the data plane's
        thread is stuck); the replica's health check then breaks the group."""
        self.reported = self.reported or reason

    def set_limits(self, max_tokens: int, max_forward: int) -> None:
        """The live ``max_tokens_per_request`` (a part's rows) and the largest forward (the
        replica's ``reconfigure``)."""
        self.max_tokens, self.max_forward = max_tokens, max_forward

    def measure_tails(self, settings: Any, tails: list[str]) -> dict[str, dict[int, float]]:
        """Warm-up: time ``tails`` on this rank (every rank at once: the tails run collectives)."""
        from moe_runtime.tp.tuning import measure_runners

        return measure_runners(self.runners, settings.token_counts, settings.reps, settings.clock, tails)

    def set_plan(self, plan: Any) -> None:
        """Adopt the controller's (measured) plan on every served layer."""
        from moe_runtime.tp.tuning import apply_plan

        apply_plan(self.runners, plan)

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



class SessionCompute:
    """A rank's checks and forward for its data plane (``dataplane.host.Compute``): the same
    checks (``common.requests``) and runners as a Serve forward, so the answers are identical."""

    def __init__(self, worker: TPWorker):
        self.worker = worker

    def check(self, layer: int, x: WireTensor, logits: Any, max_tokens: int | None, what: str
              ) -> tuple[int, WireTensor, Any]:
        w = self.worker
        dtype = w.resolved.spec.dtype
        check_layout(x, w.cfg.hidden_size, dtype, what)
        if x.shape[0] == 0:  # a peer with nothing to send this layer still takes part
            return check_layer(layer, w.cfg, w.runners, w.resolved.spec.name), x, None
        return validate_forward(x, layer, logits, cfg=w.cfg, dtype=dtype, served=w.runners,
                                deployment=w.resolved.spec.name,
                                max_tokens=w.max_tokens if max_tokens is None else max_tokens)

    def run(self, layer: int, x: WireTensor, logits: Any) -> tuple[WireTensor | None, str]:
        import torch

        w = self.worker
        if torch.get_num_threads() != w.threads:
            # The data plane's thread starts with OpenMP's default count; the same count as the
            # actor's main thread keeps every path bit-identical.
            torch.set_num_threads(w.threads)
        logits_t = None if logits is None else torch.from_numpy(logits)
        return w.run_layer(layer, x.to_torch(writable=False), logits_t, isinstance(x, DeviceRows))

    def forward_limit(self) -> int:
        return self.worker.max_forward
