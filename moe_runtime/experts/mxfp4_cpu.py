"""The fused MXFP4 decode + GEMM for packed experts on CPU (DESIGN §8), built on first use.

``csrc/mxfp4_cpu.cpp`` decodes the nibbles with a 16-entry lookup, applies the E8M0 scale per
block of 32 and accumulates in fp32 registers (OpenMP over output rows): no dense expert is ever
written to memory. It is built for AVX2 + FMA, and on CPUs with AVX-512 (F, BW, VL, DQ) with
those flags added, which selects its 16-lane variants (half the instructions per weight);
``MOE_RUNTIME_MXFP4_ISA=avx2`` keeps the AVX2 build there. It is plain C ABI, compiled by the
system C++ compiler into a per-user cache (keyed by the source, the flags and the compiler) and
loaded with ``ctypes`` (which releases the GIL during the call): ~2 s to build once, no torch
headers, no ninja. Its OpenMP calls resolve to the ``libgomp.so.1`` torch has already loaded,
so both share one thread pool.

The same library decodes MXFP4 rows to fp32 or bf16 (``decode_into``, exact: see the C++
header) for the batched experts path (``batched.py``), which multiplies decoded tiles with
torch's GEMM (oneDNN: AMX where the CPU has it).

The same library holds ``bf16_linear``: the dense parts (shared experts, latent down- and
up-projections) in bf16, fp32 in registers, a memory-bound GEMV. ``dense_linear`` picks it for
bf16 CPU GEMMs: at every T on a CPU without bf16 arithmetic (torch's bf16 GEMM reached ~5 GFLOP/s
at any T on the AVX2 machines measured), and on one with AMX or AVX512-BF16 up to the row count
from which torch's GEMM is measured faster (``dense_crossover``, once per shape): forcing the
kernel there made the T = 16-64 forwards compute-bound (issue 48).

When it cannot be used (not x86-64 with AVX2 + FMA, no compiler, a failed build, or
``MOE_RUNTIME_MXFP4_CPU=0``), ``unavailable_reason()`` says why; the ``torch`` experts backend
then decodes active experts in chunks as before and logs that reason once as a WARNING, and the
dense parts use torch's GEMM.

Legend: T tokens (rows of x), K reduction width (a multiple of 32), N output rows.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .. import mxfp4
from . import crossover

logger = logging.getLogger("moe_runtime")

SOURCE = Path(__file__).with_name("csrc") / "mxfp4_cpu.cpp"
ABI_VERSION = 4
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what the 16-lane build is compiled for
ISAS = {"avx2": FLAGS, "avx512": FLAGS + tuple(f"-m{f}" for f in AVX512)}
ENV_SWITCH = "MOE_RUNTIME_MXFP4_CPU"  # "0": never use the fused kernel (the decode fallback)
CACHE_ENV = "MOE_RUNTIME_CACHE"  # where built kernels live (default ~/.cache/moe_runtime)
KERNEL_NAME = "mxfp4_cpu"
ISA_ENV = "MOE_RUNTIME_MXFP4_ISA"  # "avx2" | "avx512" | unset: the widest this CPU runs
# "0": no torch GEMM where a kernel can serve: packed experts fused at every count, bf16 dense parts
# through bf16_linear at every T (the choices before issue 48; benchmarks time them side by side)
BATCHED_ENV = "MOE_RUNTIME_CPU_BATCHED"


def batched_enabled() -> bool:
    """False when ``BATCHED_ENV=0``: the measured crossovers to torch's GEMM are not used."""
    return os.environ.get(BATCHED_ENV, "1") != "0"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "moe_runtime")
    return Path(root) / "kernels"


