"""Shared fixtures: generated checkpoints (never downloaded)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.cluster.local import local_serve
from moe_runtime.synthetic import preset_config, write_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset, K3 layout, one file per layer with an index."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=1)


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``make_ckpt(preset="tiny", mxfp4=False, **config_overrides)``; cached per args."""
    cache: dict[tuple, Path] = {}

    def make(preset: str = "tiny", *, mxfp4: bool = False, single_file: bool = False,
             text_only: bool = False, seed: int = 1, **overrides) -> Path:
        key = (preset, mxfp4, single_file, text_only, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = write_checkpoint(
                tmp_path_factory.mktemp(preset), preset_config(preset, **overrides),
                use_mxfp4=mxfp4, seed=seed, single_file=single_file, text_only=text_only,
            )
        return cache[key]

    return make


# -- one Ray instance with Serve per test process ------------------------------------------------

SHARED_RESOURCES = {"num_cpus": 16, "num_gpus": 16}  # logical: enough for every module that shares it
# What test apps run with, beside their own settings. One ingress replica: no test needs the
# second (production keeps two for failover), and each replica is a process to start (~2.5 CPU-s
# of imports).
TEST_APP = {"ingress_replicas": 1}
# Modules that start a Ray of their own (their own resources or environment, a simulated cluster,
# `serve run` in a subprocess): in one process they run before the shared instance starts (so it
# starts once per run); with pytest-xdist, in a worker of their own beside it (each Ray instance
# is a fresh local one: RAY_ADDRESS=local, never one found on the machine).
OWN_RAY_MODULES = ("test_http_auth.py", "test_multinode.py", "test_placement.py", "test_plain_deployment.py",
                   "test_readme_commands.py", "test_serve_cli.py")
# With pytest-xdist, the modules using Ray run in two sets, one worker each: these shared-instance
# modules join the modules above, and every other module that shares an instance runs in the
# second set, so that the two take about as long (each worker starts its own shared instance).
# The modules without Ray fill in on whichever worker is done first.
WITH_OWN_RAY_MODULES = ("test_controller.py", "test_memory.py")


@functools.cache
def ray_use(module: Path) -> int:
    """0: the test module starts a Ray of its own; 1: it shares the test process's (it names
    ``serve_ports``); 2: it needs none. Read from the file, so that pytest-xdist's controller,
    which collects nothing, sees what the workers see (pytest_collection_modifyitems checks it)."""
    if module.name in OWN_RAY_MODULES:
        return 0
    return 1 if "serve_ports" in module.read_text() else 2


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Whole modules per worker: the modules using Ray in two sets, one worker each (see
    ``WITH_OWN_RAY_MODULES``), and each module without Ray a scope of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class RayModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = config.rootpath / nodeid.split("::", 1)[0]
            use = ray_use(module)
            if use == 2:
                return module.name
            return "Ray, set 1" if use == 0 or module.name in WITH_OWN_RAY_MODULES else "Ray, set 2"

    return RayModulesTogether(config, log)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with a Ray of their own first, then those sharing the test process's instance,
    then those without Ray, of which those with a slow test first (the longest jobs first, so
    that the two processes end about together). A stable sort of whole modules: each keeps its
    tests' order, and any module runs alone just as well."""
    for item in items:
        if "serve_ports" in item.fixturenames and ray_use(item.path) == 2:
            raise pytest.UsageError(f"{item.nodeid} uses serve_ports through another fixture: name it in "
                                    f"{item.path.name}, or tests/conftest.py cannot tell that the module uses Ray")
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (ray_use(item.path), ray_use(item.path) == 2 and item.path not in slow))


class SharedServe:
    """The test process's Ray instance with Serve (logical GPUs; CPU machine), started on first
    use and kept across modules: each module deletes its applications when it ends. The modules
    needing a Ray of their own run before it starts (``OWN_RAY_MODULES``); :func:`own_serve`
    still stops it first, so that any module can also run on its own after a sharing one."""

    def __init__(self) -> None:
        self.ports: SimpleNamespace | None = None
        self.running = ExitStack()

    def start(self) -> SimpleNamespace:
        if self.ports is None:
            from moe_runtime.tp.collectives import free_port

            metrics = free_port()
            serving = local_serve(_metrics_export_port=metrics, **SHARED_RESOURCES)
            self.ports = SimpleNamespace(http=self.running.enter_context(serving), metrics=metrics)
        return self.ports

    def clear(self) -> None:
        """Delete every application (and wait for them to go), keeping Ray and Serve up."""
        if self.ports is not None:
            from ray import serve

            for name in serve.status().applications:
                serve.delete(name)

    def stop(self) -> None:
        self.ports = None
        self.running.close()


SHARED = SharedServe()


@pytest.fixture(scope="module")
def serve_ports() -> Iterator[SimpleNamespace]:
    """This module's use of the shared Ray + Serve: ``.http`` (Serve's HTTP port) and
    ``.metrics`` (Ray's Prometheus port); its applications are deleted when the module ends."""
    ports = SHARED.start()
    try:
        yield ports
    finally:
        SHARED.clear()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    SHARED.stop()


def serve_deploy(config: dict, wait_for: str | None = None, timeout_s: float = 300.0) -> None:
    """Deploy ``config`` (what a `serve deploy` file holds) through the Serve controller, as
    `serve deploy` does: a changed ``user_config`` is then a light update, and an app can carry a
    ``runtime_env``. With ``wait_for``, wait until that application runs. (Serve's Python API has
    no public call for this: the one place the tests use its private client.)"""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate(config))
    if wait_for is not None:
        client._wait_for_application_running(wait_for, timeout_s=timeout_s)


@contextmanager
def own_serve(num_cpus: int, num_gpus: int) -> Iterator[int]:
    """A Ray instance with Serve of this caller's own resources (the shared one stopped first);
    yields Serve's HTTP port and stops both on exit."""
    SHARED.stop()
    with local_serve(num_cpus=num_cpus, num_gpus=num_gpus) as port:
        yield port
