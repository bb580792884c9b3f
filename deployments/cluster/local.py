"""A private Ray instance with Serve on this machine, for a process that serves by itself:
``scripts/run.sh``'s demo, the examples, the benchmarks and the tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def local_serve(num_cpus: int, num_gpus: int = 0, *, host: str = "127.0.0.1", port: int | None = None,
                **ray_args: Any) -> Iterator[int]:
    """Start a Ray instance of this process's own and Serve's HTTP proxy on ``host:port`` (a free
    port when None); yield the port, and stop both on the way out.

    ``address="local"``: never a ``ray start`` cluster found on the machine. The GPUs are logical
    on a CPU machine. ``ray_args`` go to ``ray.init``. Stopping the instance stops Serve with it
    (:func:`leave_ray`).
    """
    import ray
    from ray import serve

    from moe_runtime.tp.collectives import free_port

    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
             namespace="serve", log_to_driver=False, **ray_args)
    try:
        port = free_port() if port is None else port
        serve.start(http_options={"host": host, "port": port})
        yield port
    finally:
        leave_ray()


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
