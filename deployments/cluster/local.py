"""A private Ray instance with Serve on this machine, for a process that serves by itself:
``scripts/run.sh``'s demo, the examples, the benchmarks and the tests."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@contextlib.contextmanager
def local_serve(num_cpus: int, num_gpus: int = 0, *, host: str = "127.0.0.1", port: int | None = None,
                **ray_args: Any) -> Iterator[int]:
    """Start a Ray instance of this process's own and Serve's HTTP proxy on ``host:port`` (a free
    port when None); yield the port, and stop both on the way out.

    ``address="local"``: never a ``ray start`` cluster found on the machine. The GPUs are logical
    on a CPU machine. ``ray_args`` go to ``ray.init``. Stopping the instance stops Serve with it
    (:func:`leave_ray`).
    """
    from ray import serve

    from moe_runtime.tp.collectives import free_port

    start_ray(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
              namespace="serve", log_to_driver=False, **ray_args)
    try:
        port = free_port() if port is None else port
        serve.start(http_options={"host": host, "port": port})
        yield port
    finally:
        leave_ray()


def start_ray(**init_args: Any) -> None:
    """``ray.init(**init_args)``, and once more if the new node gave up waiting for its raylet.

    Ray 2.60 waits a fixed 30 s for a new node's raylet to register; a 2-core machine busy with
    another Ray instance can pass that (CI did once). The failed try's processes (this process's
    children that it started) are ended by PID before the second try.
    """
    import ray

    before = _children()
    try:
        ray.init(**init_args)
    except Exception as error:
        if "timed out during startup" not in str(error):
            raise
        left = sorted(_children() - before)
        log.warning("Ray's node did not start within Ray's 30 s (%s); ending its processes %s and "
                    "starting it again", error, left)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ray.init(**init_args)


def _children() -> set[int]:
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            pids.update(map(int, (task / "children").read_text().split()))
    return pids


def leave_ray() -> None:
    """Disconnect this driver from Ray without stopping Serve first, Serve's handles before Ray.

    ``serve.shutdown()`` would kill the controller while this driver's handles still poll it, and
    Ray log their retried calls ("listen_for_change failed ... killed by ray.kill"); a private
    instance stops Serve with it, a cluster's end does too. The handles go first because each
    one's router pushes autoscaling metrics on a timer, and a push after ``ray.shutdown()`` would
    connect Ray again (Ray's auto-init).
    """
    import ray
    from ray.serve import context

    client = context._global_client  # Serve's handles of this driver are cached on it
    if client is not None and ray.is_initialized():
        client.shutdown_cached_handles()
    context._disconnect()
    ray.shutdown()
