"""The Ray cluster as the app builder sees it, read through Ray's public API.

``serve run <import path>`` builds the app before it connects to Ray; it then calls
``ray.init`` only when nothing has yet (Ray 2.60 ``serve/scripts.py``). :func:`current_cluster_view`
therefore makes that same connection first — ``ray.init`` with ``RAY_ADDRESS``, else a running
local instance, else a fresh local one with this machine's resources — and reads the live nodes
with ``ray.nodes()``; ``serve run`` then keeps using it. Inside a running app (a config-file
``serve run`` / ``serve deploy`` builds in a Ray task) Ray is already connected. Whatever the
cluster's authentication, it is Ray's own connection, so the view works wherever Serve does; when
it truly cannot be read, the build fails with the reason instead of going on without it.

The node types a cluster launcher may add come from the deployments' ``cluster_config`` files
and, on a launcher-made head node, ``~/ray_bootstrap_config.yaml``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml

from ..common.private_api import SERVE_NAMESPACE
from ..config.spec import DeploymentSpec
from ..control.cluster_view import ClusterView, NodeType, clean_resources
from ..control.launcher import launcher_node_types, load_cluster_config

# The cluster launcher writes the filled-out config here on the head node.
BOOTSTRAP_CONFIG = Path("~/ray_bootstrap_config.yaml").expanduser()


def current_cluster_view(launcher_files: Iterable[str | Path] = ()) -> ClusterView:
    """The cluster the app will be deployed on, connecting to it as ``serve run`` would first.

    Raises RuntimeError naming the cause when Ray cannot be reached or its nodes not read.
    """
    import ray

    addable: list[NodeType] = []
    for path in launcher_files:
        addable.extend(launcher_node_types(load_cluster_config(path)))
    if not addable and BOOTSTRAP_CONFIG.is_file():  # filled out by the launcher: no schema check
        addable = launcher_node_types(yaml.safe_load(BOOTSTRAP_CONFIG.read_text()))
    requested = os.environ.get("RAY_ADDRESS")
    try:
        if not ray.is_initialized():
            ray.init(address=requested, namespace=SERVE_NAMESPACE)
        nodes = [clean_resources(n["Resources"]) for n in ray.nodes() if n["Alive"]]
        address = ray.get_runtime_context().gcs_address
    except (Exception, SystemExit) as e:  # ray.init exits the process when it cannot connect
        raise RuntimeError(
            f"cannot read the Ray cluster this app would run on (RAY_ADDRESS={requested!r}): "
            f"{type(e).__name__}: {e}"
        ) from e
    if not nodes:
        raise RuntimeError(f"the Ray cluster at {address} reports no live node")
    fresh = requested == "local"
    source = "the local Ray instance started for `serve run` on this machine" if fresh else \
        f"the Ray cluster at {address}"
    return ClusterView(source, tuple(nodes), tuple(addable), fresh_local=fresh)


def launcher_files(specs: Sequence[DeploymentSpec]) -> list[str]:
    """The distinct ``autoscaling.cluster_config`` files of ``specs``."""
    files = {s.autoscaling.cluster_config for s in specs if s.autoscaling and s.autoscaling.cluster_config}
    return sorted(files)
