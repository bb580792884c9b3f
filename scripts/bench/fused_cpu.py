"""Packed MXFP4 experts on CPU, one projection pair at a time (real-size Kimi-K3 experts as random
packed codes, ``--experts`` of them walked per call so the weights come from memory): the AVX2 build,
the fused build this CPU gets and the batched path, against memcpy and torch's dense bf16 GEMM, per T
and thread count. The page says more.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

from moe_runtime import mxfp4
from moe_runtime.experts import batched, crossover, mxfp4_cpu

from . import harness
from .docs import Target, is_contended, section_start, table, table_row, target, target_lines, verdict

D, I = 3584, 3072
SHAPES = {"w13": (2 * I, D), "w2": (D, I)}
PATHS = ("avx2", "fused", "batched")
SECTION = "# Packed MXFP4 experts on CPU: fused AVX2 / AVX-512 and batched (`scripts/bench/fused_cpu.py`)"


def walk_ms(packed: dict, dense: dict, xs: dict, walked: int, buffer, reps: int) -> dict[str, float]:
    """Each packed path's median ms per expert over ``walked`` experts, in turns, and torch's dense bf16
    GEMM of one expert's shapes."""
    def walk(linear, isa=None):
        def call():
            os.environ[mxfp4_cpu.ISA_ENV] = isa or mxfp4_cpu.wanted_isa()
            for e in range(walked):
                for k, (p, s) in packed.items():
                    linear(xs[k], p[e], s[e])
            os.environ.pop(mxfp4_cpu.ISA_ENV)
        return call

    paths = {"avx2": walk(mxfp4_cpu.linear, "avx2"), "fused": walk(mxfp4_cpu.linear),
             "batched": walk(lambda x, p, s: batched.linear(x, p, s, buffer))}
    ms = {k: statistics.median(t) * 1e3 / walked for k, t in harness.time_interleaved(paths, reps).items()}
    torch_bf16 = harness.time_interleaved({"torch": lambda: [xs[k] @ w.t() for k, w in dense.items()]}, reps)
    return {**ms, "torch_bf16": statistics.median(torch_bf16["torch"]) * 1e3}


