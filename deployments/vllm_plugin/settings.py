"""The plugin's settings: vLLM's ``additional_config["latent_moe"]``, checked when the model is built.

    {"ticket": "/path/ticket.json", "peer": 0}          # the tier: a session of the data plane
    {"checkpoint": "/path/tier-checkpoint"}             # in-process reference (moe_runtime)

``ticket``: a session ticket (``SessionTicket.to_json``), as a file path or the JSON itself;
``peer``: this engine's peer index (default: its vLLM data-parallel rank). ``checkpoint``: a tier
checkpoint folder or a Qwen3-MoE / DeepSeek-V3 model folder (the engine's own works), every mapped
layer run in this process (``dtype``: ``float32`` or
``bfloat16``, default the model's; ``backend``: the experts backend, default ``torch``).
``layers``: ``{vLLM decoder layer: tier layer}`` for the model's MoE blocks (default: the same
numbers). Anything else is an error naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_runtime.units import SERVED_DTYPES

from ..dataplane.peer import SessionTicket

KEY = "latent_moe"
KNOWN = {"ticket", "peer", "checkpoint", "dtype", "backend", "layers"}


@dataclass(frozen=True)
class TierSettings:
    ticket: SessionTicket | None = None
    peer: int | None = None
    checkpoint: str | None = None
    dtype: str | None = None
    backend: str = "torch"
    layers: dict[int, int] | None = None

    def tier_layer(self, decoder_layer: int) -> int:
        return decoder_layer if self.layers is None else self.layers.get(decoder_layer, decoder_layer)

    @classmethod
    def parse(cls, additional_config: Any) -> TierSettings:
        raw = (additional_config or {}).get(KEY) if isinstance(additional_config, dict) else None
        if not isinstance(raw, dict):
            raise ValueError(f'a latent-MoE tier model needs additional_config["{KEY}"] (a dict with '
                             f'"ticket" or "checkpoint"), got {raw!r}')
        unknown = sorted(set(raw) - KNOWN)
        if unknown:
            raise ValueError(f'unknown key(s) {unknown} in additional_config["{KEY}"]; '
                             f'known: {sorted(KNOWN)}')
        if ("ticket" in raw) == ("checkpoint" in raw):
            raise ValueError(f'additional_config["{KEY}"] needs exactly one of "ticket" (the tier) and '
                             f'"checkpoint" (in-process), got keys {sorted(raw)}')
        peer = raw.get("peer")
        if peer is not None and (isinstance(peer, bool) or not isinstance(peer, int) or peer < 0):
            raise ValueError(f'"peer" must be a non-negative integer, got {peer!r}')
        if "ticket" in raw and "dtype" in raw:
            raise ValueError('"dtype" goes with "checkpoint"; a ticket carries the tier\'s own dtype')
        dtype = raw.get("dtype")
        if dtype is not None and dtype not in SERVED_DTYPES:
            raise ValueError(f'"dtype" must be one of {list(SERVED_DTYPES)}, got {dtype!r}')
        backend = raw.get("backend", "torch")
        if not isinstance(backend, str):
            raise ValueError(f'"backend" must be an experts backend name, got {backend!r}')
        return cls(ticket=read_ticket(raw["ticket"]) if "ticket" in raw else None, peer=peer,
                   checkpoint=str(raw["checkpoint"]) if "checkpoint" in raw else None, dtype=dtype,
                   backend=backend, layers=parse_layers(raw.get("layers")))


def read_ticket(value: Any) -> SessionTicket:
    """A ticket given as its JSON or as the path of a file holding it."""
    if isinstance(value, dict):
        return SessionTicket.from_json(json.dumps(value))
    if not isinstance(value, str):
        raise ValueError(f'"ticket" must be a file path or the ticket\'s JSON, got {type(value).__name__}')
    text = value if value.lstrip().startswith("{") else _read(Path(value))
    try:
        return SessionTicket.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f'"ticket" is not a session ticket ({type(e).__name__}: {e})') from None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(f'"ticket": cannot read {path}: {e}') from None


def parse_layers(value: Any) -> dict[int, int] | None:
    if value is None:
        return None
    bad = ValueError(f'"layers" must map decoder layer numbers to tier layer numbers, e.g. {{"1": 1}}, '
                     f'got {value!r}')
    if not isinstance(value, dict):
        raise bad
    try:
        out = {int(k): int(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise bad from None
    if any(isinstance(v, bool) or v < 0 for v in value.values()) or any(k < 0 for k in out):
        raise bad
    return out
