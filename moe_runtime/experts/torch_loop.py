"""The ``torch`` experts backend (the reference): one GEMM pair per active expert.

Packed (MXFP4) experts take one of two paths, the same math:

- ``fused`` (the default on CPU): ``mxfp4_cpu.linear`` decodes the nibbles inside the GEMM (in
  registers, fp32 accumulation), so no dense expert and no decode scratch exist. Each GEMM's
  fp32 output is rounded to the compute dtype exactly where the ``decode`` path's GEMM in that
  dtype rounds it, so the two differ only by the order of fp32 additions (tests/test_fused_cpu.py
  derives and tests the bound).
- ``decode`` (GPUs, and CPUs where the fused kernel cannot be built: logged once as a WARNING
  with the reason): active experts are decoded to the compute dtype a chunk at a time, each
  chunk's decoded weights (and decode temporaries) within ``scratch_bytes``, then multiplied.
"""

from __future__ import annotations

import logging

import torch

from ..logs import log_once, logger
from ..weights import ExpertWeights
from . import mxfp4_cpu
from .base import (
    DEFAULT_SCRATCH_BYTES,
    REFERENCE_BACKEND,
    check_scratch_bytes,
    register_backend,
    slots_by_expert,
)

PACKED_PATHS = ("auto", "fused", "decode")
FUSED_DTYPES = (torch.float32, torch.bfloat16)  # decoded weights exact in both (same exponent range)


def packed_path(experts: ExpertWeights, requested: str = "auto") -> tuple[str, str]:
    """The path the torch backend takes for ``experts`` and why: ``fused``, ``decode`` or ``dense``."""
    if not experts.packed:
        return "dense", "dense experts are multiplied in place"
    if requested == "decode":
        return "decode", "decode requested"
    on_cpu = experts.w13.device.type == "cpu"
    reason = mxfp4_cpu.unavailable_reason() if on_cpu else f"experts on {experts.w13.device.type}, not CPU"
    if reason is None and experts.dtype not in FUSED_DTYPES:
        # an fp16 decode under/overflows where fp32 does not: only fp32/bf16 keep the exact semantics
        reason = f"the fused path keeps the decode path's results only in {FUSED_DTYPES}, not {experts.dtype}"
    if reason is None:
        return "fused", f"fused MXFP4 decode + GEMM ({mxfp4_cpu.KERNEL_NAME}, AVX2/FMA, OpenMP)"
    if requested == "fused":
        raise ValueError(f"the fused MXFP4 CPU path was requested but cannot run: {reason}")
    if on_cpu:
        log_once(f"packed experts on CPU fall back to decode + GEMM: {reason}", logger, logging.WARNING)
    return "decode", f"decode + GEMM in bounded scratch (fused unavailable: {reason})"


@register_backend(REFERENCE_BACKEND)
class TorchExperts:
    """Sort token-slots by expert and run one GEMM pair per active expert.

    ``packed``: ``auto`` (fused on CPU when it builds, else decode), ``fused`` or ``decode``.
    """

    name = REFERENCE_BACKEND

    def __init__(self, scratch_bytes: int = DEFAULT_SCRATCH_BYTES, packed: str = "auto"):
        self.scratch_bytes = check_scratch_bytes(scratch_bytes)
        if packed not in PACKED_PATHS:
            raise ValueError(f"packed experts path must be one of {PACKED_PATHS}, got {packed!r}")
        self.packed = packed

    def path(self, experts: ExpertWeights) -> tuple[str, str]:
        return packed_path(experts, self.packed)

    def __call__(self, h_TD, ids_TK, weights_TK, experts: ExpertWeights, act, act_quant=None):
        out_TD = torch.zeros(ids_TK.shape[0], experts.latent_size, dtype=torch.float32, device=h_TD.device)
        if act_quant is not None:
            h_TD = act_quant(h_TD)
        token_of_slot, slot_weight, counts = slots_by_expert(ids_TK, weights_TK, experts.num_experts)
        starts = (torch.cumsum(counts, 0) - counts).tolist()
        counts = counts.tolist()
        active = [e for e, c in enumerate(counts) if c]
        half = experts.intermediate_size
        if self.path(experts)[0] == "fused":
            dtype = h_TD.dtype
            for expert in active:
                start, count = starts[expert], counts[expert]
                rows = token_of_slot[start : start + count]
                # .to(dtype): where the decode path's GEMM in the compute dtype rounds its output
                w13, s13 = experts.w13[expert], experts.w13_scale[expert]
                gate_up = mxfp4_cpu.linear(h_TD[rows], w13, s13).to(dtype)
                a = act(gate_up[:, :half], gate_up[:, half:]).to(dtype)
                if act_quant is not None:
                    a = act_quant(a)
                y = mxfp4_cpu.linear(a, experts.w2[expert], experts.w2_scale[expert]).to(dtype).float()
                out_TD.index_add_(0, rows, y * slot_weight[start : start + count, None])
            return out_TD
        per_chunk = experts.experts_per_chunk(self.scratch_bytes) if experts.packed else 1
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
