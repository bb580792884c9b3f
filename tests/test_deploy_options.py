"""Deployment options, argument validation and device choice: pure functions, no Ray cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from deployments.app import app_options
from deployments.config.spec import AppArgs, DeploymentSpec, parse_layers
from deployments.control.serve_options import (
    deployment_options,
    ingress_options,
    placement_bundles,
    worker_resources,
)
from deployments.serve.worker import pick_device
from moe_runtime.synthetic import preset_config, write_checkpoint
from moe_runtime.tp.collectives import threads_per_rank
from moe_runtime.units import format_layers

MI300X = "AMD-Instinct-MI300X-OAM"


@pytest.fixture(scope="module")
def k3_config_dir(tmp_path_factory):
    """The real Kimi-K3 config.json (no weights): build-time checks only read the config."""
    return write_checkpoint(tmp_path_factory.mktemp("k3"), preset_config("kimi-k3"), config_only=True)


@pytest.mark.parametrize("P", [1, 2, 8])
def test_bundles_strategy_and_resources(P):
    spec = DeploymentSpec(tp_size=P, replica_cpus=2)
    opts = deployment_options(spec, "gpu")
    assert opts["placement_group_bundles"] == [{"CPU": 2}] + [{"GPU": 1}] * P
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    # The replica sits in bundle 0 and asks for no GPU; its CPUs fit the bundle.
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0}
    assert opts["num_replicas"] == 1 and "autoscaling_config" not in opts
    assert opts["health_check_timeout_s"] > spec.collective_timeout_s
    assert opts["logging_config"] == {"enable_access_log": False}  # one line per call costs CPU
    # Each worker asks for exactly what its bundle {"GPU": 1} holds.
    assert worker_resources(spec, "gpu") == {"num_cpus": 0, "num_gpus": 1, "resources": {}}


@pytest.mark.parametrize("P", [1, 2, 8])
def test_accelerator_type_pins_every_gpu_bundle(P):
    spec = DeploymentSpec(tp_size=P, accelerator_type=MI300X)
    bundles = placement_bundles(spec, "gpu")
    assert len(bundles) == 1 + P and bundles[0] == {"CPU": 1.0}
    key = f"accelerator_type:{MI300X}"
    assert all(b == {"GPU": 1, key: 0.001} for b in bundles[1:])
    res = worker_resources(spec, "gpu")["resources"]
    assert res == {key: 0.001}  # fits inside its bundle


def test_autoscaling_bounds_use_the_token_policy():
    spec = DeploymentSpec(tp_size=8, autoscaling={"min_replicas": 1, "max_replicas": 6, "initial_replicas": 2})
    opts = deployment_options(spec, "gpu", max_replicas=4)
    cfg = opts["autoscaling_config"]
    assert "num_replicas" not in opts
    assert cfg["min_replicas"] == 1 and cfg["max_replicas"] == 4  # the capacity's bound (control.capacity)
    assert cfg["initial_replicas"] == 2 and cfg["target_ongoing_requests"] > 0
    assert cfg["policy"]["policy_function"] == "deployments.control.autoscaling:TokenAutoscalingPolicy"
    plain = deployment_options(DeploymentSpec(autoscaling={"max_replicas": 3, "token_aware": False}), "gpu")
    assert "policy" not in plain["autoscaling_config"]
    assert plain["autoscaling_config"]["target_ongoing_requests"] == 8.0


def test_serve_accepts_the_options():
    """Serve's own validation of every option we generate (no cluster needed)."""
    from ray.serve.config import AutoscalingConfig

    from deployments.serve.deployment import MoEGroup
    from deployments.serve.http import Ingress

    for spec in (DeploymentSpec(tp_size=8, accelerator_type=MI300X),
                 DeploymentSpec(tp_size=2, autoscaling={"min_replicas": 1, "max_replicas": 3})):
        opts = deployment_options(spec, "gpu")
        MoEGroup.options(**opts)
        if "autoscaling_config" in opts:
            AutoscalingConfig(**opts["autoscaling_config"])
    Ingress.options(**ingress_options())


