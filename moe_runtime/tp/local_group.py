"""Run a function on P local processes joined in a gloo group (CLI, tests, benchmarks).

``fn(comm, *args)`` runs on every rank with a ready ``Collectives``; the caller gets each
rank's return value, in rank order. A rank that raises or outlives ``timeout_s`` fails the
whole call; only the processes started here are terminated.
"""

from __future__ import annotations

import functools
import io
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .collectives import Collectives, free_port, init_group, threads_per_rank


@functools.cache
def _forkserver() -> mp.context.ForkServerContext:
    """Ranks are forked from a server process that imported torch once (multiprocessing's
    forkserver), where a spawned rank paid ~1 CPU-s of imports every time. They therefore see the
    environment and sys.path as they were when that server started: at this process's first
    group. The preload list is the process's one forkserver's: set here, at the first group, not
    when this module is imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return ctx


def _rank_main(
    rank: int, world: int, port: int, timeouts: tuple[float, float], threads: int, fn: Callable, args: tuple,
    results,
) -> None:
    try:
        torch.set_num_threads(threads)
        rendezvous_s, collective_s = timeouts
        init_group(rank, world, "127.0.0.1", port, "gloo", rendezvous_s)
        try:
            value = fn(Collectives(rank, world, collective_timeout_s=collective_s), *args)
        finally:
            dist.destroy_process_group()
        # Serialise here: tensors passed through the queue as shared memory would vanish
        # with this process before the parent maps them.
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_local_group(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 300.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``world`` forked ranks and return their results.

    The group's rendezvous (and every collective until ``fn`` calls ``comm.loaded()``) may take up
    to ``timeout_s``, so ranks that load at different speeds meet; ``comm.loaded()`` then gives
    the collectives ``collective_timeout_s``: the collective timeout starts after load."""
    if world < 1:
        raise ValueError(f"TP size must be >= 1, got {world}")
    ctx = _forkserver()
    results = ctx.Queue()
    port = free_port()
    threads = threads_per_rank(world)
    procs = [
        ctx.Process(
            target=_rank_main,
            daemon=True,
            args=(r, world, port, (max(timeout_s, collective_timeout_s), collective_timeout_s), threads, fn,
                  args, results),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"local TP group of {world} did not finish within {timeout_s:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} exited without a result") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [out[r] for r in range(world)]
