"""Which actors are dead: the one probe the replica (its ranks) and the cohort
(its workers) use. An actor that answers ``__ray_ready__`` is alive; one whose call fails with
Ray's actor-death error is dead; one slower than ``PROBE_S`` is slow, not dead (a loaded machine
or a stopped process: the callers' own bounds deal with those)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from ..common.errors import actor_died
from ..config.timeouts import PROBE_S


def dead_actors(actors: Sequence[Any]) -> list[int]:
    """Positions of the dead actors in ``actors`` (blocking, at most ``PROBE_S``)."""
    refs = [a.__ray_ready__.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_S)
    dead = []
    for i, ref in enumerate(refs):
        if ref in ready:
            try:
                ray.get(ref)
            except Exception as e:
                if actor_died(e):
                    dead.append(i)
    return dead