def run(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    n = args.experts
    packed = {k: (torch.randint(0, 256, (n, rows, cols // 2), dtype=torch.uint8, generator=gen),
                  torch.randint(118, 128, (n, rows, cols // 32), dtype=torch.uint8, generator=gen))
              for k, (rows, cols) in SHAPES.items()}
    dense = {k: mxfp4.decode(p[0], s[0], torch.bfloat16) for k, (p, s) in packed.items()}
    packed_bytes = sum(p[0].numel() + s[0].numel() for p, s in packed.values())
    flops_per_token = 2 * sum(rows * cols for rows, cols in SHAPES.values())
    buffer = batched.tile_buffer(torch.bfloat16, batched.TILE_BYTES)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        memcpy = harness.memcpy_gbps(args.reps)
        for T in args.tokens:
            load0 = harness.loadavg()
            xs = {"w13": torch.randn(T, D).bfloat16(), "w2": torch.randn(T, I).bfloat16()}
            ms = walk_ms(packed, dense, xs, n if T <= 64 else 2, buffer, args.reps)
            gflops = {k: flops_per_token * T / v / 1e6 for k, v in ms.items()}
            row = {"threads": threads, "T": T, "memcpy_GBs": memcpy, "loadavg_start": load0,
                   "torch_bf16_GFLOPs": gflops["torch_bf16"],
                   **{p: {"ms": ms[p], "GBs": packed_bytes / ms[p] / 1e6,
                          "vs_memcpy": packed_bytes / ms[p] / 1e6 / memcpy, "GFLOPs": gflops[p],
                          "vs_torch_bf16": ms["torch_bf16"] / ms[p]} for p in PATHS}}
            row["best"] = min(("fused", "batched"), key=lambda k: row[k]["ms"])
            row["loadavg_end"] = harness.loadavg()
            row["loaded"] = is_contended(max(load0[0], row["loadavg_end"][0]), harness.cpu_count())
            rows.append(row)
            print(table_row(row_cells(row)), flush=True)
    return {"rows": rows, "packed_bytes_per_expert": packed_bytes, "experts": n,
            "isa": mxfp4_cpu.wanted_isa(), "gemm_engine": crossover.gemm_engine()}


def index_rows(results: dict) -> list[Target]:
    rows = results["rows"]
    low = [r[r["best"]]["vs_memcpy"] for r in rows if r["T"] == 1]
    high = [r[r["best"]]["vs_torch_bf16"] for r in rows if r["T"] >= 64]
    return [target("best packed path's packed GB/s / memcpy, T = 1, best thread count",
                   verdict(max(low, default=None), ">=", 0.9)),
            target("best packed path's GFLOP/s / torch's dense bf16 GEMM's, worst row at T >= 64",
                   verdict(min(high, default=None), ">=", 0.5))]


def row_cells(r: dict) -> list:
    return [r["threads"], r["T"], f"{r['memcpy_GBs']:.2f}",
            *(c for p in PATHS for c in (f"{r[p]['ms']:.2f}", f"{100 * r[p]['vs_memcpy']:.0f}%")),
            *(f"{r[p]['GFLOPs']:.1f}" for p in PATHS), f"{r['torch_bf16_GFLOPs']:.1f}",
            f"{r[r['best']]['vs_torch_bf16']:.2f} ({r['best']})",
            f"{r['loadavg_start'][0]:.1f}-{r['loadavg_end'][0]:.1f}{' *' if r['loaded'] else ''}"]


def markdown(results: dict, json_rel: str, png_rel: str) -> str:
    per_expert, n = results["packed_bytes_per_expert"], results["experts"]
    what = f"fused kernel build {results['isa']}; torch's bf16 GEMM on {results['gemm_engine']}"
    return "\n".join([
        section_start(SECTION, "fused_cpu", results["argv"], results["machine"], what, json_rel, png_rel), "",
        f"{per_expert / 1e6:.1f} MB packed per expert; every timed call at T <= 64 walks {n} of them "
        f"({n * per_expert / 1e9:.2f} GB; 2 above T = 64). Rows marked * ran contended.", "",
        *table("threads | T | memcpy GB/s | avx2 ms | avx2 % memcpy | fused ms | fused % memcpy | batched ms "
               "| batched % memcpy | avx2 GFLOP/s | fused GFLOP/s | batched GFLOP/s | torch bf16 GFLOP/s "
               "| best / torch bf16 | load avg", map(row_cells, results["rows"])), "",
        *target_lines(index_rows(results))])


def plot(results: dict, path: Path) -> None:
    fig, ax = harness.pyplot().subplots(figsize=(7, 4))
    for threads in sorted({r["threads"] for r in results["rows"]}):
        rows = [r for r in results["rows"] if r["threads"] == threads]
        ts = [r["T"] for r in rows]
        for p, style in zip(PATHS, ("s:", "o-", "d-"), strict=True):
            ax.plot(ts, [r[p]["GFLOPs"] for r in rows], style, label=f"{p}, {threads} thr")
        ax.plot(ts, [r["torch_bf16_GFLOPs"] for r in rows], "x--", label=f"torch bf16 GEMM, {threads} thr")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tokens T", ylabel="GFLOP/s", title="real-size K3 experts on CPU, weights from memory")
    ax.legend(fontsize=7)
    harness.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "fused_cpu")
    ap.add_argument("--tokens", type=harness.int_list, default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--threads", type=harness.int_list, default=[2])
    ap.add_argument("--experts", type=int, default=24, help="distinct experts each timed call walks")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if (reason := mxfp4_cpu.unavailable_reason()) is not None:
        print(f"the fused kernel is unavailable here: {reason}")
        return 1
    machine = harness.machine_record()
    return harness.report(args, run(args), machine, markdown, index_rows, plot)


if __name__ == "__main__":
    raise SystemExit(main())
