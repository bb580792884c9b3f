"""Read Kimi-K3-format safetensors checkpoints one layer, and one TP shard, at a time.

Only the tensors (and, for split tensors, the slices) a rank needs are read; nothing loads a
whole file. How a slice is read (measured in docs/benchmarks/real.md, issue 17 item 5):

- a slice that is one byte range of its file and already in the compute dtype (replicated
  tensors, row-split ones) is a zero-copy view of a private read-only mapping of the file, its
  pages mapped at load (``MADV_POPULATE_READ``) so the load, not the first forward, reads them;
- the routed experts are copied into tensors allocated once (they are stacked ``[E, ...]``, which
  the file's one-tensor-per-expert layout cannot be a view of) by ``pread`` straight into the
  destination, from a few threads: no mapping of the expert bytes stays behind, and no
  OpenMP-parallel copy faults pages of a mapping (on a busy machine that ran at ~0.3 GB/s);
- a column slice (split along dim 1) is copied out of a short-lived mapping of its tensor: a
  contiguous tensor of exactly the slice, never a strided view that keeps the whole tensor's
  pages mapped and is copied again by every GEMM that needs it contiguous.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from . import mxfp4
from .config import LatentMoEConfig
from .tp.sharding import Split, TPShard
from .units import DENSE, EXPERT_FORMATS, MXFP4, SAFETENSORS_CODES, format_layers, torch_dtype
from .weights import ExpertWeights, LayerWeights

PREFIXES = (
    "language_model.layers.{i}.block_sparse_moe.",
    "language_model.model.layers.{i}.block_sparse_moe.",
    "model.layers.{i}.block_sparse_moe.",
)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype codes -> torch dtypes (the ones a checkpoint of this model may hold)
ST_DTYPES = {code: torch_dtype(name) for name, code in SAFETENSORS_CODES.items()}
# ``read_many``'s unit of work per thread (between the two), and how far ahead it asks the kernel
# to read.
READAHEAD_BYTES = 64 * 2**20
MIN_CHUNK_BYTES = 2**20
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header
PAGE = mmap.PAGESIZE
# Linux >= 5.14; Python's mmap module does not name it. Older kernels answer EINVAL and the pages
# are touched one byte each instead.
MADV_POPULATE_READ = 22


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in its safetensors file: ``offset`` is absolute (header included)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in ST_DTYPES:
            raise ValueError(f"safetensors dtype {self.dtype} is not supported (known: {sorted(ST_DTYPES)})")
        return ST_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file (8-byte little-endian header length, JSON header,
    data), checked against the file's size; ValueError naming the file when it is not one."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header length {length} does not fit the file's {size} bytes")
            header = json.loads(f.read(length))
        data_start = 8 + length
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = (int(v) for v in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
            entry = TensorEntry(str(info["dtype"]), shape, data_start + begin, end - begin)
            if not 0 <= begin <= end or entry.offset + entry.nbytes > size:
                raise ValueError(f"{name}: data_offsets {[begin, end]} lie outside the file's data")
            if entry.dtype in ST_DTYPES and entry.nbytes != prod(entry.shape) * entry.itemsize:
                raise ValueError(f"{name}: {entry.nbytes} bytes for {entry.dtype} {list(entry.shape)}")
            entries[name] = entry
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot open {path}: not a readable safetensors file ({exc})") from exc
    return entries


def _pread_into(fd: int, out: memoryview, offset: int) -> None:
    """Fill ``out`` from the file at ``offset`` (``preadv``: the kernel copies page cache straight
    into it; where the OS lacks it, ``pread`` and one more copy)."""
    done = 0
    while done < len(out):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [out[done:]], offset + done)
        else:
            data = os.pread(fd, len(out) - done, offset + done)
            n = len(data)
            out[done : done + n] = data
        if n == 0:
            raise ValueError(f"unexpected end of file at byte {offset + done}")
        done += n


class _TensorFile:
    """One safetensors file: its header, a descriptor for ``pread`` and (made on first use) one
    private read-only mapping that zero-copy views share."""

    def __init__(self, path: Path):
        self.path = path
        self.entries = read_safetensors_header(path)
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)  # views keep the mapping, which has its own fd
        if hasattr(os, "posix_fadvise"):  # a rank reads its slices in file order: larger readahead
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()

    def mapping(self) -> mmap.mmap:
        with self._lock:
            if self._map is None:
                # ACCESS_COPY (MAP_PRIVATE): writable for torch.frombuffer, and a write to a view
                # would land in a private page, never in the file
                self._map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY)
            return self._map


def _populate(mapping: mmap.mmap, offset: int, nbytes: int) -> None:
    """Map ``[offset, offset + nbytes)`` of the file now: readahead, then every page mapped."""
    start = offset - offset % PAGE
    length = offset + nbytes - start
    try:
        mapping.madvise(mmap.MADV_WILLNEED, start, length)
        mapping.madvise(MADV_POPULATE_READ, start, length)
    except (OSError, AttributeError, ValueError):  # old kernel or no madvise: touch each page
        np.frombuffer(mapping, np.uint8, length, start)[::PAGE].max()


@dataclass(frozen=True)
class _Slice:
    """``[start, stop)`` along ``dim`` of a tensor (``dim`` None: all of it), as byte geometry."""

    entry: TensorEntry
    dim: int | None
    start: int
    stop: int | None

    @property
    def shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.entry.shape
        shape = list(self.entry.shape)
        shape[self.dim] = len(range(shape[self.dim])[self.start : self.stop])
        return tuple(shape)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.entry.itemsize

    @property
    def _row_bytes(self) -> int:
        """Bytes of one index along dim 0 (a row; one element of a 1-D tensor)."""
        return prod(self.entry.shape[1:]) * self.entry.itemsize

    def byte_range(self) -> tuple[int, int] | None:
        """``(file offset, length)`` when the slice is one contiguous byte range, else None."""
        e = self.entry
        if self.dim is None:
            return e.offset, e.nbytes
        first = range(e.shape[self.dim])[self.start : self.stop]
        if self.dim == 0:
            return e.offset + first.start * self._row_bytes, len(first) * self._row_bytes
        if len(e.shape) == 2 and len(first) == e.shape[1]:  # every column: whole rows
            return e.offset, e.nbytes
        return None

    def file_span(self) -> tuple[int, int]:
        """``(file offset, length)`` of the bytes reading the slice takes from the file (a column
        slice reads whole rows)."""
        return self.byte_range() or (self.entry.offset, self.entry.nbytes)


# One read: (tensor name, dim, start, stop) as CheckpointReader.read takes them.
Read = tuple[str, int | None, int, int | None]


class CheckpointReader:
    """Maps tensor names to files and reads whole tensors or slices of them (module docstring:
    how). ``bytes_read`` counts the bytes of every slice handed out, as stored in the file."""

    def __init__(self, checkpoint: str | Path):
        self.root = Path(checkpoint)
        self._files: dict[Path, _TensorFile] = {}
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{index} is not a valid safetensors index: {exc}") from exc
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError(
                    f"{index} is not a valid safetensors index: weight_map must map tensor names to "
                    f"file names, got {str(weight_map)[:80]}"
                )
            self._file_of = {name: self.root / fname for name, fname in weight_map.items()}
        elif (self.root / SINGLE_FILE).is_file():
            path = self.root / SINGLE_FILE
            self._file_of = dict.fromkeys(self._open(path).entries, path)
        else:
            raise ValueError(f"{self.root} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.bytes_read = 0
        self._count_lock = threading.Lock()
        self._located: dict[str, tuple[_TensorFile, TensorEntry]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _open(self, path: Path) -> _TensorFile:
        if path not in self._files:
            self._files[path] = _TensorFile(path)
        return self._files[path]


    def _locate(self, name: str) -> tuple[_TensorFile, TensorEntry]:
        if name in self._located:  # a rank asks about each of thousands of tensors several times
            return self._located[name]
        if name not in self._file_of:
            raise ValueError(f"checkpoint {self.root} has no tensor {name!r}")
        path = self._file_of[name]
        if path not in self._files and not path.is_file():
            raise ValueError(f"tensor {name!r} is mapped to {path.name}, which does not exist")
        file = self._open(path)
        if name not in file.entries:
            raise ValueError(f"tensor {name!r} is mapped to {path.name}, which does not hold it")
        self._located[name] = file, file.entries[name]
        return self._located[name]

    def _slice(self, name: str, dim: int | None, start: int, stop: int | None) -> tuple[_TensorFile, _Slice]:
        file, entry = self._locate(name)
        if dim is not None and not 0 <= dim < min(2, len(entry.shape)):
            raise ValueError(f"{name}: can slice dim 0 or 1 of a 1-D or 2-D tensor, not dim {dim} of "
                             f"{entry.shape}")
        return file, _Slice(entry, dim, start, stop)

    def _count(self, nbytes: int) -> None:
        with self._count_lock:
            self.bytes_read += nbytes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._locate(name)[1].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._locate(name)[1].torch_dtype

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """A new tensor holding ``name``, or only ``[start, stop)`` along ``dim`` when given."""
        _, sl = self._slice(name, dim, start, stop)
        out = torch.empty(sl.shape, dtype=sl.entry.torch_dtype)
        self.read_into(out, name, dim, start, stop)
        return out

    def read_into(
        self, out: torch.Tensor, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> None:
        """Read the slice into ``out``: a contiguous CPU tensor of the slice's shape and the
        file's dtype (e.g. one expert's rows of a stacked tensor). Thread-safe."""
        file, sl = self._slice(name, dim, start, stop)
        if tuple(out.shape) != sl.shape or out.dtype != sl.entry.torch_dtype or not out.is_contiguous():
            raise ValueError(
                f"{name}: cannot read a {sl.entry.dtype} {list(sl.shape)} slice into a "
                f"{'' if out.is_contiguous() else 'non-contiguous '}{out.dtype} {list(out.shape)} tensor"
            )
        if out.numel():
            dst = out.view(-1).view(torch.uint8).numpy()
            span = sl.byte_range()
            if span is not None:
                _pread_into(file.fd, memoryview(dst), span[0])
            else:
                self._read_columns(file, sl, dst)
        self._count(sl.nbytes)

    def _read_columns(self, file: _TensorFile, sl: _Slice, dst: np.ndarray) -> None:
        """A dim-1 slice of a 2-D tensor: the slice's columns copied out of a mapping of just that
        tensor's pages, unmapped right after (no page of it stays mapped in the process)."""
        rows, row_bytes = sl.entry.shape[0], sl._row_bytes
        first = range(sl.entry.shape[1])[sl.start : sl.stop]
        lo, hi = first.start * sl.entry.itemsize, first.stop * sl.entry.itemsize
        start = sl.entry.offset - sl.entry.offset % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(file.fd, sl.entry.offset + sl.entry.nbytes - start, access=mmap.ACCESS_READ,
                       offset=start) as pages:
            src = np.frombuffer(pages, np.uint8, sl.entry.nbytes, sl.entry.offset - start)
            dst.reshape(rows, hi - lo)[:] = src.reshape(rows, row_bytes)[:, lo:hi]
            del src  # the mapping cannot close while an array holds it

    def read_many(
        self, items: Sequence[tuple[torch.Tensor, Read]], threads: int = 1,
        done: Callable[[int], object] | None = None,
    ) -> None:
        """Read every ``(out, (name, dim, start, stop))`` into its ``out`` (converted when ``out``'s
        dtype is not the file's); ``done(nbytes)`` after each. The items are read in file order in
        chunks of at most ``READAHEAD_BYTES``, which ``threads`` threads take one at a time (a thread
        the OS deschedules delays only its chunk); a chunk first tells the kernel its own ranges
        and the next chunk's (``POSIX_FADV_WILLNEED``), so a cold page cache is filled in large
        requests even where a rank's slices leave gaps between them."""
        plan = []
        for out, what in items:
            file, sl = self._slice(*what)
            plan.append((str(file.path), *sl.file_span(), file, out, what))
        plan.sort(key=lambda p: p[:2])
        # at least ~4 chunks per thread, so a slow thread's last chunk is a small share of the work
        chunk_bytes = max(MIN_CHUNK_BYTES, min(READAHEAD_BYTES, sum(p[2] for p in plan) // (4 * threads)))
        chunks: list[list[tuple]] = [[]]
        size = 0
        for p in plan:
            if size >= chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(p)
            size += p[2]

        def announce(chunk: list[tuple]) -> None:
            if hasattr(os, "posix_fadvise"):
                for _, offset, nbytes, file, _, _ in chunk:
                    os.posix_fadvise(file.fd, offset, nbytes, os.POSIX_FADV_WILLNEED)

        def read_chunk(k: int) -> None:
            announce(chunks[k])
            if k + 1 < len(chunks):
                announce(chunks[k + 1])
            for _, _, _, _, out, what in chunks[k]:
                if out.dtype == self.dtype(what[0]):
                    self.read_into(out, *what)
                else:  # e.g. dense experts stored in bf16, computed in fp32
                    out.copy_(self.read(*what))
                if done is not None:
                    done(out.numel() * out.element_size())

        if threads == 1 or len(chunks) == 1:
            for k in range(len(chunks)):
                read_chunk(k)
        else:
            with ThreadPoolExecutor(min(threads, len(chunks)), thread_name_prefix="checkpoint-read") as pool:
                list(pool.map(read_chunk, range(len(chunks))))

    def view(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor | None:
        """A zero-copy, read-only-backed view of the slice with its pages mapped now, or None
        when the slice is not one byte range aligned to its dtype (then ``read`` it). The file's
        mapping lives as long as any view of it."""
        file, sl = self._slice(name, dim, start, stop)
        span = sl.byte_range()
        if span is None or span[0] % sl.entry.itemsize or not span[1]:
            return None
        offset, nbytes = span
        mapping = file.mapping()
        _populate(mapping, offset, nbytes)
        count = nbytes // sl.entry.itemsize
        t = torch.frombuffer(mapping, dtype=sl.entry.torch_dtype, count=count, offset=offset)
        self._count(nbytes)
        return t.view(sl.shape)

    def layer_prefix(self, layer: int) -> str:
        for pattern in PREFIXES:
            prefix = pattern.format(i=layer)
            if prefix + "gate.weight" in self:
                return prefix
        raise ValueError(
            f"checkpoint {self.root} has no tensors for layer {layer} "
            f"(looked for {' or '.join(p.format(i=layer) + 'gate.weight' for p in PREFIXES)})"
        )


class _LayerLoader:
    """Reads one layer for one rank, checking every tensor's full shape first."""

    def __init__(
        self, reader: CheckpointReader, cfg: LatentMoEConfig, layer: int, shard: TPShard, dtype: torch.dtype
    ):
        cfg.check_moe_layer(layer)
        self.reader, self.cfg, self.shard, self.dtype = reader, cfg, shard, dtype
        self.prefix = reader.layer_prefix(layer)

    def _check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        found = self.reader.shape(name)
        if found != expected:
            raise ValueError(f"tensor {name!r} has shape {found}, expected {expected}")

    def _span(self, key: str, full: tuple[int, ...], name: str) -> tuple[int | None, int, int | None]:
        placement = self.shard.placement(key)
        if placement is Split.REPLICATE:
            return None, 0, None
        dim = 0 if placement is Split.ROWS else 1
        start, stop = self.shard.span(full[dim], f"dim {dim} of {name}")
        return dim, start, stop

    def dense(
        self, suffix: str, full: tuple[int, ...], key: str | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """This rank's slice of a dense tensor in ``dtype`` (default: the compute dtype): a
        zero-copy view of the file when it is one byte range already in that dtype, else a copy."""
        name = self.prefix + suffix
        self._check_shape(name, full)
        dim, start, stop = self._span(key or suffix, full, name)
        dtype = dtype or self.dtype
        if self.reader.dtype(name) == dtype:
            view = self.reader.view(name, dim, start, stop)
            if view is not None:
                return view
        return self.reader.read(name, dim, start, stop).to(dtype)

    def is_packed(self, base: str) -> bool:
        """Whether matrix ``base`` (e.g. ``experts.3.w1``) is stored dense or MXFP4."""
        if self.prefix + base + ".weight" in self.reader:
            return False
        if self.prefix + base + ".weight_packed" in self.reader:
            return True
        raise ValueError(
            f"checkpoint has neither {self.prefix + base + '.weight'!r} "
            f"nor {self.prefix + base + '.weight_packed'!r}"
        )

    def packed_reads(self, base: str, key: str, full: tuple[int, int]) -> tuple[Read, Read]:
        """What to read for this rank's slice of an MXFP4 matrix: ``(nibbles, scales)``, each as
        ``(name, dim, start, stop)``, after checking both tensors' shapes and the block boundary."""
        packed_name, scale_name = self.prefix + base + ".weight_packed", self.prefix + base + ".weight_scale"
        rows, cols = full
        if cols % mxfp4.BLOCK:
            raise ValueError(f"{packed_name}: input dim {cols} is not a multiple of {mxfp4.BLOCK}")
        self._check_shape(packed_name, (rows, cols // 2))
        self._check_shape(scale_name, (rows, cols // mxfp4.BLOCK))
        dim, start, stop = self._span(key, full, base)
        if dim == 1:
            width = stop - start
            if width % mxfp4.BLOCK:
                raise ValueError(
                    f"{base} is MXFP4 with {mxfp4.BLOCK}-element blocks along dim 1, but each rank's "
                    f"slice is {cols} / TP {self.shard.world} = {width} columns, not a multiple of "
                    f"{mxfp4.BLOCK}: the slices do not fall on a block boundary"
                )
            return (
                (packed_name, 1, start // 2, stop // 2),
                (scale_name, 1, start // mxfp4.BLOCK, stop // mxfp4.BLOCK),
            )
        return (packed_name, dim, start, stop), (scale_name, dim, start, stop)

    def packed(self, base: str, key: str, full: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of an MXFP4 matrix, still packed: ``(nibbles, scales)``."""
        nibbles, scales = self.packed_reads(base, key, full)
        return self.reader.read(*nibbles), self.reader.read(*scales)

    def matrix(self, base: str, key: str, full: tuple[int, int]) -> torch.Tensor:
        """This rank's slice of a dense or MXFP4 matrix in the compute dtype (MXFP4 decoded)."""
        if not self.is_packed(base):
            return self.dense(base + ".weight", full, key=key)
        return mxfp4.decode(*self.packed(base, key, full), self.dtype)


def load_threads() -> int:
    """Threads that read a rank's experts: its torch threads (its share of the CPUs), at most
    ``LOAD_THREADS_MAX``. Each copies page cache into fresh pages, which costs a page fault per
    4 KiB of destination; in parallel those faults overlap."""
    return max(1, min(torch.get_num_threads(), LOAD_THREADS_MAX))


LOAD_THREADS_MAX = 16  # a bound on threads per rank, not a measured optimum


def _load_experts(ld: _LayerLoader, progress: bool | None, threads: int) -> ExpertWeights:
    """Every routed expert into tensors allocated once up front (no list-then-stack copy), each
    slice read straight into its place: MXFP4 experts stay packed, dense ones are converted to
    the compute dtype. Every name and shape is checked before the first byte is read."""
    cfg, world = ld.cfg, ld.shard.world
    E, D, I = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    I_local = I // world
    packed = ld.is_packed("experts.0.w1")
    if packed:
        w13 = torch.empty(E, 2 * I_local, D // 2, dtype=torch.uint8)
        w2 = torch.empty(E, D, I_local // 2, dtype=torch.uint8)
        w13_s = torch.empty(E, 2 * I_local, D // mxfp4.BLOCK, dtype=torch.uint8)
        w2_s = torch.empty(E, D, I_local // mxfp4.BLOCK, dtype=torch.uint8)
    else:
        w13, w2 = torch.empty(E, 2 * I_local, D, dtype=ld.dtype), torch.empty(E, D, I_local, dtype=ld.dtype)
        w13_s = w2_s = None
    reads: list[tuple[torch.Tensor, Read]] = []  # (where it goes, what)
    for e in range(E):
        for which, full, dst, dst_scale, rows in (
            ("w1", (I, D), w13, w13_s, slice(0, I_local)),
            ("w3", (I, D), w13, w13_s, slice(I_local, 2 * I_local)),
            ("w2", (D, I), w2, w2_s, slice(None)),
        ):
            base = f"experts.{e}.{which}"
            if ld.is_packed(base) != packed:
                raise ValueError(
                    f"{ld.prefix}{base} is {'dense' if packed else 'MXFP4'} but experts.0.w1 is "
                    f"{'MXFP4' if packed else 'dense'}: a layer's routed experts must share one format"
                )
            if packed:
                nibbles, scales = ld.packed_reads(base, which, full)
                reads += [(dst[e, rows], nibbles), (dst_scale[e, rows], scales)]
            else:
                name = ld.prefix + base + ".weight"
                ld._check_shape(name, full)
                reads.append((dst[e, rows], (name, *ld._span(which, full, name))))
    if progress is None:
        progress = sys.stderr.isatty()
    total = sum(out.numel() * out.element_size() for out, _ in reads)
    with tqdm(total=total, desc="loading experts", unit="B", unit_scale=True, file=sys.stderr,
              disable=not progress) as bar:
        ld.reader.read_many(reads, threads, bar.update)
    return ExpertWeights(w13, w2, w13_s, w2_s, dtype=ld.dtype)


def load_layer_weights(
    checkpoint: str | Path | CheckpointReader,
    cfg: LatentMoEConfig,
    layer: int,
    dtype: torch.dtype = torch.float32,
    shard: TPShard | None = None,
    progress: bool | None = False,
    threads: int | None = None,
) -> LayerWeights:
    """Load one MoE layer's tensors (this rank's slices only) in ``dtype``; MXFP4 routed
    experts stay packed. ``progress``: a bar over experts on stderr (None: when it is a TTY).
    ``threads``: readers of the experts (default ``load_threads()``)."""
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    ld = _LayerLoader(reader, cfg, layer, shard or TPShard(), dtype)
    H, D, E = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts
    Is = cfg.shared_intermediate_size
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    experts = _load_experts(ld, progress, threads or load_threads())
    shared = (None, None, None)
    if cfg.num_shared_experts:
        shared = (
            ld.matrix("shared_experts.gate_proj", "shared_experts.gate_proj.weight", (Is, H)),
            ld.matrix("shared_experts.up_proj", "shared_experts.up_proj.weight", (Is, H)),
            ld.matrix("shared_experts.down_proj", "shared_experts.down_proj.weight", (H, Is)),
        )
    return LayerWeights(
        gate_EH=ld.dense("gate.weight", (E, H), dtype=torch.float32),
        bias_E=ld.dense("gate.e_score_correction_bias", (E,), dtype=torch.float32),
        down_DH=ld.dense("routed_expert_down_proj.weight", (D, H)),
        norm_D=(
            ld.dense("routed_expert_norm.weight", (D,), dtype=torch.float32)
            if cfg.latent_moe_use_norm
            else None
        ),
        up_HD=ld.dense("routed_expert_up_proj.weight", (H, D)),
        experts=experts,
        shared_gate_SH=shared[0],
        shared_up_SH=shared[1],
        shared_down_HS=shared[2],
    )


# -- which format a checkpoint's experts are in -----------------------------------------------


def checkpoint_has_weights(checkpoint: str | Path) -> bool:
    root = Path(checkpoint)
    return (root / INDEX_FILE).is_file() or (root / SINGLE_FILE).is_file()


def checkpoint_expert_formats(checkpoint: Any, cfg: LatentMoEConfig, layers: Iterable[int]) -> dict[int, str]:
    """Per layer, ``"mxfp4"`` when expert 0's gate projection is stored as ``weight_packed`` +
    ``weight_scale`` (uint8), ``"dense"`` when it is a plain ``weight``; reads names only.

    ``checkpoint``: a folder or a ``CheckpointReader``.
    """
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    formats = {}
    for layer in layers:
        base = reader.layer_prefix(layer) + "experts.0.w1."
        if base + "weight_packed" in reader and base + "weight_scale" in reader:
            formats[layer] = MXFP4
        elif base + "weight" in reader:
            formats[layer] = DENSE
        else:
            raise ValueError(
                f"checkpoint {reader.root} stores layer {layer}'s experts neither dense "
                f"({base}weight) nor MXFP4 ({base}weight_packed + weight_scale)"
            )
    return formats


def resolve_expert_formats(
    cfg: LatentMoEConfig,
    layers: Sequence[int],
    checkpoint: str | Path | None = None,
    experts_format: str | None = None,
) -> dict[int, str] | None:
    """The experts format of every layer: read from the checkpoint's tensor names when it holds
    weights (an explicit ``experts_format`` must then agree), else ``experts_format`` (a
    config-only checkpoint); None when neither says."""
    if experts_format is not None and experts_format not in EXPERT_FORMATS:
        raise ValueError(f"experts_format {experts_format!r} is not one of {EXPERT_FORMATS}")
    if checkpoint is not None and checkpoint_has_weights(checkpoint):
        found = checkpoint_expert_formats(checkpoint, cfg, layers)
        wrong = sorted(layer for layer, f in found.items() if experts_format not in (None, f))
        if wrong:
            raise ValueError(
                f"experts_format is {experts_format!r} but the checkpoint stores layers "
                f"{format_layers(wrong)} as {found[wrong[0]]!r}"
            )
        return found
    if experts_format is None:
        return None
    return dict.fromkeys(layers, experts_format)
