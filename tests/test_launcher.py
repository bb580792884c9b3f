"""The cluster files as Ray's cluster launcher sees them, through the launcher's own code.

No machine is touched. Each file goes through what `ray up` runs before it creates a node
(``prepare_config``: provider defaults, the local provider's rewrite, merged setup commands,
docker checks; then ``validate_config``). The docker commands of the head and of a worker are
rendered by Ray's ``DockerCommandRunner.run_init`` — the code that `ray up` runs on each node —
over a recording stand-in for its SSH runner, and checked for what the app needs: the model
share bind-mounted at the checkpoint path, the project mounted, the ROCm device flags on GPU
nodes only, ``--ipc=host`` and the shm size, the HIP visibility variable, and the in-container
rsync of the head's bootstrap files (hence an image that has rsync). Every command that names
project files or extras must name ones that exist here. Last, the workers' pip install is
resolved against PyPI (no ROCm index) with ``--dry-run --report``: it must not pull vllm or any
torch/CUDA wheel (network: skipped when PyPI is unreachable).
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "cluster.yaml", ROOT / "cluster.local.yaml"]
PROJECT = "~/latent-moe-serve"
MODEL_MOUNT = "--volume=/mnt/models:/mnt/models:ro"
ROCM_DEVICE_FLAGS = ["--device=/dev/kfd", "--device=/dev/dri", "--group-add video"]
# Ray's docker images run as user `ray`; rocm/pytorch runs as root.
HOMES = {"rayproject/ray": "/home/ray", "rocm/pytorch": "/root"}
# Anything CUDA-flavoured that a CPU/ROCm worker must never download.
CUDA_WHEELS = re.compile(r"^(torch|torchvision|torchaudio|triton|vllm|xformers|nvidia-.*|cupy.*)$")


def prepared(path: Path) -> dict:
    from deployments.common.private_api import prepare_cluster_config

    return prepare_cluster_config(yaml.safe_load(path.read_text()))


class RecordingSSH:
    """Stands in for the launcher's SSH runner: records commands, answers the launcher's probes
    as a fresh VM would (docker installed, no container running yet, runc only)."""

    def __init__(self, cluster_name: str, ssh_user: str, home: str):
        self.cluster_name, self.ssh_user, self.home = cluster_name, ssh_user, home
        self.commands: list[str] = []

    def run(self, cmd=None, with_output=False, **_kwargs):
        self.commands.append(cmd)
        if "printenv HOME" in cmd or "'{{json .Config.Env}}'" in cmd:
            return (self.home if "printenv" in cmd else json.dumps([f"HOME={self.home}"])).encode()
        if cmd.startswith("command -v docker"):
            return b"/usr/bin/docker"
        if "info -f '{{.Runtimes}}'" in cmd:
            return b"map[io.containerd.runc.v2:{} runc:{}]"
        return b""  # `docker inspect` of the container: not running

    def run_rsync_up(self, source, target, options=None):
        self.commands.append(f"<rsync to host> {source} {target}")


def render_node(config: dict, as_head: bool) -> tuple[list[str], str]:
    """What `ray up` runs on one node's host to start its container and set it up: the commands
    Ray's DockerCommandRunner issues (run_init, then every setup command), and the image."""
    from deployments.common.private_api import docker_command_runner

    docker = config["docker"]
    image = docker.get("head_image" if as_head else "worker_image", docker["image"])
    home = next(h for prefix, h in HOMES.items() if image.startswith(prefix))
    runner = docker_command_runner(docker_config=docker, log_prefix="", node_id="n", provider=None, auth_config=config["auth"],
                                 cluster_name=config["cluster_name"], process_runner=subprocess,
                                 use_internal_ip=False)
    ssh = RecordingSSH(config["cluster_name"], config["auth"]["ssh_user"], home)
    runner.ssh_command_runner = ssh
    mounts = dict(config["file_mounts"])
    if as_head:  # what commands.get_or_create_head_node adds
        mounts.update({"~/ray_bootstrap_config.yaml": "/tmp/cfg.yaml", "~/ray_bootstrap_key.pem": "/tmp/key"})
    runner.run_init(as_head=as_head, file_mounts=mounts, sync_run_yet=True)
    for cmd in config["head_setup_commands" if as_head else "worker_setup_commands"]:
        runner.run(cmd)
    return ssh.commands, image


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_rays_launcher_accepts_and_fills_out(path: Path) -> None:
    config = prepared(path)
    # Setup commands are merged as the launcher runs them: common ones first.
    common = yaml.safe_load(path.read_text())["setup_commands"]
    assert config["worker_setup_commands"][:len(common)] == config["head_setup_commands"][:len(common)] == common
    assert 'pip install "ray[default,serve]==2.60.0"' in common
    assert config["file_mounts"][PROJECT] == "."


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_docker_commands_of_head_and_worker(path: Path) -> None:
    config = prepared(path)
    head, head_image = render_node(config, as_head=True)
    worker, worker_image = render_node(config, as_head=False)
    (head_run,) = [c for c in head if c.startswith("docker run")]
    (worker_run,) = [c for c in worker if c.startswith("docker run")]
    mount_root = f"/tmp/ray_tmp_mount/{config['cluster_name']}"
    for run, home in ((head_run, "/home/ray"), (worker_run, "/root")):
        assert MODEL_MOUNT in run  # the model share at the checkpoint path of configs/mi300x.yaml
        assert f"-v {mount_root}/~/latent-moe-serve:{home}/latent-moe-serve" in run  # the project
        assert "--ipc=host" in run and "--shm-size=64g" in run and "--net=host" in run
        assert "--env=RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=0" in run
        assert "--runtime=nvidia" not in run
    for flag in ROCM_DEVICE_FLAGS:
        assert flag in worker_run and flag not in head_run  # a CPU head has no /dev/kfd
    assert worker_image.startswith("rocm/pytorch:") and worker_image in worker_run
    assert head_image.startswith("rayproject/ray:2.60.0-py312") and head_image in head_run
    # Right after `docker run` the launcher copies the bootstrap files into the head's container
    # with rsync *inside* it, before any setup command: the head image must ship rsync (Ray's does).
    first_rsync = next(i for i, c in enumerate(head) if "rsync -e 'docker exec -i'" in c)
    first_setup = next(i for i, c in enumerate(head) if c.startswith("docker exec") and "pip install" in c)
    assert head.index(head_run) < first_rsync < first_setup
    # rsync is set up before anything else; every setup step runs in the container.
    setups = [c for c in worker if c.startswith("docker exec") and "/bin/bash -c" in c]
    assert len(setups) == len(config["worker_setup_commands"])
    assert "install -y -qq rsync" in setups[0] and all(" ray_rocm /bin/bash -c" in c for c in setups)
    assert any("/root/latent-moe-serve && pip install -c /tmp/torch-pin.txt -e" in c for c in setups)


