"""The batched path for packed experts on CPU (issue 48): decode tiles, multiply with torch's GEMM.

For an expert that many token-slots routed to, the fused kernel (``mxfp4_cpu.linear``) turns
compute-bound: it decodes in registers and multiplies with AVX2/AVX-512 FMAs. Here the
expert's MXFP4 rows are decoded a tile at a time (``mxfp4_cpu.decode_into``: exact, the same
values as ``mxfp4.decode``) into one reused buffer of a forward, and each tile is multiplied by
torch's GEMM (oneDNN: AMX tiles where the CPU has AMX-BF16), so the weights are read from memory
once, as packed bytes, and no dense expert is kept.

Exactness: this is the ``decode`` path's math (decoded weights in the compute dtype, torch's GEMM
in that dtype, its output rounded there), computed per tile: products are exact, only the fp32
summation order inside the GEMM differs. Which experts take it is decided by ``TorchExperts``
from a crossover measured at load (``crossover.measure``).
"""

from __future__ import annotations

import torch

from . import mxfp4_cpu

# Decoded tile: stays in the last-level cache between its decode and its GEMM, and few enough
# tiles per expert (a K3 gate|up is 44 MB in bf16: 6 tiles) that the two OpenMP regions per tile
# stay cheap. With 0.5-1 MiB tiles a K3 expert took 10-15x longer now and then here: each region
# ends in a barrier that stalls while another process holds one of the 2 cores.
TILE_BYTES = 8 << 20


def tile_buffer(dtype: torch.dtype, scratch_bytes: int) -> torch.Tensor:
    """The reused decode buffer: ``TILE_BYTES`` (less if the scratch budget is smaller) of ``dtype``."""
    return torch.empty(max(1, min(TILE_BYTES, scratch_bytes) // dtype.itemsize), dtype=dtype)


def linear(x_TK: torch.Tensor, packed_NK2: torch.Tensor, scale_NKb: torch.Tensor,
           buffer: torch.Tensor) -> torch.Tensor:
    """``x @ decode(packed, scale).T`` as ``[T, N]`` in ``x``'s dtype (fp32 or bf16; ``buffer`` the same
    dtype), a tile of rows decoded into ``buffer`` and multiplied at a time."""
    T, K = x_TK.shape
    N = packed_NK2.shape[0]
    if buffer.dtype != x_TK.dtype or buffer.numel() < K:
        raise ValueError(f"batched MXFP4 linear: buffer of {buffer.numel()} {buffer.dtype} cannot hold one "
                         f"row of {K} {x_TK.dtype}")
    rows = buffer.numel() // K
    out_NT = torch.empty(N, T, dtype=x_TK.dtype)
    xt_KT = x_TK.t()
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        tile = buffer[: (n1 - n0) * K].view(n1 - n0, K)
        mxfp4_cpu.decode_into(packed_NK2[n0:n1], scale_NKb[n0:n1], tile)
        torch.mm(tile, xt_KT, out=out_NT[n0:n1])
    return out_NT.t()
