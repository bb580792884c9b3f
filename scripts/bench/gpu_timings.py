"""GPU timings for scripts/gpu_check.sh, one subcommand a stage (docs/benchmarks/gpu_check.md says what
each times): each point appended to ``--out`` (``bench.rows``) the moment it is measured, so that a
stage cut off by its time limit keeps its points. ``--smoke``: the same code on the CPU, tiny shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_runtime import mxfp4
from moe_runtime.activation import GatedActivation
from moe_runtime.config import LatentMoEConfig
from moe_runtime.experts import get_backend, unavailable_reason
from moe_runtime.experts.check import TOLERANCE
from moe_runtime.tp.collectives import Collectives, free_port, init_group
from moe_runtime.units import dtype_name
from moe_runtime.weights import ExpertWeights

from .harness import machine_record, rank_runner, rel_diff, synchronizer, time_calls
from .rows import RowWriter, read_rows

K3 = {"D": 3584, "E": 896, "K": 16, "I": 3072}
SMOKE = {"D": 64, "E": 8, "K": 2, "I": 64}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SMOKE_TOKENS = (1, 8, 64)
SITU = GatedActivation(4.0, 25.0)
# A bf16 TP layer vs the single-device one: a few bf16 ulps of max|out| (tests/test_tp_runner.py).
TAIL_TOLERANCE = 4 * 2**-8


def device_of(smoke: bool, rank: int = 0) -> torch.device:
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA/ROCm device visible to torch; use --smoke for the CPU dry run")
    return torch.device("cuda", rank)


def median_ms(fn, device: torch.device, reps: int, budget_s: float = float("inf")) -> dict:
    """Median / min of ``fn`` after a warm-up call: ``reps`` calls, fewer if they overrun ``budget_s``
    (never with collectives inside: every rank must make the same number of calls)."""
    ms = [1e3 * s for s in time_calls(fn, reps, budget_s=budget_s, sync=synchronizer(device))]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "reps": len(ms)}


def machine(device: torch.device) -> dict:
    info = machine_record(hip=torch.version.hip, cuda=torch.version.cuda, device=str(device))
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), gpus=torch.cuda.device_count())
    return info


def synthetic_experts(shape: dict, P: int, dtype: torch.dtype, packed: bool, device) -> ExpertWeights:
    """Random experts of one rank, generated on the device: dense ~ N(0, 1/D), or random FP4
    codes with E8M0 scales 2**-7 ... 2**-4 (magnitudes like a trained layer's)."""
    E, D, I = shape["E"], shape["D"], shape["I"] // P
    gen = torch.Generator(device=device).manual_seed(0)
    if not packed:
        w13 = torch.randn(E, 2 * I, D, generator=gen, device=device, dtype=dtype) * D**-0.5
        return ExpertWeights(w13, torch.randn(E, D, I, generator=gen, device=device, dtype=dtype) * I**-0.5,
                             dtype=dtype)

    def uint8(low: int, high: int, *size: int) -> torch.Tensor:
        return torch.randint(low, high, size, generator=gen, device=device, dtype=torch.uint8)

    B = mxfp4.BLOCK
    return ExpertWeights(uint8(0, 256, E, 2 * I, D // 2), uint8(0, 256, E, D, I // 2),
                         uint8(120, 124, E, 2 * I, D // B), uint8(120, 124, E, D, I // B), dtype=dtype)


def routing(T: int, E: int, K: int, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(T, E, generator=gen, device=device).topk(K, dim=1).indices
    weights = torch.rand(T, K, generator=gen, device=device)
    return ids, weights / weights.sum(1, keepdim=True)


def time_backend(be, h, ids, w, ex, act, device, args) -> tuple[dict, torch.Tensor | None]:
    """Median ms of one backend at one point and its output; a backend that raises is recorded."""
    call = partial(be, h, ids, w, ex, act)
    try:
        with torch.inference_mode():
            return median_ms(call, device, args.reps, args.point_budget_s), call()
    except Exception as exc:  # an optional backend that cannot run these experts says why
        return {"error": f"{type(exc).__name__}: {exc}"}, None


def experts_point(backends: dict, ex: ExpertWeights, fmt: str, T: int, shape: dict, floor_gbps: float,
                  device, args) -> dict:
    """Every backend at one point: its timing, its share of the HBM floor, its distance from torch."""
    h = torch.randn(T, shape["D"], device=device, dtype=torch.bfloat16)
    ids, w = routing(T, shape["E"], shape["K"], device, seed=T)
    active = int(torch.unique(ids).numel())
    tensors = [ex.w13, ex.w2] + ([ex.w13_scale, ex.w2_scale] if ex.packed else [])
    floor_ms = active * sum(t[0].numel() * t.element_size() for t in tensors) / 1e9 / floor_gbps * 1e3
    row = {"format": fmt, "T": T, "active_experts": active, "floor_ms": floor_ms}
    outs = {}
    for name, be in backends.items():
        row[name], outs[name] = time_backend(be, h, ids, w, ex, SITU, device, args)
    wants = dict.fromkeys(outs, outs["torch"])
    if "vllm" in backends and outs["vllm"] is None and T <= 64:  # its kernels on plain SiLU, against torch's
        silu = GatedActivation()
        row["vllm_silu"], outs["vllm_silu"] = time_backend(backends["vllm"], h, ids, w, ex, silu, device,
                                                           args)
        if outs["vllm_silu"] is not None:
            wants["vllm_silu"] = backends["torch"](h, ids, w, ex, silu)
    for name, out in outs.items():
        if out is not None:
            row[name]["hbm_fraction"] = floor_ms / row[name]["median_ms"]
            if name != "torch":
                row[f"{name}_vs_torch_rel_diff"] = rel_diff(out, wants[name])
    row["grouped_speedup"] = row["torch"]["median_ms"] / row["grouped"]["median_ms"]
    diffs = [v for k, v in row.items() if k.endswith("_rel_diff")]
    row["within_tolerance"] = all(d <= TOLERANCE[torch.bfloat16] for d in diffs)
    return row


def run_experts(args) -> None:
    device = device_of(args.smoke)
    shape, tokens = (SMOKE, SMOKE_TOKENS) if args.smoke else (K3, TOKENS)
    P = 1 if args.smoke else args.tp  # the tiny smoke experts hold one MXFP4 block per row at P = 1
    backends = {name: get_backend(name) for name in ("torch", "grouped")}
    skipped = {"vllm": unavailable_reason("vllm")}
    if skipped["vllm"] is None:
        backends["vllm"] = get_backend("vllm")
    x = torch.empty(2**30, dtype=torch.uint8, device=device)  # copy bandwidth: read + written bytes
    hbm = 2 * x.numel() / 1e9 / min(time_calls(x.clone, args.reps, sync=synchronizer(device)))
    del x
    out = RowWriter(args.out, what="experts", shape=dict(shape, P=P, I_local=shape["I"] // P),
                    dtype="bfloat16", machine=machine(device), copy_gbps=hbm,
                    skipped={k: v for k, v in skipped.items() if v})
    for fmt in ("dense", "mxfp4"):
        ex = synthetic_experts(shape, P, torch.bfloat16, fmt == "mxfp4", device)
        for T in tokens:
            row = experts_point(backends, ex, fmt, T, shape, hbm, device, args)
            print(f"experts {fmt} T={T}: " + ", ".join(
                f"{n} {v['median_ms']:.3f} ms ({v['hbm_fraction']:.0%} of the HBM floor)"
                for n, v in row.items() if isinstance(v, dict) and "hbm_fraction" in v), flush=True)
            out.row(row)
    out.close()


@contextlib.contextmanager
def rank_group(rank: int, world: int, port: int, smoke: bool, out: str, header: dict) -> Iterator[tuple]:
    """This rank's device, collectives over the local group (gloo in a smoke run, else nccl) and, on
    rank 0, the stage's row file (closed when the rank is done)."""
    device = device_of(smoke, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_group(rank, world, "127.0.0.1", port, "gloo" if smoke else "nccl", 120.0)
    writer = RowWriter(Path(out), **header, world=world, machine=machine(device)) if rank == 0 else None
    try:
        yield device, Collectives(rank, world, device), writer
        if writer:
            writer.close()
    finally:
        dist.destroy_process_group()


def _collectives_rank(rank: int, world: int, port: int, smoke: bool, reps: int, out: str) -> None:
    D = (SMOKE if smoke else K3)["D"]
    note = None if world > 1 else "one device: a world of one reduces nothing; launch overhead only"
    header = {"what": "collectives", "backend": "gloo" if smoke else "nccl", "note": note, "D": D}
    with rank_group(rank, world, port, smoke, out, header) as (device, comm, writer):
        for dtype in (torch.bfloat16, torch.float32):
            for T in SMOKE_TOKENS if smoke else TOKENS:
                # reduce-scatter needs rows divisible by the world
                x = torch.randn(-(-T // world) * world, D, device=device, dtype=dtype)
                ar = median_ms(partial(comm.all_reduce, x), device, reps)
                rs = median_ms(partial(comm.reduce_scatter, x), device, reps)
                nbytes = x.numel() * x.element_size()
                bus = 2 * (world - 1) / world * nbytes / ar["median_ms"] / 1e6  # ring: 2 (P-1)/P per rank
                if writer:
                    writer.row({"dtype": dtype_name(dtype), "T": T, "bytes": nbytes,
                                "all_reduce": ar, "reduce_scatter": rs, "all_reduce_bus_GBps": bus})


def _tail_rank(rank: int, world: int, port: int, smoke: bool, ckpt: str, reps: int, out: str) -> None:
    from moe_runtime.checkpoint import load_layer_weights
    from moe_runtime.layer import moe_forward
    from moe_runtime.tp.plan import legal_tails

    cfg = LatentMoEConfig.from_pretrained(ckpt)
    layer, dtype = cfg.moe_layers[0], torch.bfloat16
    with rank_group(rank, world, port, smoke, out, {"what": "tail", "checkpoint": cfg.to_dict()}) as (
            device, comm, writer):
        ref_w = load_layer_weights(ckpt, cfg, layer, dtype).to(device) if rank == 0 else None
        runner = rank_runner(comm, ckpt, layer, "replicated", dtype, device=device)  # tail= per call
        for tail in legal_tails(cfg, world):
            for T in SMOKE_TOKENS if smoke else (1, 64, 1024):
                gen = torch.Generator().manual_seed(T)
                x = torch.randn(T, cfg.hidden_size, generator=gen).to(dtype).to(device)
                with torch.inference_mode():
                    timing = median_ms(partial(runner.forward, x, tail=tail), device, reps)
                    got = runner.forward(x, tail=tail)
                    if writer:
                        rel = rel_diff(got.float(), moe_forward(x, ref_w, cfg).float())
                        writer.row({"tail": tail, "T": T, "layer": timing, "rel_diff_vs_single_gpu": rel,
                                    "within_tolerance": rel <= TAIL_TOLERANCE})


def spawn(fn, world: int, *args) -> None:
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("experts", "collectives", "tail"))
    ap.add_argument("--out", type=Path, required=True, help="JSON-lines file to write (one record per point)")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run with tiny shapes")
    ap.add_argument("--tp", type=int, default=8, choices=[p for p in range(1, 65) if K3["I"] % p == 0],
                    metavar="P", help="TP size whose per-rank expert shapes are timed (a divisor of K3's I)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--point-budget-s", type=float, default=3.0, help="stop repeating a point after this")
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.what == "experts":
        run_experts(args)
    elif args.what == "collectives":
        world = 2 if args.smoke else max(1, torch.cuda.device_count())
        spawn(_collectives_rank, world, args.smoke, args.reps, str(args.out))
    elif (gpus := 2 if args.smoke else torch.cuda.device_count()) < 2:
        RowWriter(args.out, what="tail", skipped=f"{gpus} GPU(s): the TP-2 tail needs two").close()
        print(f"tail: skipped, {gpus} GPU(s)")
    else:
        from moe_runtime.synthetic import preset_config, write_checkpoint

        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            raw = preset_config("tiny" if args.smoke else "small")
            ckpt = write_checkpoint(Path(tmp) / "ckpt", raw, seed=0)
            spawn(_tail_rank, 2, args.smoke, str(ckpt), args.reps, str(args.out))
    print(f"{args.what}: wrote {args.out} in {time.perf_counter() - start:.1f} s")
    _, rows, _ = read_rows(args.out)
    bad = [r for r in rows if not r.get("within_tolerance", True)]
    for r in bad:
        print(f"OUT OF TOLERANCE: {r}")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
