"""A thin, counted interface over a torch.distributed process group.

gloo on CPU, nccl on GPUs (RCCL on ROCm). Every rendezvous and collective has a finite
timeout, so a dead rank fails the call instead of hanging the group.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections import Counter

import torch
import torch.distributed as dist

from ..private_api import set_default_group_timeout

# Newer torch names these *_single and deprecates the old names; the ROCm image of
# cluster.yaml ships an older torch that has only the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def available_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(world: int, cpus: int | None = None) -> int:
    """Torch threads of each of ``world`` ranks sharing ``cpus`` (default: this process's), >= 1."""
    return max(1, (available_cpus() if cpus is None else cpus) // world)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_group(
    rank: int, world: int, master_addr: str, master_port: int, backend: str, timeout_s: float
) -> None:
    """Join the default process group with a finite timeout (rendezvous included)."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class Collectives:
    """Sum-collectives over the default group (or a single rank when ``world == 1``).

    ``counts`` records every call by name and ``nbytes`` the bytes this rank handed to each
    kind (its input tensor: what a tail puts on the wire, before the algorithm's own factor,
    e.g. ``2 (P - 1) / P`` of it per rank for a ring all-reduce), so tests and benchmarks can
    assert and report each tail's collective cost.
    """

    def __init__(self, rank: int = 0, world: int = 1, device: torch.device | str = "cpu",
                 collective_timeout_s: float | None = None):
        if world > 1 and not dist.is_initialized():
            raise RuntimeError(f"TP size {world} needs an initialised process group")
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.collective_timeout_s = collective_timeout_s  # what ``loaded()`` applies
        self.counts: Counter[str] = Counter()
        self.nbytes: Counter[str] = Counter()

    def _count(self, kind: str, t: torch.Tensor) -> None:
        self.counts[kind] += 1
        self.nbytes[kind] += t.numel() * t.element_size()

    def loaded(self, collective_timeout_s: float | None = None) -> None:
        """Call on every rank once its weights are loaded: wait for the peers' loads (under the
        group's rendezvous timeout, which must cover a slow load), then give every later
        collective ``collective_timeout_s`` (None: keep the current timeout). So a rank that
        loads more slowly than its peer never trips the forward's collective timeout."""
        collective_timeout_s = collective_timeout_s or self.collective_timeout_s
        if self.world == 1 or collective_timeout_s is None:
            return
        if collective_timeout_s <= 0:
            raise ValueError(f"collective timeout must be positive seconds, got {collective_timeout_s}")
        dist.barrier()
        set_default_group_timeout(datetime.timedelta(seconds=collective_timeout_s))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._count("all_reduce", t)
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def all_reduce_async(self, t: torch.Tensor):
        """Start a sum all-reduce of ``t`` in place; call ``.wait()`` on the result."""
        self._count("all_reduce", t)
        if self.world > 1:
            return dist.all_reduce(t, async_op=True)
        return _Done()

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks and keep this rank's ``1/world`` of dim 0 (divisible by world)."""
        self._count("reduce_scatter", t)
        if self.world == 1:
            return t
        out = torch.empty((t.shape[0] // self.world, *t.shape[1:]), dtype=t.dtype, device=t.device)
        _reduce_scatter(out, t.contiguous())
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t`` along dim 0, in rank order."""
        self._count("all_gather", t)
        if self.world == 1:
            return t
        out = torch.empty((t.shape[0] * self.world, *t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather(out, t.contiguous())
        return out

    def barrier_check(self) -> None:
        """A tiny all-reduce that proves every rank is alive (health checks)."""
        probe = torch.ones(1, device=self.device)
        if self.world > 1:
            dist.all_reduce(probe)
        if probe.item() != self.world:
            raise RuntimeError(f"health all-reduce summed to {probe.item()}, expected {self.world}")


class _Done:
    def wait(self) -> bool:
        return True