def wanted_isa() -> str:
    """The build ``_load`` uses: ``ISA_ENV`` when set, else avx512 where the CPU has every flag it needs."""
    isa = os.environ.get(ISA_ENV) or ("avx512" if set(AVX512) <= crossover.cpu_flags() else "avx2")
    if isa not in ISAS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {sorted(ISAS)}")
    return isa


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)`` or ``(None, why not)`` for the build ``wanted_isa()`` names now."""
    return _build(wanted_isa())


@functools.cache
def _build(isa: str) -> tuple[ctypes.CDLL | None, str | None]:
    """The ``isa`` build, compiled at most once per process (and once per source/flags/compiler in
    the cache directory), or why it cannot run here."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"{ENV_SWITCH}=0 in the environment"
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the fused MXFP4 CPU kernel needs x86-64 (AVX2 + FMA); this is {platform.machine()}"
    missing = {"avx2", "fma"} - crossover.cpu_flags()
    if missing:
        return None, f"this CPU lacks {sorted(missing)}, which the fused MXFP4 CPU kernel needs"
    if isa == "avx512" and not set(AVX512) <= crossover.cpu_flags():
        return None, f"{ISA_ENV}=avx512 but this CPU lacks {sorted(set(AVX512) - crossover.cpu_flags())}"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX, or install g++) to build the fused MXFP4 CPU kernel"
    src = SOURCE.read_bytes()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"C++ compiler {cxx} does not run: {exc}"
    flags = ISAS[isa]
    key = hashlib.sha256(src + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    target = _cache_dir() / f"{KERNEL_NAME}-{isa}-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                run = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(built)],
                                     capture_output=True, text=True, timeout=300)
                if run.returncode != 0:
                    why = run.stderr.strip()[-500:]
                    return None, f"building the fused MXFP4 CPU kernel failed ({cxx}): {why}"
                os.replace(built, target)  # atomic: concurrent ranks each build, one file wins
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"building the fused MXFP4 CPU kernel failed: {type(exc).__name__}: {exc}"
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"loading the fused MXFP4 CPU kernel {target} failed: {exc}"
    if lib.mxfp4_abi_version() != ABI_VERSION:
        return None, f"{target} has ABI {lib.mxfp4_abi_version()}, expected {ABI_VERSION}"
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.mxfp4_linear.argtypes = [p, i64, i64, p, p, i64, p, i64, i32]
    lib.mxfp4_linear.restype = None
    lib.bf16_linear.argtypes = [p, i64, i64, p, i64, p, i64, i32]
    lib.bf16_linear.restype = None
    lib.mxfp4_decode.argtypes = [p, p, i64, i64, p, i32, i32]
    lib.mxfp4_decode.restype = None
    logger.info(f"fused MXFP4 CPU kernel ({isa}, {lib.mxfp4_lanes()} fp32 lanes): {target}")
    return lib, None


def isa() -> str | None:
    """The build the kernels run (``avx2`` or ``avx512``), None when unavailable."""
    lib = _load()[0]
    return None if lib is None else ("avx512" if lib.mxfp4_lanes() == 16 else "avx2")


def unavailable_reason() -> str | None:
    """None when the fused kernel runs here, else why not (the build is attempted once)."""
    return _load()[1]


