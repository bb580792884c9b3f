"""A simulated multi-node MI300X cluster on one machine: deploy, load, scale across nodes and back.

    python scripts/sim_cluster.py                       # ~2-3 minutes on 2 cores
    python scripts/sim_cluster.py --remove-node         # also lose a node and recover

Starts a local multi-node Ray (``ray.cluster_utils.Cluster``): a head with CPUs only (Serve's
controller, the HTTP proxy, the ingress) and ``--nodes`` "MI300X" nodes of ``--gpus-per-node``
*logical* GPUs each, declaring ``accelerator_type:AMD-Instinct-MI300X-OAM`` as cluster.yaml's
nodes do. It deploys ``deployments/configs/two_tier.yaml`` (decode: TP 2, tail auto; prefill:
TP 2, sequence parallel) pinned to that accelerator, with the tiny checkpoint (generated when
missing), then

1. drives the decode tier over HTTP on 127.0.0.1 until the token-aware autoscaler has scaled it
   to its maximum (or ``--load-s`` runs out), printing where every replica's TP group lives;
2. goes quiet until it is back at its minimum (or ``--quiet-s`` runs out);
3. with ``--remove-node``: removes the node of a decode replica and waits for the replica to
   come back on the remaining capacity, then checks that requests succeed again;

and shuts everything down. Every wait is bounded; the exit status is 0 when each phase reached
its goal.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

import ray
import torch
import yaml
from bench import ROOT
from bench.harness import CHECKPOINTS, deploy, ensure_checkpoint
from ray import serve
from ray.cluster_utils import Cluster

from deployments.client import AsyncHTTPMoEClient, HTTPMoEClient, MoEServeError
from deployments.cluster.local import leave_ray
from deployments.cluster.observe import tp_group_placement
from deployments.control.launcher import MI300X_RESOURCE
from moe_runtime.synthetic import preset_config
from moe_runtime.tp.collectives import free_port

CONFIG = ROOT / "deployments" / "configs" / "two_tier.yaml"
ACCELERATOR = MI300X_RESOURCE.split(":", 1)[1]
APP = "sim"


def start_cluster(
    nodes: int, gpus_per_node: int, cpus_per_node: float, head_cpus: float
) -> tuple[Cluster, list]:
    """Head (CPUs only) + ``nodes`` MI300X nodes; ``ray.init`` connected to it."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "num_gpus": 0,
                                                            "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node,
                                resources={MI300X_RESOURCE: gpus_per_node}) for _ in range(nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="sim_cluster", log_to_driver=False)
    return cluster, workers


def app_args(checkpoint: Path, config: Path = CONFIG) -> dict[str, Any]:
    """The config's app args with an absolute checkpoint and the MI300X pin."""
    raw = yaml.safe_load(config.read_text())
    args = dict(raw["applications"][0]["args"])
    args["checkpoint"] = str(checkpoint)
    args["accelerator_type"] = ACCELERATOR
    return args


def node_labels(cluster: Cluster, workers: list) -> dict[str, str]:
    labels = {cluster.head_node.node_id: "head"}
    labels.update({node.node_id: f"mi300x-{i + 1}" for i, node in enumerate(workers)})
    return labels


def replica_states(deployment: str) -> dict[str, int]:
    app = serve.status().applications.get(APP)
    if app is None or deployment not in app.deployments:
        return {}
    states = app.deployments[deployment].replica_states
    return {str(getattr(k, "value", k)): v for k, v in states.items() if v}


def running(deployment: str) -> int:
    return replica_states(deployment).get("RUNNING", 0)


def describe(labels: dict[str, str]) -> str:
    """One line per deployment: replica -> node of each rank (a TP group never spans nodes)."""
    lines = []
    # A rank busy starting (loading its shard) answers late: shown as "starting".
    placement = tp_group_placement(timeout_s=3.0)
    for deployment in ("decode", "prefill"):
        groups = []
        for replica, info in placement.items():
            if info["deployment"] == deployment:
                where = sorted({labels.get(n, "?") if n else "starting" for n in info["nodes"]})
                groups.append(f"{replica[:6]}@{'+'.join(where)}")
        lines.append(f"  {deployment:8s} {replica_states(deployment)}  groups: {', '.join(groups) or '-'}")
    return "\n".join(lines)


async def drive_load(url: str, hidden: int, concurrency: int, stop: asyncio.Event) -> tuple[int, int]:
    """``concurrency`` closed loops of decode-sized requests until ``stop``; (ok, failed)."""
    ok = failed = 0

    async def loop(i: int) -> None:
        nonlocal ok, failed
        gen = torch.Generator().manual_seed(i)
        async with AsyncHTTPMoEClient(url, deployment="decode", timeout_s=60) as client:
            while not stop.is_set():
                x = torch.randn(int(torch.randint(8, 33, (1,), generator=gen)), hidden, generator=gen)
                try:
                    await client.forward(x, 1)
                    ok += 1
                except MoEServeError:
                    failed += 1
                    await asyncio.sleep(0.2)

    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    return ok, failed


