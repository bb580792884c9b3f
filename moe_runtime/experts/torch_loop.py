"""The ``torch`` experts backend (the reference): one GEMM pair per active expert."""

from __future__ import annotations

import torch

from ..weights import ExpertWeights
from .base import (
    DEFAULT_SCRATCH_BYTES,
    REFERENCE_BACKEND,
    check_scratch_bytes,
    register_backend,
    slots_by_expert,
)


@register_backend(REFERENCE_BACKEND)
class TorchExperts:
    """Sort token-slots by expert and run one GEMM pair per active expert.

    Packed (MXFP4) experts are decoded only when a batch activates them, a chunk of experts at
    a time, each chunk's decoded weights (and decode temporaries) within ``scratch_bytes``.
    """

    name = REFERENCE_BACKEND

    def __init__(self, scratch_bytes: int = DEFAULT_SCRATCH_BYTES):
        self.scratch_bytes = check_scratch_bytes(scratch_bytes)

    def __call__(self, h_TD, ids_TK, weights_TK, experts: ExpertWeights, act, act_quant=None):
        out_TD = torch.zeros(ids_TK.shape[0], experts.latent_size, dtype=torch.float32, device=h_TD.device)
        if act_quant is not None:
            h_TD = act_quant(h_TD)
        token_of_slot, slot_weight, counts = slots_by_expert(ids_TK, weights_TK, experts.num_experts)
        starts = (torch.cumsum(counts, 0) - counts).tolist()
        counts = counts.tolist()
        active = [e for e, c in enumerate(counts) if c]
        per_chunk = experts.experts_per_chunk(self.scratch_bytes) if experts.packed else 1
        half = experts.intermediate_size
        for first in range(0, len(active), per_chunk):
            chunk = active[first : first + per_chunk]
            if experts.packed:
                w13_nFD, w2_nDI = experts.decode(torch.tensor(chunk, device=experts.w13.device))
            else:  # dense: use the resident experts in place, no copy
                w13_nFD, w2_nDI = experts.w13, experts.w2
            for i, expert in enumerate(chunk):
                j = i if experts.packed else expert
                start, count = starts[expert], counts[expert]
                rows = token_of_slot[start : start + count]
                gate_up = h_TD[rows] @ w13_nFD[j].t()
                a = act(gate_up[:, :half], gate_up[:, half:]).to(h_TD.dtype)
                if act_quant is not None:
                    a = act_quant(a)
                y = (a @ w2_nDI[j].t()).float()
                out_TD.index_add_(0, rows, y * slot_weight[start : start + count, None])
            del w13_nFD, w2_nDI
        return out_TD