def nibble_order(x_TK: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous fp32 with each block of 32 reordered even elements first, then odd ones
    (the order a block's 16 low nibbles, then its 16 high nibbles, decode to)."""
    T, K = x_TK.shape
    return x_TK.float().view(T, K // mxfp4.BLOCK, mxfp4.BLOCK // 2, 2).transpose(2, 3).contiguous().view(T, K)


def linear(x_TK: torch.Tensor, packed_NK2: torch.Tensor, scale_NKb: torch.Tensor) -> torch.Tensor:
    """``x @ decode(packed, scale).T`` as fp32 ``[T, N]``, accumulated in fp32, the weights decoded in
    registers. ``x`` is any float dtype (converted to fp32 exactly); K a multiple of 32."""
    lib, why = _load()
    if lib is None:
        raise RuntimeError(why)
    T, K = x_TK.shape
    N = packed_NK2.shape[0]
    if packed_NK2.shape != (N, K // 2) or scale_NKb.shape != (N, K // mxfp4.BLOCK) or K % mxfp4.BLOCK:
        raise ValueError(
            f"fused MXFP4 linear: x {tuple(x_TK.shape)} needs packed [N, {K} / 2] and scale "
            f"[N, {K} / {mxfp4.BLOCK}] with K a multiple of {mxfp4.BLOCK}; got packed "
            f"{tuple(packed_NK2.shape)}, scale {tuple(scale_NKb.shape)}"
        )
    if packed_NK2.device.type != "cpu" or packed_NK2.dtype != torch.uint8 or scale_NKb.dtype != torch.uint8:
        raise ValueError("fused MXFP4 linear runs on CPU uint8 packed weights and scales")
    x = nibble_order(x_TK)
    packed, scale = packed_NK2.contiguous(), scale_NKb.contiguous()
    out = torch.empty(T, N, dtype=torch.float32)
    if T and N:
        lib.mxfp4_linear(x.data_ptr(), T, K, packed.data_ptr(), scale.data_ptr(), N, out.data_ptr(), N,
                         torch.get_num_threads())
    return out


def decode_into(packed_NK2: torch.Tensor, scale_NKb: torch.Tensor, out_NK: torch.Tensor) -> torch.Tensor:
    """Decode MXFP4 rows into ``out`` (contiguous fp32 or bf16 ``[N, K]``), exactly as ``mxfp4.decode``
    (the values are exact in both dtypes); returns ``out``."""
    lib, why = _load()
    if lib is None:
        raise RuntimeError(why)
    N, K = out_NK.shape
    if packed_NK2.shape != (N, K // 2) or scale_NKb.shape != (N, K // mxfp4.BLOCK) or K % mxfp4.BLOCK:
        raise ValueError(f"MXFP4 decode into [{N}, {K}] (K a multiple of {mxfp4.BLOCK}) needs packed "
                         f"[{N}, {K} / 2] and scale [{N}, {K} / {mxfp4.BLOCK}]; got packed "
                         f"{tuple(packed_NK2.shape)}, scale {tuple(scale_NKb.shape)}")
    if out_NK.dtype not in (torch.float32, torch.bfloat16) or not out_NK.is_contiguous():
        raise ValueError(f"MXFP4 decode writes contiguous fp32 or bf16, got {out_NK.dtype}")
    packed, scale = packed_NK2.contiguous(), scale_NKb.contiguous()
    if N:
        lib.mxfp4_decode(packed.data_ptr(), scale.data_ptr(), N, K, out_NK.data_ptr(),
                         int(out_NK.dtype == torch.bfloat16), torch.get_num_threads())
    return out_NK


def bf16_linear(x_TK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for a bf16 CPU weight as fp32 ``[T, N]``: the weights widened to fp32 in registers
    (exact), products and sums in fp32: a memory-bound GEMV on CPUs without bf16 arithmetic, where
    torch's bf16 GEMM is compute-poor. K a multiple of 32."""
    lib, why = _load()
    if lib is None:
        raise RuntimeError(why)
    T, K = x_TK.shape
    N = w_NK.shape[0]
    if w_NK.shape != (N, K) or K % mxfp4.BLOCK or w_NK.dtype != torch.bfloat16 or w_NK.device.type != "cpu":
        raise ValueError(f"bf16 linear: x {tuple(x_TK.shape)} needs a CPU bf16 weight [N, {K}] with K a "
                         f"multiple of {mxfp4.BLOCK}; got {w_NK.dtype} {tuple(w_NK.shape)} on {w_NK.device}")
    x, w = x_TK.float().contiguous(), w_NK.contiguous()
    out = torch.empty(T, N, dtype=torch.float32)
    if T and N:
        lib.bf16_linear(x.data_ptr(), T, K, w.data_ptr(), N, out.data_ptr(), N, torch.get_num_threads())
    return out


DENSE_CROSSOVERS: dict[tuple[int, int, int], crossover.Crossover] = {}


def dense_crossover(w_NK: torch.Tensor) -> crossover.Crossover:
    """From how many rows torch's bf16 GEMM beats ``bf16_linear`` on ``w``'s shape, measured once
    per shape and thread count on a CPU with native bf16 (AMX or AVX512-BF16); never elsewhere,
    where torch widens bf16 in software."""
    key = (*w_NK.shape, torch.get_num_threads())
    if key not in DENSE_CROSSOVERS:
        if not crossover.native_bf16():
            DENSE_CROSSOVERS[key] = crossover.NEVER
        else:
            xs = torch.randn(crossover.COUNTS[-1], w_NK.shape[1]).bfloat16()
            DENSE_CROSSOVERS[key] = found = crossover.measure(
                lambda m: bf16_linear(xs[:m], w_NK).to(torch.bfloat16), lambda m: xs[:m] @ w_NK.t())
            crossover.log_engine()
            logger.info(f"bf16 GEMM {list(w_NK.shape)}: {found.describe('bf16 kernel', 'torch')}")
    return DENSE_CROSSOVERS[key]


def dense_linear(x_TK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in ``x``'s dtype: a bf16 CPU GEMM through ``bf16_linear`` (rounded to bf16 once, as
    torch's bf16 GEMM rounds its fp32 accumulator) when the kernel is built, up to the row count
    from which torch's GEMM is measured faster (``dense_crossover``); else torch."""
    if (x_TK.dtype == torch.bfloat16 and w_NK.dtype == torch.bfloat16 and w_NK.device.type == "cpu"
            and x_TK.dim() == 2 and w_NK.shape[1] % mxfp4.BLOCK == 0 and _load()[0] is not None
            and not (batched_enabled() and dense_crossover(w_NK).uses_second(x_TK.shape[0]))):
        return bf16_linear(x_TK, w_NK).to(torch.bfloat16)
    return x_TK @ w_NK.t()