def test_ingress_options_are_light():
    opts = ingress_options(0.1)
    # Light, but two of them: the ingress is no single point of failure.
    assert opts["ray_actor_options"] == {"num_cpus": 0.1, "num_gpus": 0} and opts["num_replicas"] == 2
    assert opts["max_queued_requests"] > 0


def test_spec_validation_messages():
    with pytest.raises(ValidationError, match="either num_replicas or autoscaling"):
        DeploymentSpec(num_replicas=2, autoscaling={"max_replicas": 2})
    with pytest.raises(ValidationError, match="cannot run sequence-parallel"):
        DeploymentSpec(tp_size=2, sequence_parallel=True, tail="sharded")
    with pytest.raises(ValidationError, match="max_replicas 1 < min_replicas 2"):
        DeploymentSpec(autoscaling={"min_replicas": 2, "max_replicas": 1})
    with pytest.raises(ValidationError, match="tail"):
        DeploymentSpec(tail="fastest")
    with pytest.raises(ValidationError, match="dtype"):
        DeploymentSpec(dtype="float64")
    with pytest.raises(ValidationError, match="more than once"):
        DeploymentSpec(layers=[1, 1])
    with pytest.raises(ValidationError, match="must start with a letter"):
        DeploymentSpec(name="a/b")
    with pytest.raises(ValidationError, match="Extra inputs"):
        DeploymentSpec(tp=2)


def test_cli_strings_are_coerced():
    # `serve run deployments.app:build_app tp_size=2 layers=1-2 sequence_parallel=false ...`
    spec = DeploymentSpec(tp_size="2", layers="1-2", sequence_parallel="false", max_batch_tokens="64")
    assert spec.tp_size == 2 and spec.layers == [1, 2] and spec.max_batch_tokens == 64
    assert DeploymentSpec(auto_tune_tokens="64,1").auto_tune_tokens == [1, 64]
    assert DeploymentSpec(auto_tune_tokens="off").auto_tune_tokens == []
    with pytest.raises(ValidationError, match="positive token counts"):
        DeploymentSpec(auto_tune_tokens=[0, 4])
    assert parse_layers("[1, 3]") == [1, 3] and parse_layers("all") is None
    assert format_layers([1, 2, 3, 7, 9, 10]) == "1-3,7,9-10"
    with pytest.raises(ValueError, match="ranges separated by commas"):
        parse_layers("1-x")


