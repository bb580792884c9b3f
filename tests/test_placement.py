"""Where TP groups run (``accelerator``), and apps Ray could never place refused at build time.

The accelerator choice and the placement check on hand-made cluster views, and the view
``serve run`` gets before it has started Ray (this machine, ``RAY_OVERRIDE_RESOURCES``), on
which an explicit ``gpu`` deployment is refused at once with the missing resources and the
command that provides them. That ``serve run`` with no Ray running and no GPU serves on CPU
ranks (it used to wait forever for GPU bundles) is tests/test_serve_cli.py's local-config test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import ray
import torch
import yaml

from deployments.cluster.live_view import current_cluster_view
from deployments.config.spec import AppArgs, DeploymentSpec
from deployments.control.accelerator import Accelerator, decide_accelerator
from deployments.control.capacity import check_placeable
from deployments.control.cluster_view import ClusterView, NodeType
from deployments.control.launcher import launcher_node_types
from deployments.control.serve_options import placement_bundles, worker_resources

ROOT = Path(__file__).resolve().parents[1]
MI300X = "accelerator_type:AMD-Instinct-MI300X-OAM"
CPU_ONLY = ClusterView("a 2-CPU test cluster", ({"CPU": 2.0},))


def app(**fields) -> AppArgs:
    return AppArgs.model_validate({"checkpoint": "unused", "tp_size": 2, **fields})


def place_app(args: AppArgs, view: ClusterView) -> dict[str, Accelerator]:
    """The controller's accelerator decision of every deployment, then the placement check."""
    accelerators = {spec.name: decide_accelerator(spec, view) for spec in args.deployments}
    check_placeable(args, view, accelerators)
    return accelerators


def choose_accelerator(spec: DeploymentSpec, view: ClusterView | None) -> tuple[str, str]:
    decision = decide_accelerator(spec, view)
    return decision.layout, decision.reason


# -- pure: the choice and the check ----------------------------------------------------------


def test_auto_is_cpu_without_gpus_and_sizes_cpu_bundles():
    args = app()
    (decision,) = place_app(args, CPU_ONLY).values()
    assert (decision.layout, decision.compute) == ("cpu", "cpu")
    assert "has no GPU and no node type the launcher can add has one" in decision.reason
    # 1 replica CPU + 2 ranks x 0.25: a TP-2 group fits a 2-core machine, next to the ingress.
    (spec,) = args.deployments
    assert placement_bundles(spec, decision.layout) == [{"CPU": 1.0}, {"CPU": 0.25}, {"CPU": 0.25}]
    assert worker_resources(spec, decision.layout) == {"num_cpus": 0.25, "num_gpus": 0, "resources": {}}


@pytest.mark.parametrize(
    ("view", "choice", "why"),
    [
        (ClusterView("c", ({"CPU": 4, "GPU": 2},)), "gpu", "has 2 GPU(s)"),
        (ClusterView("c", ({"CPU": 4},), (NodeType("mi300x", {"CPU": 96, "GPU": 8}, 2),)), "gpu",
         "the launcher can add node type 'mi300x' with 8 GPU(s)"),
        (ClusterView("c", ({"CPU": 4},), (NodeType("mi300x", {"CPU": 96, "GPU": 8}, 0),)), "cpu", "no GPU"),
        (None, "gpu", "no cluster view was given"),
    ],
)
def test_auto_choice(view, choice, why):
    got, reason = choose_accelerator(DeploymentSpec(tp_size=2), view)
    assert got == choice and why in reason


def test_explicit_choice_is_kept():
    assert choose_accelerator(DeploymentSpec(accelerator="cpu"), ClusterView("c", ({"GPU": 8},)))[0] == "cpu"
    with pytest.raises(ValueError, match="accelerator 'cpu' runs the ranks on CPU bundles, but accelerator_type"):
        DeploymentSpec(accelerator="cpu", accelerator_type="AMD-Instinct-MI300X-OAM")


def test_gpu_on_a_cpu_only_cluster_names_what_is_missing_and_the_command():
    with pytest.raises(ValueError) as e:
        place_app(app(accelerator="gpu"), CPU_ONLY)
    message = str(e.value)
    assert "deployment 'moe' cannot be placed" in message
    assert "one node with {CPU: 1, GPU: 2}" in message and "missing {GPU: 2}" in message
    assert "`ray start --head --num-cpus 2 --num-gpus 2`" in message
    assert "accelerator=cpu" in message


