"""The private torch names the project needs, in one place (checked against torch 2.13).

torch has no public way to change a process group's collective timeout after it is built, nor to
give a standalone NCCL group one; ``tests/test_private_api.py`` fails when either behaves
differently in a newer torch. Nothing else in the repository may use a private torch name.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist


def set_default_group_timeout(timeout: datetime.timedelta) -> None:
    """Every later collective of the default process group gives up after ``timeout``."""
    dist.distributed_c10d._set_pg_timeout(timeout)


def nccl_options(timeout: datetime.timedelta) -> Any:
    """``ProcessGroupNCCL.Options`` whose collectives give up after ``timeout``."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return options