async def watch(labels: dict[str, str], until, deadline_s: float, every_s: float = 3.0) -> bool:
    """Print the placement every ``every_s`` until ``until()`` or the deadline; True if reached."""
    start = time.monotonic()
    reached = False
    while time.monotonic() - start < deadline_s:
        text = await asyncio.to_thread(describe, labels)
        print(f"[t+{time.monotonic() - start:5.1f} s]\n{text}", flush=True)
        if await asyncio.to_thread(until):
            reached = True
            break
        await asyncio.sleep(every_s)
    return reached


async def load_phase(url: str, labels, hidden: int, args, bounds) -> bool:
    stop = asyncio.Event()
    load = asyncio.create_task(drive_load(url, hidden, args.concurrency, stop))
    try:
        reached = await watch(labels, lambda: running("decode") >= bounds["max_replicas"], args.load_s)
        if reached:
            await asyncio.sleep(2)  # a last look with every replica serving
            print(await asyncio.to_thread(describe, labels), flush=True)
    finally:
        stop.set()
        ok, failed = await load
    print(f"load: {ok} requests answered, {failed} failed", flush=True)
    return reached


def serve_once(url: str, hidden: int, attempts_s: float = 60.0) -> bool:
    deadline = time.monotonic() + attempts_s
    with HTTPMoEClient(url, deployment="decode", timeout_s=30) as client:
        while time.monotonic() < deadline:
            try:
                client.forward(torch.randn(4, hidden), 1)
                return True
            except MoEServeError:
                time.sleep(1)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=4)
    ap.add_argument("--cpus-per-node", type=float, default=2.0, help="logical CPUs of each MI300X node")
    ap.add_argument("--checkpoint", type=Path, default=CHECKPOINTS / "tiny")
    ap.add_argument("--concurrency", type=int, default=12, help="closed-loop HTTP clients during the load")
    ap.add_argument("--load-s", type=float, default=90.0, help="bound of the load phase")
    ap.add_argument("--quiet-s", type=float, default=60.0, help="bound of the quiet phase")
    ap.add_argument("--remove-node", action="store_true", help="then remove a node and recover")
    args = ap.parse_args(argv)

    os.chdir(ROOT)  # Ray workers import the project from the driver's working directory
    checkpoint = ensure_checkpoint(args.checkpoint.resolve(), "tiny")
    hidden = preset_config("tiny")["hidden_size"]
    spec_args = app_args(checkpoint)
    decode = next(d for d in spec_args["deployments"] if d["name"] == "decode")
    bounds = decode["autoscaling"]
    t0 = time.monotonic()
    cluster, workers = start_cluster(args.nodes, args.gpus_per_node, args.cpus_per_node, head_cpus=2)
    labels = node_labels(cluster, workers)
    results: dict[str, bool] = {}
    try:
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        print(f"cluster up: head + {args.nodes} MI300X node(s) x {args.gpus_per_node} logical GPUs; "
              f"deploying {CONFIG.relative_to(ROOT)}", flush=True)
        deploy(spec_args, APP)
        with HTTPMoEClient(url, timeout_s=30) as client:
            for name, status in client.status()["deployments"].items():
                ctl = status.get("controller", {})
                print(f"controller: {name}: {ctl.get('choice')} ({ctl.get('reason')})", flush=True)
        print(describe(labels), flush=True)

        print(f"\n== load: {args.concurrency} HTTP clients on decode until {bounds['max_replicas']} replicas",
              flush=True)
        results["scaled up"] = asyncio.run(load_phase(url, labels, hidden, args, bounds))

        print(f"\n== quiet: until decode is back at {bounds['min_replicas']} replica(s)", flush=True)
        results["scaled down"] = asyncio.run(watch(
            labels, lambda: replica_states("decode") == {"RUNNING": bounds["min_replicas"]}, args.quiet_s))

        if args.remove_node:
            placement = tp_group_placement("decode")
            node_id = next(n for info in placement.values() for n in info["nodes"] if n)
            victim = next(w for w in workers if w.node_id == node_id)
            print(f"\n== removing {labels[node_id]} (it hosts a decode TP group)", flush=True)
            cluster.remove_node(victim)

            def recovered() -> bool:
                nodes = [info["nodes"] for info in tp_group_placement("decode").values()]
                return running("decode") >= 1 and bool(nodes) and all(
                    None not in ranks and node_id not in ranks for ranks in nodes)

            results["recovered"] = asyncio.run(watch(labels, recovered, 120.0)) and serve_once(url, hidden)
    finally:
        leave_ray()  # the cluster's end stops Serve with it
        cluster.shutdown()
    print(f"\ndone in {time.monotonic() - t0:.0f} s: " + ", ".join(f"{k}: {'yes' if v else 'NO'}"
                                                               for k, v in results.items()), flush=True)
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