def test_missing_accelerator_type_and_cpus():
    view = ClusterView("c", ({"CPU": 16, "GPU": 8},))
    with pytest.raises(ValueError, match=rf"missing \{{{MI300X}: 0.008\}}.*ray up cluster.yaml"):
        place_app(app(tp_size=8, accelerator="gpu", accelerator_type="AMD-Instinct-MI300X-OAM"), view)
    with pytest.raises(ValueError, match=r"missing \{CPU: 1\}.*lower replica_cpus / worker_cpus"):
        place_app(app(accelerator="cpu", replica_cpus=2.5), CPU_ONLY)


def test_a_node_the_launcher_can_add_makes_it_placeable():
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    view = ClusterView("c", ({"CPU": 16.0},), tuple(launcher_node_types(cluster)))
    decisions = place_app(app(tp_size=8, accelerator_type="AMD-Instinct-MI300X-OAM", replica_cpus=2), view)
    assert (decisions["moe"].layout, decisions["moe"].compute) == ("gpu", "gpu")


def test_launcher_totals_count_live_nodes_once():
    # cluster.yaml: up to 4 MI300X workers (one already up) besides the CPU head.
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    worker = {"CPU": 96.0, "GPU": 8.0, MI300X: 1.0}
    view = ClusterView("c", ({"CPU": 16.0}, worker), tuple(launcher_node_types(cluster)))
    assert view.totals() == {"CPU": 16 + 4 * 96, "GPU": 4 * 8, MI300X: 4}
    args = yaml.safe_load((ROOT / "deployments/configs/mi300x.yaml").read_text())["applications"][0]["args"]
    place_app(AppArgs.model_validate({**args, "checkpoint": "unused"}), view)  # 3 groups of 8 fit
    args["autoscaling"] = {**args["autoscaling"], "min_replicas": 2, "max_replicas": 2}
    with pytest.raises(ValueError, match=r"need GPU 48 \(layers-01-31 2 x 8 \+ layers-32-62 2 x 8 \+ layers-63-92 2 x 8\), but c has at most 32"):
        place_app(AppArgs.model_validate({**args, "checkpoint": "unused"}), view)


def test_minimums_must_fit_the_cluster_total():
    view = ClusterView("c", ({"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 2}))
    two = [{"name": "a", "num_replicas": 2}, {"name": "b", "autoscaling": {"min_replicas": 1, "max_replicas": 3}}]
    with pytest.raises(ValueError, match=r"minimum replicas need GPU 6 \(a 2 x 2 \+ b 1 x 2\), but c has at most 4"):
        place_app(app(deployments=two), view)
    place_app(app(deployments=two[1:]), view)


@pytest.mark.ray
def test_view_before_serve_run_starts_ray(monkeypatch, tiny_ckpt):
    # `serve run <import path>` builds the app before ray.init: the builder makes that same
    # connection (here RAY_ADDRESS=local: a fresh instance with this machine's resources, as Ray
    # detects them) through the public API, and serve run then keeps using it.
    assert not ray.is_initialized()  # conftest stopped the shared instance (OWN_RAY_MODULES)
    monkeypatch.setenv("RAY_ADDRESS", "local")
    monkeypatch.delenv("RAY_OVERRIDE_RESOURCES", raising=False)
    try:
        view = current_cluster_view()
        assert ray.is_initialized() and view.fresh_local and view.nodes[0]["CPU"] >= 1
        if not torch.cuda.is_available():
            assert view.gpus() == 0 and choose_accelerator(DeploymentSpec(), view)[0] == "cpu"
            # An explicit GPU layout this Ray cannot hold is refused at build time: nothing waits.
            from deployments.app import build_app

            bare = {"checkpoint": str(tiny_ckpt), "tp_size": 2, "tail": "sharded", "dtype": "float32"}
            with pytest.raises(ValueError, match=r"missing \{GPU: 2\}.*ray start --head --num-cpus 2 --num-gpus 2"):
                build_app({**bare, "accelerator": "gpu"})
    finally:
        ray.shutdown()
    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", json.dumps({"GPU": 2}))
    try:
        view = current_cluster_view()
        assert view.gpus() == 2  # logical GPUs, as tests/test_serve_cli.py gives them
        # ... which carry no accelerator_type: GPU bundles, CPU compute (and the CPU memory budget).
        decision = decide_accelerator(DeploymentSpec(), view)
        assert (decision.layout, decision.compute) == ("gpu", "cpu") and "logical" in decision.reason
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
