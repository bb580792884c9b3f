"""The ``torch`` experts backend (the reference): one GEMM pair per active expert.

Packed (MXFP4) experts take one of these paths, the same math:

- ``fused`` (the default on CPU): ``mxfp4_cpu.linear`` decodes the nibbles inside the GEMM (in
  registers, fp32 accumulation), so no dense expert and no decode scratch exist. Each GEMM's
  fp32 output is rounded to the compute dtype exactly where the ``decode`` path's GEMM in that
  dtype rounds it, so the two differ only by the order of fp32 additions (tests/test_fused_cpu.py
  derives and tests the bound). Under ``auto`` an expert with at least the measured crossover of
  token-slots takes the ``batched`` path instead (``batched.py``: tiles decoded in cache,
  torch's GEMM; AMX where the CPU has it): the crossover is timed once per shape at load
  (``prepare``), fused against batched on the layer's own first expert.
- ``decode`` (GPUs, and CPUs where the fused kernel cannot be built: logged once as a WARNING
  with the reason): active experts are decoded to the compute dtype a chunk at a time, each
  chunk's decoded weights (and decode temporaries) within ``scratch_bytes``, then multiplied.
"""

from __future__ import annotations

import itertools
import logging

import torch

from ..logs import log_once, logger
from ..weights import ExpertWeights
from . import batched, crossover, mxfp4_cpu
from .base import (
    DEFAULT_SCRATCH_BYTES,
    REFERENCE_BACKEND,
    check_scratch_bytes,
    register_backend,
    slots_by_expert,
)

PACKED_PATHS = ("auto", "fused", "batched", "decode")
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
    if reason is None and requested == "batched":
        return "batched", "batched requested: tiles decoded in cache, torch's GEMM, for every expert"
    if reason is None:
        return "fused", f"fused MXFP4 decode + GEMM ({mxfp4_cpu.KERNEL_NAME}, {mxfp4_cpu.isa()}, OpenMP)"
    if requested in ("fused", "batched"):
        raise ValueError(f"the {requested} MXFP4 CPU path was requested but cannot run: {reason}")
    if on_cpu:
        log_once(f"packed experts on CPU fall back to decode + GEMM: {reason}", logger, logging.WARNING)
    return "decode", f"decode + GEMM in bounded scratch (fused unavailable: {reason})"


