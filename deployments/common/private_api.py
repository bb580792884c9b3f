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


def kv_put_new(key: str, value: str, namespace: str) -> bool:
    """Create ``key`` unless it exists (atomically, in the GCS): whether this call created it."""
    from ray.experimental import internal_kv

    existed = internal_kv._internal_kv_put(key, value, overwrite=False, namespace=namespace)
    return not existed


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


def serve_app_url(app_name: str) -> str:
    """The HTTP address of Serve app ``app_name`` (its proxy's host and port, and the app's route
    prefix); "" when Serve has no HTTP proxy or the app no route. A proxy bound to every address
    is named by this node's address."""
    import ray
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return ""
    details = client.get_serve_details()
    http, app = details.get("http_options") or {}, (details.get("applications") or {}).get(app_name) or {}
    host, port, prefix = http.get("host"), http.get("port"), app.get("route_prefix")
    if not host or not port or prefix is None:
        return ""
    if host in ("0.0.0.0", "::"):
        host = ray.util.get_node_ip_address()
    return f"http://{host}:{port}{(http.get('root_path') or '')}{prefix.rstrip('/')}"


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