def test_app_args_merge_defaults_into_deployments():
    args = AppArgs.model_validate({
        "checkpoint": "/ckpt", "tp_size": 2, "dtype": "bfloat16",
        "deployments": [{"name": "prefill", "sequence_parallel": True}, {"name": "decode", "tp_size": 1}],
    })
    prefill, decode = args.deployments
    assert (prefill.tp_size, prefill.dtype, prefill.sequence_parallel) == (2, "bfloat16", True)
    assert (decode.tp_size, decode.dtype) == (1, "bfloat16")
    assert args.default_deployment == "prefill"
    single = AppArgs.model_validate({"checkpoint": "/ckpt", "tp_size": 4})
    assert [d.name for d in single.deployments] == ["moe"] and single.deployments[0].tp_size == 4
    with pytest.raises(ValidationError, match="unique"):
        AppArgs.model_validate({"checkpoint": "/c", "deployments": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ValidationError, match="needs a name"):
        AppArgs.model_validate({"checkpoint": "/c", "deployments": [{"tp_size": 2}]})


def test_build_time_errors_carry_the_arithmetic(tiny_ckpt, k3_config_dir):
    # tiny: moe_intermediate_size 64, hidden 128
    with pytest.raises(ValueError, match=r"TP size 3 does not divide moe_intermediate_size 64: 64 % 3 = 1"):
        app_options({"checkpoint": str(tiny_ckpt), "tp_size": 3})
    with pytest.raises(ValueError, match="tail 'sharded' is illegal here: TP size is 1"):
        app_options({"checkpoint": str(tiny_ckpt), "tp_size": 1, "tail": "sharded"})
    with pytest.raises(ValueError, match="layer 0 is not a MoE layer"):
        app_options({"checkpoint": str(tiny_ckpt), "layers": [0]})
    with pytest.raises(ValueError, match="unknown layer 9"):
        app_options({"checkpoint": str(tiny_ckpt), "layers": "9"})
    with pytest.raises(ValueError, match="no config.json"):
        app_options({"checkpoint": str(tiny_ckpt / "nope")})
    # The real K3 config at TP 8: sharded tail legal (auto picks it), 92 MoE layers.
    _, resolved, options = app_options({"checkpoint": str(k3_config_dir), "tp_size": 8, "tail": "auto",
                                     "dtype": "bfloat16", "accelerator_type": MI300X})
    (r,) = resolved
    assert r.plan.tails == ("sharded",) and r.layers == tuple(range(1, 93))  # K3: layer 0 dense, 92 MoE layers
    assert len(options[0]["placement_group_bundles"]) == 9
    # auto at TP 1 falls back to replicated and says why.
    _, (r1,), _ = app_options({"checkpoint": str(tiny_ckpt), "tp_size": 1})
    assert r1.plan.tails == ("replicated",) and "TP size is 1" in r1.plan.reason


def test_shipped_configs_plan(tiny_ckpt, k3_config_dir):
    import yaml

    ROOT = Path(__file__).resolve().parents[1]

    # mi300x: three TP-8 groups (aiter's shuffled experts are planned beside the packed ones).
    for name, ckpt, gpus in (("local.yaml", tiny_ckpt, 2), ("mi300x.yaml", k3_config_dir, 24)):
        config = yaml.safe_load((ROOT / "deployments/configs" / name).read_text())
        args = dict(config["applications"][0]["args"], checkpoint=str(ckpt))
        if name == "mi300x.yaml":
            for d in [args, *args["deployments"]]:
                d.get("autoscaling", {}).pop("cluster_config", None)  # capacity is tested elsewhere
        _, resolved, _ = app_options(args)
        assert sum(r.spec.tp_size for r in resolved) == gpus
        served = sorted(layer for r in resolved for layer in r.layers)
        assert served == sorted(set(served))  # no layer served twice
    assert served == list(range(1, 93))  # mi300x: every K3 MoE layer exactly once


@pytest.mark.parametrize(
    ("gpu_ids", "cuda", "env", "expected"),
    [
        (["0"], False, {"CUDA_VISIBLE_DEVICES": "0"}, "cpu"),  # logical GPU on a CPU machine
        ([], True, {}, "cpu"),  # no GPU assigned
        (["3"], True, {"CUDA_VISIBLE_DEVICES": "3"}, "cuda:0"),  # Ray set visibility
        (["5"], True, {}, "cuda:5"),  # ROCm NOSET image: all GPUs visible, no variable
        (["5"], True, {"HIP_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, "cuda:5"),
        (["6"], True, {"HIP_VISIBLE_DEVICES": "4,5,6,7"}, "cuda:2"),
    ],
)
def test_pick_device(gpu_ids, cuda, env, expected):
    assert pick_device(gpu_ids, cuda, env) == expected


def test_pick_device_rejects_an_invisible_assignment():
    with pytest.raises(RuntimeError, match="not in HIP_VISIBLE_DEVICES"):
        pick_device(["9"], True, {"HIP_VISIBLE_DEVICES": "0,1"})


def test_threads_per_rank():
    assert threads_per_rank(2, cpus=2) == 1 and threads_per_rank(8, cpus=2) == 1 and threads_per_rank(2, cpus=16) == 8
