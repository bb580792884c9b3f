"""Shared fixtures: generated checkpoints (never downloaded)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

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


@contextmanager
def local_serve(num_cpus: int, num_gpus: int) -> Iterator[int]:
    """A private Ray instance with Serve's HTTP proxy on a free port (yielded); all of it is
    stopped on exit. ``address="local"``: never a ``ray start`` cluster found on the machine;
    the GPUs are logical (CPU machine)."""
    import ray
    from ray import serve

    from moe_runtime.tp.collectives import free_port

    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, namespace="serve",
             log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()
