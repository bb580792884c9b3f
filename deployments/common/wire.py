"""Tensors on the wire between Ray processes.

Ray serialises numpy arrays out of band (pickle protocol 5, no copy into the pickle stream)
but torch tensors through their generic pickle path, several times slower for large
activations (a 16 MB fp32 [2048, 2048] batch: ~4x on the round trip). Internal hops
(client -> replica -> workers and back) therefore carry a :class:`WireTensor`: the tensor's
bytes as a numpy array plus its torch dtype's name (bfloat16, which numpy lacks, travels as
int16). torch is imported where a tensor is made: the HTTP ingress and the group replica
check, batch and split ``WireTensor``s without it (numpy only: the ingress reads bodies, the
replica only routes rows to its ranks).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moe_runtime.units import VIEW_AS, dtype_name, torch_dtype

if TYPE_CHECKING:
    import torch

FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
_BF16_NAN = 0x7FC0
_BF16_EXPONENT = 0x7F80


@dataclass(frozen=True)
class WireTensor:
    array: np.ndarray
    dtype: str  # torch dtype name without the "torch." prefix

    @classmethod
    def from_torch(cls, t: torch.Tensor) -> WireTensor:

        t = t.detach().cpu().contiguous()
        name = dtype_name(t.dtype)
        view = VIEW_AS.get(name)
        array = (t.view(torch_dtype(view)) if view is not None else t).numpy()
        return cls(array, name)

    def to_torch(self, writable: bool = True) -> torch.Tensor:
        """A torch tensor over the bytes; copied when Ray handed a read-only buffer, unless the
        caller only reads it (``writable=False``: no copy)."""
        import torch

        array = self.array
        if not array.flags.writeable:
            if writable:
                array = array.copy()
            else:
                with warnings.catch_warnings():  # torch warns about read-only buffers; we only read
                    warnings.simplefilter("ignore", UserWarning)
                    return self._view(torch.from_numpy(array))
        return self._view(torch.from_numpy(array))

    def _view(self, t: torch.Tensor) -> torch.Tensor:

        return t.view(torch_dtype(self.dtype)) if self.dtype in VIEW_AS else t

    @classmethod
    def from_float32(cls, array: np.ndarray, dtype: str) -> WireTensor:
        """float32 ``array`` in ``dtype``: bfloat16 rounds to nearest, ties to even, as torch's
        ``Tensor.to`` does (a NaN stays a NaN); float16 rounds the same way in numpy. Always in
        C order, as a tensor's bytes travel (the ranks' kernels then see the same layout)."""
        if dtype == "float32":
            return cls(np.ascontiguousarray(array), dtype)
        if dtype != "bfloat16":
            return cls(array.astype(np.dtype(dtype), order="C"), dtype)
        u = np.ascontiguousarray(array).view(np.uint32)
        bits = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)  # wraps only for NaNs:
        bits[np.isnan(array)] = _BF16_NAN  # set right here
        return cls(bits.view(np.int16), dtype)

    def float32(self) -> np.ndarray:
        """The values as a float32 array in C order (bfloat16 widened exactly)."""
        if self.dtype == "bfloat16":
            return (self.array.view(np.uint16).astype(np.uint32, order="C") << 16).view(np.float32)
        return self.array.astype(np.float32, order="C")

    def all_finite(self) -> bool:
        if self.dtype == "bfloat16":
            return not ((self.array.view(np.uint16) & _BF16_EXPONENT) == _BF16_EXPONENT).any()
        return bool(np.isfinite(self.array).all())

    def rows(self, start: int, stop: int) -> WireTensor:
        """A copy of rows ``start:stop`` (a view would keep the whole batch's buffer alive)."""
        return WireTensor(self.array[start:stop].copy(), self.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


    def part(self, start: int, stop: int) -> WireTensor:
        """Rows ``start:stop`` as a view (sent at once, never kept)."""
        return WireTensor(self.array[start:stop], self.dtype)


@dataclass(frozen=True)
class DeviceRows:
    """Rows that stay on their device: they came, or go, over a device channel
    (``dataplane.channel``) rather than as bytes on a connection. The methods of
    :class:`WireTensor` that the data plane's checks and batches use, on a torch tensor."""

    tensor: torch.Tensor
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def to_torch(self, writable: bool = True) -> torch.Tensor:
        return self.tensor

    def all_finite(self) -> bool:
        import torch

        return bool(torch.isfinite(self.tensor).all())

    def rows(self, start: int, stop: int) -> DeviceRows:
        return DeviceRows(self.tensor[start:stop].clone(), self.dtype)

    def part(self, start: int, stop: int) -> DeviceRows:
        return DeviceRows(self.tensor[start:stop], self.dtype)

    def to_wire(self) -> WireTensor:
        return WireTensor.from_torch(self.tensor)


Rows = WireTensor | DeviceRows


def concat_rows(parts: list[Rows]) -> Rows:
    """``parts`` (one dtype) as one batch, in order; a single part as it is. On a device when
    any part is (the others' rows are copied there)."""
    if len(parts) == 1:
        return parts[0]
    on_device = [p for p in parts if isinstance(p, DeviceRows)]
    if on_device:
        import torch

        device = on_device[0].tensor.device
        return DeviceRows(torch.cat([p.to_torch(writable=False).to(device) for p in parts]), parts[0].dtype)
    return WireTensor(np.concatenate([p.array for p in parts]), parts[0].dtype)


def join_rank_outputs(results: list[tuple[Rows | None, str]]) -> tuple[Rows, str]:
    """The group's output from every rank's ``(out, tail)``: rank 0's, or under sequence
    parallel every rank's rows in rank order; plus the tail that ran."""
    tail = results[0][1]
    if tail == "sequence_parallel":
        return concat_rows([out for out, _ in results]), tail
    return results[0][0], tail
