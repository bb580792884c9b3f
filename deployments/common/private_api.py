"""The private Ray names the project needs, in one place (checked against Ray 2.60).

Ray has no public API for these: the namespace Serve names its actors in, its key-value store in
the GCS, and the checks ``ray up`` runs on a cluster config before it touches a machine (the
tests compare our configs with them). ``tests/test_private_api.py`` fails when one behaves
differently in a newer Ray; nothing else in the repository may use a private Ray name (the torch
ones are ``moe_runtime.private_api``'s). Ray's modules are imported where used, so importing this
costs nothing.
"""

from __future__ import annotations

from typing import Any

# Serve's actors (controller, replicas) are named in it; `serve run` connects with it.
SERVE_NAMESPACE = "serve"


def kv_put(key: str, value: str, namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_get(key: str, namespace: str) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=namespace)


def kv_keys(prefix: str, namespace: str) -> list[str]:
    from ray.experimental import internal_kv

    return [k.decode() if isinstance(k, bytes) else k
            for k in internal_kv._internal_kv_list(prefix, namespace=namespace)]


def kv_delete(key: str, namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=namespace)


def prepare_cluster_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as ``ray up`` prepares it before touching a machine (provider defaults, the local
    provider's node-type rewrite, docker checks), validated by Ray's own launcher."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


def docker_command_runner(**kwargs: Any) -> Any:
    """Ray's launcher's ``DockerCommandRunner`` (what ``ray up`` starts a node's container with)."""
    from ray.autoscaler._private.command_runner import DockerCommandRunner

    return DockerCommandRunner(**kwargs)


def deployment_id(name: str, app_name: str) -> Any:
    """Serve's ``DeploymentID`` (public ``ReplicaID``s and autoscaling contexts are built on it)."""
    from ray.serve._private.common import DeploymentID

    return DeploymentID(name=name, app_name=app_name)


def ray_logs_dir() -> str:
    """The logs folder of the Ray instance this process is connected to."""
    import ray

    return ray._private.worker.global_worker.node.get_logs_dir_path()
