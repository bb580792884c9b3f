"""The ``grouped`` experts backend: one grouped GEMM per projection for all active experts.

torch's grouped GEMM (``private_api.grouped_mm(A [M, K], B [G, K, N], offs)``) multiplies each row
block of ``A`` by its matrix of ``B`` in one call. The ``torch`` backend instead launches two GEMMs
per active expert from Python, up to 2 * E launches per layer.

Dense experts are used in place: every expert is a group, inactive ones empty, so a batch costs
two grouped GEMMs and no weight copy. Packed (MXFP4) experts are decoded only when active, a chunk
of experts at a time within the scratch budget, two grouped GEMMs per chunk.
Legend: T tokens, K slots per token, M = T * K rows sorted by expert, D latent, F = 2 * I.
"""

from __future__ import annotations

import functools

import torch

from .. import private_api as torch_api
from ..activation import GatedActivation
from ..weights import ExpertWeights
from .base import DEFAULT_SCRATCH_BYTES, check_scratch_bytes, register_backend, slots_by_expert

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_unavailable_reason() -> str | None:
    """None when this torch has the grouped GEMM op (and, on a GPU, it runs), else why not."""
    if not torch_api.has_grouped_mm():
        return f"torch {torch.__version__} has no {torch_api.GROUPED_MM} (it needs torch >= 2.8)"
    if torch.cuda.is_available():
        return grouped_mm_fails_on(f"cuda:{torch.cuda.current_device()}")
    return None


@functools.cache
def grouped_mm_fails_on(device: str) -> str | None:
    """One tiny bf16 grouped GEMM on ``device``: None when it runs, else the error. Some
    builds have the op but no kernel for the device (ROCm torch 2.8 raises "grouped gemm is not
    supported on ROCM"; ROCm's 2.9 builds carry a fallback)."""
    try:
        a = torch.ones(4, 8, dtype=torch.bfloat16, device=device)
        b = torch.ones(2, 8, 8, dtype=torch.bfloat16, device=device)
        torch_api.grouped_mm(a, b, torch.tensor([2, 4], dtype=torch.int32, device=device))
    except Exception as exc:  # RuntimeError / NotImplementedError from the op's dispatch
        return f"torch {torch.__version__}'s {torch_api.GROUPED_MM} does not run on {device}: {exc}"
    return None


def _experts_mm(x_MD, counts_G, w13_GFD, w2_GDI, act: GatedActivation, act_quant):
    """Both projections of ``G`` experts on their sorted rows: ``[M, D]`` in the input dtype."""
    offs = torch.cumsum(counts_G, 0, dtype=torch.int32)
    gate_up = torch_api.grouped_mm(x_MD, w13_GFD.transpose(1, 2), offs)
    half = w13_GFD.shape[1] // 2
    a = act(gate_up[:, :half], gate_up[:, half:]).to(x_MD.dtype)
    if act_quant is not None:
        a = act_quant(a)
    return torch_api.grouped_mm(a, w2_GDI.transpose(1, 2), offs)


@register_backend("grouped", unavailable=grouped_unavailable_reason)
class GroupedExperts:
    name = "grouped"

    def __init__(self, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> None:
        reason = grouped_unavailable_reason()
        if reason is not None:
            raise ValueError(reason)
        self.scratch_bytes = check_scratch_bytes(scratch_bytes)

    def __call__(
        self, h_TD, ids_TK, weights_TK, experts: ExpertWeights, act: GatedActivation, act_quant=None
    ) -> torch.Tensor:
        if h_TD.dtype != experts.dtype or h_TD.dtype not in GROUPED_DTYPES:
            raise ValueError(
                f"the grouped experts backend runs {[str(d) for d in GROUPED_DTYPES]} with the input in "
                f"the experts' dtype; got input {h_TD.dtype}, experts {experts.dtype}"
            )
        out_TD = torch.zeros(ids_TK.shape[0], experts.latent_size, dtype=torch.float32, device=h_TD.device)
        if act_quant is not None:
            h_TD = act_quant(h_TD)
        token_of_slot, slot_weight, counts_E = slots_by_expert(ids_TK, weights_TK, experts.num_experts)
        slot_weight = slot_weight[:, None]
        x_MD = h_TD[token_of_slot]
        if not experts.packed:
            y_MD = _experts_mm(x_MD, counts_E, experts.w13, experts.w2, act, act_quant)
            return out_TD.index_add_(0, token_of_slot, y_MD.float() * slot_weight)
        active = torch.nonzero(counts_E).flatten()
        counts_A = counts_E[active]
        per_chunk = experts.experts_per_chunk(self.scratch_bytes)
        rows_per_chunk = [sum(c) for c in _chunks(counts_A.tolist(), per_chunk)]
        start = 0
        for first, rows in zip(range(0, len(active), per_chunk), rows_per_chunk, strict=True):
            w13_nFD, w2_nDI = experts.decode(active[first : first + per_chunk])
            sl = slice(start, start + rows)
            y_MD = _experts_mm(x_MD[sl], counts_A[first : first + per_chunk], w13_nFD, w2_nDI, act, act_quant)
            out_TD.index_add_(0, token_of_slot[sl], y_MD.float() * slot_weight[sl])
            del w13_nFD, w2_nDI
            start += rows
        return out_TD


def _chunks(values: list[int], size: int) -> list[list[int]]:
    return [values[i : i + size] for i in range(0, len(values), size)]
