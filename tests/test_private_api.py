"""The private Ray and torch names the project uses (``deployments.common.private_api``,
``moe_runtime.private_api``) still behave as the code relies on; and no other file uses one."""

from __future__ import annotations

import datetime
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from deployments.common import private_api as ray_api
from moe_runtime import private_api as torch_api
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = {"deployments/common/private_api.py", "moe_runtime/private_api.py", "tests/test_private_api.py"}
# A private name of Ray or torch: a dotted name rooted at one of their modules with a segment that
# starts with one underscore, or the private attributes the adapters set and read.
PRIVATE = re.compile(r"\b(ray|torch|dist|serve|internal_kv)(\.\w+)*\._(?!_)\w+|\.(_timeout|_actor_id)\b")


def test_no_private_ray_or_torch_name_outside_the_adapters():
    found = []
    for folder in ("deployments", "moe_runtime", "scripts", "examples", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel in ADAPTERS:
                continue
            found += [f"{rel}:{n}: {m.group(0)}" for n, line in enumerate(path.read_text().splitlines(), 1)
                      if (m := PRIVATE.search(line))]
    assert found == []


def _unanswered_all_reduce(comm: Collectives) -> float:
    dist.barrier()
    torch_api.set_default_group_timeout(datetime.timedelta(seconds=1))
    if comm.rank == 1:
        time.sleep(6)  # the scenario: a peer that never joins rank 0's all-reduce in time
        return 0.0
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.ones(1))
    return time.monotonic() - start


def test_the_default_group_timeout_can_be_shortened_after_init():
    gave_up_after, _ = run_local_group(2, _unanswered_all_reduce, timeout_s=60, collective_timeout_s=60)
    assert gave_up_after < 5  # the group was built with 60 s


@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch has no NCCL")
def test_nccl_options_carry_the_timeout():
    assert torch_api.nccl_options(datetime.timedelta(seconds=7))._timeout == datetime.timedelta(seconds=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_multiplies_each_row_block_by_its_own_matrix(dtype):
    assert torch_api.has_grouped_mm()
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(7, 16, generator=gen).to(dtype)
    b = torch.randn(3, 8, 16, generator=gen).to(dtype).transpose(1, 2)  # [G, K, N], as the backend passes
    ends = [2, 2, 7]  # the second block is empty
    got = torch_api.grouped_mm(a, b, torch.tensor(ends, dtype=torch.int32))
    want = torch.cat([a[start:end] @ b[g] for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True))])
    assert got.shape == (7, 8) and got.dtype == dtype
    torch.testing.assert_close(got, want)


def test_serve_names_its_actors_in_the_namespace_we_name():
    from ray.serve._private.constants import SERVE_NAMESPACE

    assert ray_api.SERVE_NAMESPACE == SERVE_NAMESPACE


def test_rays_launcher_prepares_and_checks_a_cluster_config():
    config = {"cluster_name": "c", "provider": {"type": "local", "head_ip": "10.0.0.1", "worker_ips": []},
              "auth": {"ssh_user": "u"}}
    prepared = ray_api.prepare_cluster_config(config)
    assert prepared["head_node_type"] == "local.cluster.node"  # the local provider's rewrite
    with pytest.raises(Exception, match="no_such_field"):  # Ray's schema, checked by Ray
        ray_api.prepare_cluster_config({**config, "no_such_field": 1})
    runner = ray_api.docker_command_runner(
        docker_config={"image": "rayproject/ray", "container_name": "ray"}, log_prefix="", node_id="n",
        provider=None, auth_config=config["auth"], cluster_name="c", process_runner=None, use_internal_ip=False)
    assert runner.container_name == "ray"


def test_a_replica_id_on_our_deployment_id():
    from ray.serve.request_router import ReplicaID

    replica = ReplicaID(unique_id="r", deployment_id=ray_api.deployment_id("moe", "app"))
    assert (replica.deployment_id.name, replica.deployment_id.app_name) == ("moe", "app")


def test_the_kv_store_the_log_folder_and_the_replicas_namespace(serve_ports):
    import ray
    from ray import serve

    ray_api.kv_put("private-api-test:a", "1", "private_api_test")
    assert ray_api.kv_get("private-api-test:a", "private_api_test") == b"1"
    assert ray_api.kv_keys("private-api-test:", "private_api_test") == ["private-api-test:a"]
    # a create-if-absent: the first call creates, a second leaves the value
    assert ray_api.kv_put_new("private-api-test:a", "2", "private_api_test") is False
    assert ray_api.kv_get("private-api-test:a", "private_api_test") == b"1"
    ray_api.kv_delete("private-api-test:a", "private_api_test")
    assert ray_api.kv_put_new("private-api-test:a", "3", "private_api_test") is True
    ray_api.kv_delete("private-api-test:a", "private_api_test")
    assert ray_api.kv_get("private-api-test:a", "private_api_test") is None
    assert Path(ray_api.ray_logs_dir()).is_dir()

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Name:
        def __call__(self) -> str:
            return ray.get_runtime_context().get_actor_name()

    name = serve.run(Name.bind(), name="private_api", route_prefix=None).remote().result(timeout_s=60)
    assert ray.get_actor(name, namespace=ray_api.SERVE_NAMESPACE) is not None