# The fast experts backends need torch >= 2.8 (aiter: torch.float4_e2m1fn_x2; grouped:
# torch's grouped GEMM); below it `auto` would serve with the slow per-expert loop.
MIN_WORKER_TORCH = (2, 8)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_images_run_the_fast_backends_with_one_python_and_torch(path: Path) -> None:
    """The worker tag names its torch and Python (rocm/pytorch:rocm<R>_ubuntu<U>_py<M>_pytorch_release_<T>):
    torch >= 2.8, the head image's Python minor equal to the workers', the head's CPU torch the
    workers' release (the app is built on the head and runs on the workers)."""
    config = prepared(path)
    docker = config["docker"]
    worker = re.fullmatch(r"rocm/pytorch:rocm[\d.]+_ubuntu[\d.]+_py3\.(\d+)_pytorch_release_(\d+)\.(\d+)\.(\d+)",
                          docker.get("worker_image", docker["image"]))
    assert worker, docker["image"]
    py_minor, torch_version = worker[1], tuple(int(v) for v in worker.group(2, 3, 4))
    assert torch_version[:2] >= MIN_WORKER_TORCH, torch_version
    head = re.fullmatch(r"rayproject/ray:2\.60\.0-py3(\d+)-cpu", docker["head_image"])
    assert head and head[1] == py_minor, (docker["head_image"], py_minor)
    (pin,) = [c for c in config["head_setup_commands"] if "torch==" in c]
    assert f'"torch=={".".join(map(str, torch_version))}"' in pin and "whl/cpu" in pin


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_host_commands_mount_the_model_share_without_group_tricks(path: Path) -> None:
    init = prepared(path)["initialization_commands"]
    mount = next(c for c in init if "mount -t nfs" in c)
    assert "/mnt/models" in mount and " ro" in mount.replace(",", " ").replace("-o ", " ")
    assert any("test -f /mnt/models/Kimi-K3/config.json" in c for c in init)  # fail at `ray up`
    # A group added with usermod reaches only new logins, not the launcher's open SSH session.
    for c in init:
        if "usermod" in c:
            assert "setfacl -m u:$USER:rw /var/run/docker.sock" in c


