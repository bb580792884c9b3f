"""TP groups on a local multi-node Ray cluster: placement, autoscaling across nodes, node loss.

``ray.cluster_utils.Cluster``: a head with CPUs only (Serve's controller and proxy) and two
"MI300X" nodes of 4 *logical* GPUs each, declaring the accelerator resource as cluster.yaml's
nodes do. One deployment, TP 2 (so at most 2 groups per node), tiny checkpoint, pinned to
the MI300X resource, token-aware autoscaling between 1 and 3 replicas with short delays.

The tests run in file order on one app (starting a cluster and TP groups dominates the time
on a 2-core machine): one replica on one GPU node -> load scales it to 3, which cannot fit
on one node -> quiet scales it back to 1 -> the node of that replica is removed and the
replica comes back on the other node. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import ray
import torch
from conftest import TEST_APP
from ray import serve
from ray.cluster_utils import Cluster
from waiting import wait_until

from deployments.app import build_app
from deployments.client import MoEClient
from deployments.cluster.local import leave_ray
from deployments.cluster.observe import tp_group_placement
from deployments.control.autoscaling import OPEN_SESSIONS, QUEUED_TOKENS, TOKENS_PER_S
from deployments.control.launcher import MI300X_RESOURCE
from moe_runtime.checkpoint import load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import moe_forward
from moe_runtime.tp.collectives import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "multinode"
DEPLOYMENT = "moe"
GPUS_PER_NODE = 4
TP = 2
MAX_REPLICAS = 3  # more than one node can host (4 GPUs / TP 2 = 2 groups)
SCALE_UP_BOUND_S = 120.0
SCALE_DOWN_BOUND_S = 60.0
RECOVERY_BOUND_S = 120.0
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}  # TP 2 reduction order only (see test_serve.py)


@pytest.fixture(scope="module")
def sim(tiny_ckpt):
    # This module's Ray: a cluster of simulated nodes (conftest stopped the shared one).
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "num_gpus": 0, "include_dashboard": False})
    try:
        # Logical CPUs may exceed the physical ones: each node hosts 2 replicas of 0.5 CPU.
        nodes = [cluster.add_node(num_cpus=2, num_gpus=GPUS_PER_NODE,
                                  resources={MI300X_RESOURCE: GPUS_PER_NODE}) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="multinode_test", log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        args = {
            "checkpoint": str(tiny_ckpt), **TEST_APP, "name": DEPLOYMENT, "tp_size": TP, "tail": "sharded",
            "accelerator_type": MI300X_RESOURCE.split(":", 1)[1], "replica_cpus": 0.5,
            "max_batch_tokens": 64, "max_tokens_per_request": 256, "batch_wait_timeout_s": 0.002,
            "collective_timeout_s": 10, "call_margin_s": 10, "health_check_period_s": 1,
            "graceful_shutdown_timeout_s": 1,
            "autoscaling": {
                "min_replicas": 1, "max_replicas": MAX_REPLICAS, "initial_replicas": 1,
                "target_ongoing_requests": 2, "target_queued_tokens_per_replica": 16,
                "upscale_delay_s": 0, "downscale_delay_s": 3, "look_back_period_s": 2,
                "metrics_interval_s": 0.5,
            },
        }
        serve.run(build_app(args), name=APP, route_prefix="/")
        cfg = LatentMoEConfig.from_pretrained(tiny_ckpt)
        yield SimpleNamespace(
            cluster=cluster, nodes=nodes, gpu_node_ids={n.node_id for n in nodes},
            head_id=cluster.head_node.node_id, cfg=cfg,
            weights=load_layer_weights(tiny_ckpt, cfg, 1, torch.float32),
            client=MoEClient.direct(DEPLOYMENT, APP, timeout_s=60),
        )
    finally:
        leave_ray()  # the cluster's end stops Serve with it
        cluster.shutdown()


def replica_states() -> dict[str, int]:
    states = serve.status().applications[APP].deployments[DEPLOYMENT].replica_states
    return {str(getattr(k, "value", k)): v for k, v in states.items() if v}


def groups() -> list[list[str | None]]:
    """Node id of every rank, per live TP group of the deployment."""
    return [info["nodes"] for info in tp_group_placement(DEPLOYMENT).values()]


def wait_for(what: str, condition: Callable[[], bool], bound_s: float, every_s: float = 1.0) -> None:
    wait_until(condition, timeout_s=bound_s, every_s=every_s,
               what=lambda: f"{what} (replicas {replica_states()}, groups {groups()})")


def check_forward(sim, T: int = 9, seed: int = 0) -> None:
    x = torch.randn(T, sim.cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(sim.client.forward(x, 1), moe_forward(x, sim.weights, sim.cfg), **FP32_TOL)


class Load:
    """Closed-loop concurrent requests from a background thread until stopped (bounded)."""

    def __init__(self, sim, concurrency: int = 8, tokens: int = 32):
        self.sim, self.concurrency, self.tokens = sim, concurrency, tokens
        self.stop, self.ok, self.errors = threading.Event(), 0, []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async def loop(i: int) -> None:
            x = torch.randn(self.tokens, self.sim.cfg.hidden_size, generator=torch.Generator().manual_seed(i))
            while not self.stop.is_set():
                try:
                    await self.sim.client.forward_async(x, 1)
                    self.ok += 1
                except Exception as e:  # noted and retried: the test asserts on the count
                    self.errors.append(repr(e))
                    await asyncio.sleep(0.2)  # a loop's back-off before it retries, not a wait

        await asyncio.gather(*(loop(i) for i in range(self.concurrency)))

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=90)
        assert not self.thread.is_alive(), "load loops did not stop"


def test_one_replica_one_gpu_node(sim):
    placement = groups()
    assert len(placement) == 1 and len(placement[0]) == TP
    (node,) = set(placement[0])  # every rank on one node
    assert node in sim.gpu_node_ids and node != sim.head_id
    status = sim.client.status()
    assert [w["node_id"] for w in status["workers"]] == placement[0]  # status() tells the same
    assert status["controller"]["autoscaling_config"]["max_replicas"] == MAX_REPLICAS
    check_forward(sim)
    # What the token-aware policy is fed: nothing queued now, the forward's tokens in the rate.
    stats = sim.client.handle.record_autoscaling_stats.remote().result(timeout_s=30)
    assert set(stats) == {QUEUED_TOKENS, TOKENS_PER_S, OPEN_SESSIONS}
    assert stats[QUEUED_TOKENS] == 0 and stats[TOKENS_PER_S] > 0 and stats[OPEN_SESSIONS] == 0


def test_load_scales_up_across_nodes_and_quiet_scales_down(sim):
    with Load(sim) as load:
        wait_for(f"{MAX_REPLICAS} running replicas under load",
                 lambda: replica_states().get("RUNNING", 0) == MAX_REPLICAS, SCALE_UP_BOUND_S)
        placement = groups()
        check_forward(sim, T=17, seed=1)
    assert load.ok > 0
    assert len(placement) == MAX_REPLICAS
    for nodes in placement:  # a TP group never spans nodes, never lands on the head
        assert len(set(nodes)) == 1 and nodes[0] in sim.gpu_node_ids, placement
    per_node = Counter(nodes[0] for nodes in placement)
    # Three groups of 2 GPUs do not fit one node of 4: they spread over both.
    assert sorted(per_node.values()) == [1, 2], per_node

    wait_for("back to 1 replica when quiet", lambda: replica_states() == {"RUNNING": 1}, SCALE_DOWN_BOUND_S)
    wait_for("the stopped groups' workers gone", lambda: len(groups()) == 1, 30)
    check_forward(sim, T=5, seed=2)


def test_removed_node_replica_comes_back_on_the_other_node(sim):
    (nodes,) = groups()
    lost = nodes[0]
    victim = next(n for n in sim.nodes if n.node_id == lost)
    survivor = (sim.gpu_node_ids - {lost}).pop()
    sim.cluster.remove_node(victim)

    def back() -> bool:
        placement = groups()
        return (replica_states() == {"RUNNING": 1} and len(placement) == 1
                and set(placement[0]) == {survivor})

    wait_for("the replica back on the surviving node", back, RECOVERY_BOUND_S)

    def forwards() -> bool:
        check_forward(sim, T=33, seed=3)
        return True

    # Any error counts as "not yet": the handle may need a moment to drop the dead replica.
    wait_until(forwards, timeout_s=30, what="a correct forward after the node's removal", every_s=1,
               ignoring=(Exception,))
