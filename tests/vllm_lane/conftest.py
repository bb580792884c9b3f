"""Fixtures of the vLLM lane (``scripts/test.sh --vllm``); the helpers are in scripts/bench/vllm_tier.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.bench.vllm_tier import Tier, make_models


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tier(models, tmp_path_factory) -> Iterator[Tier]:
    t = Tier(models["tier"], tmp_path_factory.mktemp("tier"))
    yield t
    t.stop()