def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_command_names_files_that_exist(path: Path) -> None:
    config = prepared(path)
    assert config["file_mounts"][PROJECT] == "."  # `ray up` runs from the repository root
    written: set[str] = set()
    keys = ("initialization_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    for cmd in (c for k in keys for c in config[k]):
        for target in re.findall(r">\s*(/\S+)", cmd):
            written.add(target)
        for pip in re.findall(r"pip install[^&;]*", cmd):
            for used in re.findall(r"(?:-c|-r|--constraint|--requirement)\s+(\S+)", pip):
                assert used in written or (ROOT / used).exists(), f"{used!r} of {cmd!r} does not exist"
        for rel in re.findall(r"~/latent-moe-serve/(\S+)", cmd):
            assert (ROOT / rel).exists(), f"{rel} of {cmd!r} is not in the repository"
        if "cd ~/latent-moe-serve" in cmd:
            for spec in re.findall(r"-e\s+\"?\.(\[[^\]]*\])?", cmd):
                assert (ROOT / "pyproject.toml").exists()
                assert set(filter(None, spec.strip("[]").split(","))) <= _extras(), cmd
        if "--autoscaling-config=" in cmd:
            assert "~/ray_bootstrap_config.yaml" in cmd  # the file the launcher writes on the head


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.network
@pytest.mark.skipif(not _pypi_reachable(), reason="PyPI is not reachable from this machine")
def test_worker_install_resolves_from_pypi_without_vllm_or_cuda(tmp_path: Path) -> None:
    """The workers' pip commands, as cluster.yaml runs them, resolved against PyPI only.

    This venv's torch plays the image's preinstalled ROCm torch: the first command writes the pin
    exactly as on a worker, and the install must keep it (nothing torch- or CUDA-flavoured, no
    vllm). ``--isolated`` drops this machine's pip configuration (local wheel folders, caps).
    """
    config = prepared(ROOT / "cluster.yaml")
    commands = config["worker_setup_commands"]
    pin_cmd = next(c for c in commands if "torch-pin.txt" in c and c.startswith("python"))
    pin = subprocess.run([sys.executable, "-c", shlex.split(pin_cmd)[2]], capture_output=True, text=True,
                         check=True).stdout.strip()
    (tmp_path / "torch-pin.txt").write_text(pin + "\n")
    installs = []
    for cmd in commands:
        for part in cmd.split("&&"):
            words = shlex.split(part.replace("/tmp/torch-pin.txt", str(tmp_path / "torch-pin.txt")))
            if words[:2] == ["pip", "install"]:
                installs.append(words[2:])
    assert installs and any("-e" in w for w in installs)
    pulled: dict[str, str] = {}
    for args in installs:
        report = tmp_path / "report.json"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--quiet", "--report", str(report),
             "--index-url", "https://pypi.org/simple", "--no-build-isolation", *args],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        for item in json.loads(report.read_text())["install"]:
            pulled[item["metadata"]["name"].lower()] = item["metadata"]["version"]
    assert "amd-aiter" in pulled  # the rocm extra resolves from PyPI
    bad = {name: version for name, version in pulled.items() if CUDA_WHEELS.match(name)}
    assert not bad, f"the worker install would pull {bad}"
