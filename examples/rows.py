"""``RowsWorker``: a stand-in attention worker for a cohort, whose attention is a lookup."""

from __future__ import annotations

from typing import Any

import torch

from deployments.client import AttentionWorker


class RowsWorker(AttentionWorker):
    """Sends given rows for each layer (``rows``, or a step's input when it brings them) and keeps
    what comes back; ``finish`` returns it, layer by layer."""

    def __init__(self, rows: dict[int, torch.Tensor] | None = None) -> None:
        self.rows = rows or {}
        self.out: dict[int, torch.Tensor] = {}

    def start(self, step_input: Any) -> None:
        if step_input is not None:
            self.rows = step_input
        self.out = {}

    def attend(self, layer: int) -> torch.Tensor:
        return self.rows[layer]

    def absorb(self, layer: int, moe_out_TH: torch.Tensor) -> None:
        self.out[layer] = moe_out_TH

    def finish(self) -> Any:
        return self.out

    def abort(self) -> None:
        self.out = {}
