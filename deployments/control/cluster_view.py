"""What a cluster offers, as plain data: the nodes alive now and the node types a cluster
launcher may add. ``deployments.cluster.live_view`` fills it from a live Ray cluster; tests and the
launcher configs build it by hand. Pure: no Ray."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Resources = dict[str, float]
# Ray's bookkeeping resources, never asked for by a deployment.
_IGNORED = ("memory", "object_store_memory", "node:")


def clean_resources(resources: Mapping[str, Any]) -> Resources:
    return {k: float(v) for k, v in resources.items() if not k.startswith(_IGNORED)}


@dataclass(frozen=True)
class NodeType:
    """Per-node resources of a node type the launcher may add, and how many at most."""

    name: str
    resources: Mapping[str, float]
    max_nodes: int


@dataclass(frozen=True)
class ClusterView:
    """The nodes a deployment can be placed on: those alive now and those the launcher may add."""

    source: str  # what was inspected, for messages
    nodes: tuple[Mapping[str, float], ...]
    addable: tuple[NodeType, ...] = ()
    fresh_local: bool = False  # the local instance `serve run` / `serve.run` will start

    def gpus(self) -> float:
        return sum(n.get("GPU", 0) for n in self.nodes)

    def addable_gpu_types(self) -> list[NodeType]:
        return [t for t in self.addable if t.resources.get("GPU", 0) > 0 and t.max_nodes > 0]

    def candidates(self) -> list[Mapping[str, float]]:
        """Every node shape a placement group could land on."""
        return [*self.nodes, *(t.resources for t in self.addable if t.max_nodes > 0)]

    def accelerator_types(self) -> list[str]:
        """``accelerator_type:*`` resources of GPU nodes, now or addable: Ray sets one on nodes with
        real GPUs (and launcher configs declare it); logical ``--num-gpus`` nodes have none."""
        shapes = [n for n in self.candidates() if n.get("GPU", 0) > 0]
        return sorted({k for n in shapes for k in n if k.startswith("accelerator_type:")})

    def totals(self) -> Resources:
        """Per resource: what the cluster holds at most, now or once the launcher has added every
        node it may. A node type's maximum includes its nodes already up, so live nodes of a
        launcher shape are not counted twice; the others (the head) are added to it."""
        def add(into: Resources, node: Mapping[str, float], times: float = 1) -> None:
            for k, v in node.items():
                into[k] = into.get(k, 0) + v * times

        live: Resources = {}
        launched: Resources = {}
        shapes = [dict(t.resources) for t in self.addable]
        for node in self.nodes:
            add(live, node)
            if self.addable and not any(node.get("GPU", 0) == s.get("GPU", 0) for s in shapes):
                add(launched, node)
        for t in self.addable:
            add(launched, t.resources, t.max_nodes)
        return {k: max(live.get(k, 0), launched.get(k, 0)) for k in {*live, *launched}}