@register_backend(REFERENCE_BACKEND)
class TorchExperts:
    """Sort token-slots by expert and run one GEMM pair per active expert.

    ``packed``: ``auto`` (fused on CPU when it builds, batched from the measured crossover, else
    decode), ``fused`` (never batched), ``batched`` (every expert) or ``decode``.
    """

    name = REFERENCE_BACKEND

    def __init__(self, scratch_bytes: int = DEFAULT_SCRATCH_BYTES, packed: str = "auto"):
        self.scratch_bytes = check_scratch_bytes(scratch_bytes)
        if packed not in PACKED_PATHS:
            raise ValueError(f"packed experts path must be one of {PACKED_PATHS}, got {packed!r}")
        self.packed = packed

    def path(self, experts: ExpertWeights) -> tuple[str, str]:
        path, why = packed_path(experts, self.packed)
        found = _CROSSOVERS.get(_crossover_key(experts))
        if path == "fused" and self.packed == "auto" and found is not None:
            engine = crossover.gemm_engine()
            why += f"; batched (torch's GEMM on {engine}): {found.describe('fused', 'batched')}"
        return path, why

    def prepare(self, experts: ExpertWeights) -> None:
        """Measure, once per expert shape and thread count, from how many token-slots per expert the
        batched path beats the fused one (``auto`` on the fused path only)."""
        if self.packed == "auto" and self.path(experts)[0] == "fused":
            self.crossover(experts)

    def crossover(self, experts: ExpertWeights) -> crossover.Crossover:
        key = _crossover_key(experts)
        if key not in _CROSSOVERS:
            _CROSSOVERS[key] = found = _measure_crossover(experts, self.scratch_bytes)
            crossover.log_engine()
            logger.info(f"packed experts {key[:2]} in {experts.dtype}: {found.describe('fused', 'batched')}")
        return _CROSSOVERS[key]

    def _fused_or_batched(self, h_TD, slots: tuple, experts: ExpertWeights, act, act_quant, out_TD):
        """Each active expert through the fused kernel, or the batched path when ``batched`` was
        requested or its token-slots reach the measured crossover (``auto``)."""
        token_of_slot, slot_weight, starts, counts, active = slots
        dtype, half = h_TD.dtype, experts.intermediate_size
        everyone = self.path(experts)[0] == "batched"
        found = self.crossover(experts) if self.packed == "auto" and mxfp4_cpu.batched_enabled() else None
        buffer = None  # the batched path's decode tile: this forward's workspace, not kept

        def project(x, packed, scale, batch: bool) -> torch.Tensor:
            nonlocal buffer
            if batch:
                buffer = batched.tile_buffer(dtype, self.scratch_bytes) if buffer is None else buffer
                return batched.linear(x, packed, scale, buffer)
            # .to(dtype): where the decode path's GEMM in the compute dtype rounds its output
            return mxfp4_cpu.linear(x, packed, scale).to(dtype)

        for expert in active:
            start, count = starts[expert], counts[expert]
            rows = token_of_slot[start : start + count]
            batch = everyone or (found is not None and found.uses_second(count))
            gate_up = project(h_TD[rows], experts.w13[expert], experts.w13_scale[expert], batch)
            a = act(gate_up[:, :half], gate_up[:, half:]).to(dtype)
            if act_quant is not None:
                a = act_quant(a)
            y = project(a, experts.w2[expert], experts.w2_scale[expert], batch).float()
            out_TD.index_add_(0, rows, y * slot_weight[start : start + count, None])
        return out_TD

    def __call__(self, h_TD, ids_TK, weights_TK, experts: ExpertWeights, act, act_quant=None):
        out_TD = torch.zeros(ids_TK.shape[0], experts.latent_size, dtype=torch.float32, device=h_TD.device)
        if act_quant is not None:
            h_TD = act_quant(h_TD)
        token_of_slot, slot_weight, counts = slots_by_expert(ids_TK, weights_TK, experts.num_experts)
        starts = (torch.cumsum(counts, 0) - counts).tolist()
        counts = counts.tolist()
        active = [e for e, c in enumerate(counts) if c]
        half = experts.intermediate_size
        if self.path(experts)[0] in ("fused", "batched"):
            slots = (token_of_slot, slot_weight, starts, counts, active)
            return self._fused_or_batched(h_TD, slots, experts, act, act_quant, out_TD)
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


_CROSSOVERS: dict[tuple, crossover.Crossover] = {}


def _crossover_key(experts: ExpertWeights) -> tuple:
    return (tuple(experts.w13.shape[1:]), tuple(experts.w2.shape[1:]), experts.dtype, torch.get_num_threads())


def _measure_crossover(experts: ExpertWeights, scratch_bytes: int) -> crossover.Crossover:
    """Fused vs batched on both projections (random rows in the compute dtype), each call on the
    next expert in turn: as in a forward, the weights come from memory, not from a cache that
    one expert fits in."""
    D, I = experts.latent_size, experts.intermediate_size
    h = torch.randn(crossover.COUNTS[-1], D).to(experts.dtype)
    a = torch.randn(crossover.COUNTS[-1], I).to(experts.dtype)
    buffer = batched.tile_buffer(experts.dtype, scratch_bytes)
    turn = itertools.count()

    def fused(m: int) -> None:
        e = next(turn) % experts.num_experts
        mxfp4_cpu.linear(h[:m], experts.w13[e], experts.w13_scale[e])
        mxfp4_cpu.linear(a[:m], experts.w2[e], experts.w2_scale[e])

    def tiles(m: int) -> None:
        e = next(turn) % experts.num_experts
        batched.linear(h[:m], experts.w13[e], experts.w13_scale[e], buffer)
        batched.linear(a[:m], experts.w2[e], experts.w2_scale[e], buffer)

    return crossover.measure(fused, tiles)
