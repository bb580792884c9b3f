"""cluster.yaml / cluster.local.yaml against Ray's schema, and the TP-group capacity arithmetic."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from deployments.control.capacity import GroupDemand, Share, share_gpus
from deployments.control.launcher import (
    MI300X_RESOURCE,
    NodeTypeCapacity,
    load_cluster_config,
    max_tp_groups,
    mi300x_gpus,
    node_capacities,
    validate_cluster_config,
)

ROOT = Path(__file__).resolve().parents[1]
AZURE = ROOT / "cluster.yaml"
LOCAL = ROOT / "cluster.local.yaml"
WORKER = "ray.worker.mi300x"


@pytest.fixture(scope="module")
def azure() -> dict:
    return load_cluster_config(AZURE)


@pytest.fixture(scope="module")
def local() -> dict:
    return load_cluster_config(LOCAL)


def _config(*node_types: tuple[str, dict, int], max_workers: int | None = None) -> dict:
    """A minimal valid config: a CPU head plus (name, resources, max_workers) node types."""
    types = {"head": {"resources": {"CPU": 4, "GPU": 0}, "node_config": {}, "max_workers": 0}}
    for name, res, n in node_types:
        types[name] = {"resources": res, "node_config": {}, "min_workers": 0, "max_workers": n}
    config = {"cluster_name": "t", "provider": {"type": "azure"}, "head_node_type": "head",
              "available_node_types": types}
    if max_workers is not None:
        config["max_workers"] = max_workers
    validate_cluster_config(config)
    return config


def mi300x(gpus: int) -> dict:
    return {"CPU": 96, "GPU": gpus, MI300X_RESOURCE: gpus}


# --- the shipped files ------------------------------------------------------------------


def test_both_files_validate_against_ray_schema(azure: dict, local: dict) -> None:
    assert azure["provider"]["type"] == "azure"
    assert local["provider"]["type"] == "local"
    assert "available_node_types" not in local  # Ray's local provider would refuse them


@pytest.mark.parametrize("path", [AZURE, LOCAL])
def test_rays_own_launcher_checks_pass(path: Path) -> None:
    # What `ray up` runs before touching any machine: provider defaults, the local
    # provider's node-type rewrite, docker checks, then the schema (private Ray 2.60 API).
    from deployments.common.private_api import prepare_cluster_config

    prepare_cluster_config(load_cluster_config(path))


def test_azure_node_types(azure: dict) -> None:
    head = azure["available_node_types"][azure["head_node_type"]]
    worker = azure["available_node_types"][WORKER]
    assert head["resources"]["GPU"] == 0
    # Ray sets accelerator_type:<type> to 1 per node; GPUs are counted by "GPU".
    assert worker["resources"] == {"CPU": 96, "GPU": 8, MI300X_RESOURCE: 1}
    assert all(type(v) is int for v in worker["resources"].values())
    assert worker["node_config"]["azure_arm_parameters"]["vmSize"] == "Standard_ND96isr_MI300X_v5"
    assert azure["max_workers"] == sum(t.get("max_workers", 0) for t in azure["available_node_types"].values())


@pytest.mark.parametrize("path", [AZURE, LOCAL])
def test_rocm_container_and_start_commands(path: Path) -> None:
    config = load_cluster_config(path)
    docker = config["docker"]
    assert docker["image"].startswith("rocm/pytorch:rocm") and ":latest" not in docker["image"]
    assert docker["head_image"] == "rayproject/ray:2.60.0-py312-cpu"  # same Ray and Python as workers
    assert "py3.12" in docker["image"] and 'pip install "ray[default,serve]==2.60.0"' in config["setup_commands"]
    for opt in ["--device=/dev/kfd", "--device=/dev/dri", "--group-add video",
                "--cap-add=SYS_PTRACE", "--security-opt seccomp=unconfined"]:
        assert opt in docker["worker_run_options"]
        assert opt not in docker["run_options"]  # the CPU head has no /dev/kfd
    assert "--ipc=host" in docker["run_options"]
    assert any(o.startswith("--shm-size=") for o in docker["run_options"])
    head_start = " ".join(config["head_start_ray_commands"])
    worker_start = " ".join(config["worker_start_ray_commands"])
    assert "ray start --head" in head_start and "--num-gpus=0" in head_start
    assert "--address=$RAY_HEAD_IP:6379" in worker_start
    assert "--env=RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=0" in docker["run_options"]
    assert any('.[rocm]' in c for c in config["worker_setup_commands"])
    assert not any("usermod" in c and "setfacl" not in c for c in config.get("initialization_commands", []))


@pytest.mark.parametrize("path", [AZURE, LOCAL])
def test_worker_start_flags_match_declared_resources(path: Path) -> None:
    config = load_cluster_config(path)
    (worker,) = [c for c in node_capacities(config) if c.is_mi300x]
    start = " ".join(config["worker_start_ray_commands"])
    assert f"--num-gpus={worker.gpus_per_node}" in start
    flags = json.loads(re.search(r"--resources='([^']*)'", start).group(1))
    if "available_node_types" in config:
        declared = config["available_node_types"][worker.name]["resources"]
    else:
        declared = config["metadata"]["worker_resources"]
    assert flags[MI300X_RESOURCE] == declared[MI300X_RESOURCE]


# --- validation errors --------------------------------------------------------------------


def test_non_integer_resource_fails_with_schema_message(azure: dict) -> None:
    broken = copy.deepcopy(azure)
    broken["available_node_types"][WORKER]["resources"]["GPU"] = 8.5
    with pytest.raises(ValueError, match=rf"available_node_types/{WORKER}/resources/GPU: 8.5 is not of type 'integer'"):
        validate_cluster_config(broken)


def test_broken_file_fails_with_path_and_message(tmp_path: Path) -> None:
    text = AZURE.read_text().replace("idle_timeout_minutes: 20", "idle_timeout_minutes: 20\nmin_workerz: 1")
    bad = tmp_path / "cluster.yaml"
    bad.write_text(text)
    with pytest.raises(ValueError, match=r"cluster\.yaml: invalid at <top level>: Additional properties are not allowed \('min_workerz' was unexpected\)"):
        load_cluster_config(bad)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c.pop("provider"), "'provider' is a required property"),
        (lambda c: c.update(head_node_type="nope"), "head_node_type 'nope' is not one of"),
        (lambda c: c["available_node_types"][WORKER].pop("node_config"), "'node_config' is a required property"),
        (lambda c: c["docker"].update(run_option=[]), "Additional properties are not allowed"),
    ],
)
def test_other_schema_errors(azure: dict, mutate, message: str) -> None:
    broken = copy.deepcopy(azure)
    mutate(broken)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_cluster_config(broken)


def test_not_a_mapping_or_not_yaml(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected a YAML mapping, got list"):
        validate_cluster_config([1, 2])
    bad = tmp_path / "c.yaml"
    bad.write_text("cluster_name: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_cluster_config(bad)


# --- capacity -----------------------------------------------------------------------------


def test_capacity_summary(azure: dict) -> None:
    assert node_capacities(azure) == [
        NodeTypeCapacity("ray.head.cpu", 0, False, 0, 0, is_head=True),
        NodeTypeCapacity(WORKER, 8, True, 1, 4),
    ]


@pytest.mark.parametrize(("tp_size", "groups"), [(1, 32), (2, 16), (3, 8), (4, 8), (8, 4)])
def test_max_tp_groups_azure(azure: dict, tp_size: int, groups: int) -> None:
    # 4 nodes x floor(8 / tp_size)
    assert max_tp_groups(azure, tp_size) == groups


def test_tp_16_does_not_fit_an_8_gpu_node(azure: dict) -> None:
    with pytest.raises(ValueError, match="a TP group of 16 cannot fit on a node with 8 GPUs"):
        max_tp_groups(azure, 16)


def test_tp_8_does_not_fit_a_4_gpu_node() -> None:
    config = _config(("small", mi300x(4), 3))
    assert max_tp_groups(config, 4) == 3
    with pytest.raises(ValueError, match="a TP group of 8 cannot fit on a node with 4 GPUs"):
        max_tp_groups(config, 8)


def test_mixed_node_types_and_global_cap() -> None:
    types = [("big", mi300x(8), 2), ("small", mi300x(4), 3)]
    assert max_tp_groups(_config(*types), 4) == 2 * 2 + 3 * 1
    assert max_tp_groups(_config(*types), 8) == 2 * 1  # small nodes host no group of 8
    # max_workers 3 caps all types together: the 8-GPU nodes (2 groups each) count first.
    assert max_tp_groups(_config(*types, max_workers=3), 4) == 2 * 2 + 1 * 1


def test_only_mi300x_node_types_count() -> None:
    other_gpu = {"CPU": 32, "GPU": 8}  # GPUs, but no MI300X accelerator resource
    assert max_tp_groups(_config(("mi300x", mi300x(8), 1), ("other", other_gpu, 5)), 8) == 1
    with pytest.raises(ValueError, match="no node type declares GPUs"):
        max_tp_groups(_config(("other", other_gpu, 5)), 8)


def test_gpu_head_counts_as_one_node() -> None:
    config = _config(("w", mi300x(8), 2))
    config["available_node_types"]["head"]["resources"] = mi300x(8)
    assert max_tp_groups(config, 8) == 3


def test_max_workers_defaults_follow_ray() -> None:
    config = _config(("w", mi300x(8), 2), max_workers=3)
    del config["available_node_types"]["w"]["max_workers"]  # Ray: the global max_workers
    del config["available_node_types"]["head"]["max_workers"]  # Ray: 0 for the head type
    assert [c.max_workers for c in node_capacities(config)] == [0, 3]
    del config["max_workers"]
    with pytest.raises(ValueError, match="node type 'w': set its max_workers or the global max_workers"):
        node_capacities(config)


def test_bad_tp_size(azure: dict) -> None:
    with pytest.raises(ValueError, match="tp_size must be >= 1, got 0"):
        max_tp_groups(azure, 0)


def test_local_capacity(local: dict) -> None:
    assert node_capacities(local) == [NodeTypeCapacity("local.cluster.node", 8, True, 2, 2)]
    assert max_tp_groups(local, 8) == 2
    assert max_tp_groups(local, 2) == 8
    capped = {**local, "max_workers": 1}
    assert max_tp_groups(capped, 8) == 1


def test_local_needs_worker_resources(local: dict) -> None:
    config = copy.deepcopy(local)
    del config["metadata"]
    with pytest.raises(ValueError, match="metadata.worker_resources"):
        max_tp_groups(config, 8)



# --- the shared capacity budget of an app's deployments -------------------------------------


def demand(name: str, tp: int, low: int, high: int) -> GroupDemand:
    return GroupDemand(name, tp, low, high)


def test_budget_within_the_cluster_keeps_every_maximum(azure: dict) -> None:
    # 4 nodes x 8 = 32 GPUs; 2 x 8 + 2 x 8 = 32 fits exactly.
    assert mi300x_gpus(azure) == (32, "4 ray.worker.mi300x x 8")
    shares = share_gpus([demand("a", 8, 1, 2), demand("b", 8, 1, 2)], azure)
    assert shares == {"a": Share(2), "b": Share(2)}


def test_budget_clamps_maximums_with_the_reason(azure: dict) -> None:
    # Four TP-8 deployments, min 1 / max 2 each (the old mi300x.yaml): minimums take all 32 GPUs.
    shares = share_gpus([demand(n, 8, 1, 2) for n in "abcd"], azure)
    assert [s.max_replicas for s in shares.values()] == [1, 1, 1, 1]
    assert shares["a"].reason == (
        "max_replicas 2 -> 1: the app's deployments share the cluster's 32 MI300X GPUs (4 ray.worker.mi300x x 8); "
        "together their maximums ask 64 (a 2 x 8 + b 2 x 8 + c 2 x 8 + d 2 x 8), their minimums take 32, "
        "and the 0 GPUs left are shared in proportion to what each deployment may add")
    # a: max 5 capped to the 4 groups of 8 the nodes host. Minimums 2 x 8 + 2 x 2 = 20, 12 spare.
    # a may add 2 x 8 = 16 GPUs, b 8 x 2 = 16: half each, a floor(6 / 8) = 0 groups, b 6 / 2 = 3;
    # of the 6 left a group of 8 never fits, b takes 3 more: a 2, b 2 + 6 = 8, 32 GPUs in all.
    shares = share_gpus([demand("a", 8, 2, 5), demand("b", 2, 2, 10)], azure)
    assert (shares["a"].max_replicas, shares["b"].max_replicas) == (2, 8)
    assert "their minimums take 20, and the 12 GPUs left" in shares["b"].reason


def test_budget_refuses_minimums_that_do_not_fit(azure: dict) -> None:
    with pytest.raises(ValueError, match=re.escape(
            "the app's minimum TP groups need 40 GPUs (a 3 x 8 + b 2 x 8), but the cluster's MI300X nodes "
            "offer at most 32 (4 ray.worker.mi300x x 8, nodes the launcher may add included)")):
        share_gpus([demand("a", 8, 3, 3), demand("b", 8, 2, 4)], azure)


def test_budget_caps_each_deployment_at_the_groups_its_nodes_host(azure: dict) -> None:
    # TP 3 on 8-GPU nodes: 2 groups per node, 8 in all, whatever the GPU total says.
    shares = share_gpus([demand("odd", 3, 1, 20)], azure)
    assert shares["odd"] == Share(8, shares["odd"].reason)
    assert "the nodes host at most 8 TP groups of 3" in shares["odd"].reason


def test_decisions_share_one_budget_and_status_shows_the_clamp(azure: dict) -> None:
    from deployments.control.decide import decide
    from moe_runtime.synthetic import preset_config

    model = preset_config("kimi-k3")
    auto = {"min_replicas": 1, "max_replicas": 3, "cluster_config": str(AZURE)}
    specs = [{"name": n, "tp_size": 8, "layers": layers, "autoscaling": auto}
             for n, layers in (("lo", "1-40"), ("hi", "41-80"))]
    decisions = decide(specs, model)
    # 2 x 3 x 8 = 48 > 32: 16 spare GPUs, 16 wanted by each, 8 each = one more group each.
    assert [d.options["autoscaling_config"]["max_replicas"] for d in decisions.values()] == [2, 2]
    record = decisions["lo"].to_dict()
    assert record["cluster_capacity_tp_groups"] == 4  # alone it could have had 4
    assert record["capacity_share"].startswith("max_replicas 3 -> 2: the app's deployments share")
    with pytest.raises(ValueError, match=r"minimum TP groups need 48 GPUs \(lo 3 x 8 \+ hi 3 x 8\)"):
        decide([{**s, "autoscaling": {**auto, "min_replicas": 3}} for s in specs], model)


K3_LAYOUTS = [ROOT / "deployments/configs/mi300x.yaml"]  # the one MI300X Kimi-K3 config


@pytest.mark.parametrize("path", K3_LAYOUTS, ids=lambda p: p.name)
def test_shipped_k3_layouts_fit_the_budget_unclamped(path: Path) -> None:
    """The production layout fits cluster.yaml as written (no clamp)."""
    from deployments.config.spec import AppArgs
    from deployments.control.decide import decide
    from moe_runtime.synthetic import preset_config

    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    app = AppArgs.model_validate({**args, "checkpoint": "unused"})
    decisions = decide(app.deployments, preset_config("kimi-k3"), cluster=AZURE)
    total = 0
    for spec in app.deployments:
        d = decisions[spec.name]
        assert d.capacity.reason is None, d.capacity.reason
        auto = d.options.get("autoscaling_config")
        total += (auto["max_replicas"] if auto else d.options["num_replicas"]) * spec.tp_size
    assert total <= mi300x_gpus(load_cluster_config(AZURE))[0]


def test_cluster_config_paths_do_not_depend_on_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    from deployments.config.spec import AutoscalingSpec

    monkeypatch.chdir(tmp_path)  # Serve builds the app in a task whose cwd is not the repository
    assert AutoscalingSpec(cluster_config="cluster.yaml").cluster_config == str(AZURE)
    assert AutoscalingSpec(cluster_config=str(LOCAL)).cluster_config == str(LOCAL)
    with pytest.raises(ValueError, match=r"cluster_config 'nope.yaml': no file at .*nope.yaml \(relative paths are "
                                         r"resolved against the repository root"):
        AutoscalingSpec(cluster_config="nope.yaml")
