"""Device channels: a peer's rows reach rank 0, and its slice comes back, over a process group of two.

On GPUs the rows should not cross the host: a peer whose rows live on a GPU (a vLLM engine's
hidden states) joins with a channel, and each layer's header still travels on the peer's admitted
connection (``frames``, flag ``ON_CHANNEL``) while the array itself goes over a
``torch.distributed`` process group of exactly two members, the peer and rank 0: NCCL between
CUDA devices (RCCL on ROCm builds of torch, under the same name), gloo between CPU processes. The
CPU tests run the gloo channel through the same code the GPU check runs with NCCL.

The group is built from a TCP store that rank 0 hosts on its node's address (its port is in the
ticket), under a prefix made of the session's number, the peer's index and a random key the peer
sends on its admitted connection: no ``init_process_group``, no global state, nothing shared with
the ranks' own TP group. A process that cannot answer the session's challenge never learns a key.

Faults: every receive and send waits at most the call bound; a channel whose wait failed is
aborted and its peer dropped as a connection that closed would be.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch
import torch.distributed as dist

from moe_runtime.private_api import nccl_options
from moe_runtime.units import torch_dtype

from ..common.wire import DeviceRows, WireTensor

BACKENDS = ("gloo", "nccl")
TAG = 0
STORE_PREFIX = "latent-moe-channel"


def backend_for(device: torch.device | str) -> str:
    """The channel a rank on ``device`` takes: NCCL (RCCL) for a GPU, gloo for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"a device channel's backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not dist.is_nccl_available():
        raise ValueError("a device channel over NCCL needs a torch build with NCCL (or RCCL); this torch "
                         f"{torch.__version__} has none: join without a channel")


class ChannelStore:
    """Rank 0's store for its peers' channels, listening on ``bind_ip`` (a free port)."""

    def __init__(self, bind_ip: str, timeout_s: float):
        self.store = dist.TCPStore(bind_ip, 0, None, True, datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.host, self.port = bind_ip, self.store.port


class Channel:
    """One side of a peer's channel: ``me`` 0 is rank 0, 1 the peer. ``store``: rank 0's own
    :class:`ChannelStore`, or None to reach it at ``host:port``."""

    def __init__(self, backend: str, host: str, port: int, prefix: str, me: int, device: torch.device | str,
                 timeout_s: float, store: ChannelStore | None = None):
        check_backend(backend)
        self.backend, self.me, self.device = backend, me, torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        base = store.store if store is not None else dist.TCPStore(host, port, None, False, self.timeout)
        prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{prefix}", base)
        if backend == "gloo":
            self.group: Any = dist.ProcessGroupGloo(prefixed, me, 2, self.timeout)
        else:
            self.group = dist.ProcessGroupNCCL(prefixed, me, 2, nccl_options(self.timeout))

    def send(self, rows: DeviceRows | WireTensor) -> Any:
        """Start sending ``rows`` (moved to this side's device); wait on what it returns."""
        tensor = rows.to_torch(writable=False).to(self.device).contiguous()
        work = self.group.send([tensor], 1 - self.me, TAG) if tensor.numel() else None
        return _Sent(work, tensor, self.timeout)

    def recv(self, shape: tuple[int, ...], dtype: str) -> DeviceRows:
        """The other side's next rows: ``shape`` in ``dtype``, on this side's device."""
        tensor = torch.empty(shape, dtype=torch_dtype(dtype), device=self.device)
        if tensor.numel():
            self.group.recv([tensor], 1 - self.me, TAG).wait(self.timeout)
        return DeviceRows(tensor, dtype)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.group.abort()


class _Sent:
    """A send in flight: its tensor is kept until it is done."""

    def __init__(self, work: Any, tensor: torch.Tensor, timeout: datetime.timedelta):
        self.work, self.tensor, self.timeout = work, tensor, timeout

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait(self.timeout)
