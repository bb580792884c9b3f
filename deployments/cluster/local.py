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
    on a CPU machine. ``ray_args`` go to ``ray.init``. Stopping the instance stops Serve with it;
    ``serve.shutdown()`` first would have the controller's clients retry their calls on actors it
    kills, and Ray log a "listen_for_change failed" line for each.
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
        ray.shutdown()
