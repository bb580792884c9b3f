"""Cluster-launcher configs (``cluster.yaml``, ``cluster.local.yaml``; DESIGN §5.4): validation
against Ray's schema, node types, and how many MI300X TP groups their nodes can host.

Pure: no Ray import and no Ray instance. Ray's launcher schema is read as a data file from the
installed ``ray`` distribution, without importing it.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .cluster_view import NodeType, clean_resources

MI300X_RESOURCE = "accelerator_type:AMD-Instinct-MI300X-OAM"
# Ray's local provider replaces any node types with this single one (on-prem configs).
LOCAL_NODE_TYPE = "local.cluster.node"


@dataclass(frozen=True)
class NodeTypeCapacity:
    """What one node type of a cluster config offers to TP groups."""

    name: str
    gpus_per_node: int
    is_mi300x: bool  # declares the MI300X accelerator resource and has GPUs
    min_workers: int
    max_workers: int
    is_head: bool = False
    resources: Mapping[str, float] = field(default_factory=dict, compare=False)  # per node

    @property
    def max_nodes(self) -> int:
        # The head is one node of its type on top of the workers the launcher may add.
        return self.max_workers + int(self.is_head)


def ray_schema() -> dict[str, Any]:
    """The installed Ray's cluster-launcher schema (``ray/autoscaler/ray-schema.json``), read as a
    file of the distribution (``find_spec`` locates the package without importing it)."""
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("Ray is not installed here, so cluster-launcher configs cannot be validated")
    path = Path(next(iter(spec.submodule_search_locations))) / "autoscaler" / "ray-schema.json"
    return json.loads(path.read_text())


def validate_cluster_config(config: Any, source: str = "cluster config") -> None:
    """Raise ValueError unless ``config`` matches Ray's schema (and names its head type)."""
    if not isinstance(config, dict):
        raise ValueError(f"{source}: expected a YAML mapping, got {type(config).__name__}")
    try:
        jsonschema.validate(config, ray_schema())
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "<top level>"
        raise ValueError(f"{source}: invalid at {where}: {e.message}") from None
    # Ray's launcher checks this after the schema; failing here gives the same answer earlier.
    node_types = config.get("available_node_types")
    if node_types is not None and config.get("head_node_type") not in node_types:
        raise ValueError(
            f"{source}: head_node_type {config.get('head_node_type')!r} is not one of "
            f"available_node_types {sorted(node_types)}"
        )


def load_cluster_config(path: str | Path) -> dict[str, Any]:
    """Read a cluster-launcher YAML file and validate it (ValueError on a bad file)."""
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    validate_cluster_config(config, source=str(path))
    return config


def _is_mi300x(node_resources: dict[str, Any]) -> bool:
    return node_resources.get("GPU", 0) > 0 and node_resources.get(MI300X_RESOURCE, 0) > 0


def node_capacities(config: dict[str, Any]) -> list[NodeTypeCapacity]:
    """GPUs per node, MI300X or not, and min/max workers of every node type.

    On-prem (``provider.type == "local"``) configs have no node types: the workers are the
    listed ``worker_ips`` (capped by ``max_workers``, as Ray's local provider does) and their
    resources are read from ``metadata.worker_resources``.
    """
    if config["provider"]["type"] == "local" and "available_node_types" not in config:
        worker_resources = config.get("metadata", {}).get("worker_resources")
        if not isinstance(worker_resources, dict):
            raise ValueError(
                "an on-prem (local provider) config must record each worker's resources under "
                "metadata.worker_resources, e.g. {'GPU': 8, '" + MI300X_RESOURCE + "': 1}"
            )
        n = len(config["provider"].get("worker_ips", []))
        n = min(n, config.get("max_workers", n))
        return [NodeTypeCapacity(LOCAL_NODE_TYPE, int(worker_resources.get("GPU", 0)),
                                 _is_mi300x(worker_resources), n, n, resources=dict(worker_resources))]

    head = config.get("head_node_type")
    capacities = []
    for name, spec in config.get("available_node_types", {}).items():
        # Ray's defaults: a head type launches no extra workers, any other type is bounded
        # only by the global max_workers (whose own default depends on the provider).
        max_workers = spec.get("max_workers", 0 if name == head else config.get("max_workers"))
        if max_workers is None:
            raise ValueError(f"node type {name!r}: set its max_workers or the global max_workers")
        capacities.append(NodeTypeCapacity(
            name=name,
            gpus_per_node=int(spec["resources"].get("GPU", 0)),
            is_mi300x=_is_mi300x(spec["resources"]),
            min_workers=int(spec.get("min_workers", 0)),
            max_workers=int(max_workers),
            is_head=name == head,
            resources=dict(spec["resources"]),
        ))
    return capacities


def _mi300x_nodes(config: dict[str, Any], tp_size: int) -> list[tuple[NodeTypeCapacity, int]]:
    """MI300X node types and how many nodes of each the cluster may run, most groups per node first.

    The top-level ``max_workers`` caps the workers of all types together; when it binds, the
    node types hosting most TP groups of ``tp_size`` per node are counted first.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    mi300x = [c for c in node_capacities(config) if c.is_mi300x]
    if not mi300x:
        raise ValueError(f"no node type declares GPUs and the {MI300X_RESOURCE} resource")
    largest = max(mi300x, key=lambda c: c.gpus_per_node)
    if tp_size > largest.gpus_per_node:
        raise ValueError(
            f"a TP group of {tp_size} cannot fit on a node with {largest.gpus_per_node} GPUs "
            f"(node type {largest.name!r}, the largest MI300X node); a TP group never spans nodes"
        )
    workers_left = config.get("max_workers", math.inf)
    counted = []
    for c in sorted(mi300x, key=lambda c: c.gpus_per_node // tp_size, reverse=True):
        workers = min(c.max_workers, workers_left)
        workers_left -= workers
        counted.append((c, int(workers) + int(c.is_head)))
    return counted


def max_tp_groups(config: dict[str, Any], tp_size: int) -> int:
    """How many TP groups of ``tp_size`` GPUs the cluster's MI300X nodes can host at most.

    A TP group never spans nodes, so a node of G GPUs hosts floor(G / tp_size) groups, and
    the total is the sum over MI300X node types of max nodes x floor(G / tp_size) — the
    nodes the launcher may add included.
    """
    return sum(n * (c.gpus_per_node // tp_size) for c, n in _mi300x_nodes(config, tp_size))


def mi300x_gpus(config: dict[str, Any]) -> tuple[int, str]:
    """The cluster's MI300X GPUs at most (nodes the launcher may add included) and the sum spelled out."""
    counted = _mi300x_nodes(config, 1)
    gpus = sum(n * c.gpus_per_node for c, n in counted)
    return gpus, " + ".join(f"{n} {c.name} x {c.gpus_per_node}" for c, n in counted)


def launcher_node_types(config: Mapping[str, Any]) -> list[NodeType]:
    """Worker node types of a cluster-launcher config (the head is already a live node)."""
    return [NodeType(c.name, clean_resources(c.resources), c.max_workers)
            for c in node_capacities(dict(config)) if not c.is_head and c.max_workers > 0]
