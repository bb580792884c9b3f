"""The private torch names the project needs, in one place (checked against torch 2.13).

torch has no public way to change a process group's collective timeout after it is built, nor to
give a standalone NCCL group one, nor a public grouped GEMM; ``tests/test_private_api.py`` fails
when any of them behaves differently in a newer torch. Nothing else in the repository may use a
private torch name.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

GROUPED_MM = "torch._grouped_mm"  # the grouped GEMM's name, for the reasons a backend gives


def set_default_group_timeout(timeout: datetime.timedelta) -> None:
    """Every later collective of the default process group gives up after ``timeout``."""
    dist.distributed_c10d._set_pg_timeout(timeout)


def nccl_options(timeout: datetime.timedelta) -> Any:
    """``ProcessGroupNCCL.Options`` whose collectives give up after ``timeout``."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return options


def has_grouped_mm() -> bool:
    """Whether this torch has the grouped GEMM op (it came with torch 2.8)."""
    return callable(getattr(torch, "_grouped_mm", None))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row block ``g`` of ``a [M, K]`` times ``b[g]`` (``b [G, K, N]``) for every ``g`` in one
    call: ``[M, N]``. ``offs`` (int32 ``[G]``) holds the blocks' running row ends, so block ``g`` is
    rows ``offs[g-1]:offs[g]``; empty blocks are allowed. torch 2.13 runs it on CPU (fp32, bf16,
    fp16), CUDA and ROCm builds (bf16 takes a fused kernel on recent GPUs, other dtypes a loop over
    the groups inside the op)."""
    return torch._grouped_mm(a, b, offs=offs)
