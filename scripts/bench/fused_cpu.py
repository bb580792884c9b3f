"""Fused MXFP4 decode + GEMM on CPU vs memcpy and dense GEMMs of the same shapes.

One real-size Kimi-K3 expert (gate|up [2I, D] = [6144, 3584], down [D, I] = [3584, 3072]), random
packed codes built in memory (no checkpoint). Per token count T and thread count, in the same run:

- memcpy GB/s of a 256 MiB buffer (bytes copied / time), measured before each thread setting;
- ``fused``: the expert through ``mxfp4_cpu.linear`` (both matrices): packed GB/s, % of memcpy,
  GFLOP/s (2 T x 3 D I x 2 per expert... i.e. 2 x T x weights);
- ``decode``: the fallback path (``mxfp4.decode`` to bf16, then torch's bf16 GEMM), T <= 16;
- ``torch bf16`` and ``bf16 kernel``: the same shapes as dense bf16 weights through torch's GEMM and
  through ``mxfp4_cpu.bf16_linear`` (the shared experts' and projections' path).

Each row records ``os.getloadavg()`` at its start and end: rows measured on a loaded machine are
marked in the table. Timings are the minimum over repeats (the least disturbed run).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_runtime import mxfp4
from moe_runtime.experts import mxfp4_cpu

from . import harness
from .docs import Target, is_contended, section_start, target, verdict, write_results

D, I = 3584, 3072
SHAPES = {"w13": (2 * I, D), "w2": (D, I)}
SECTION = "# Fused MXFP4 CPU kernel: one real-size expert (`scripts/bench/fused_cpu.py`)"


def best(fn, reps: int) -> float:
    return min(harness.time_calls(fn, reps).seconds)


def run(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    packed = {k: (torch.randint(0, 256, (n, k_ // 2), dtype=torch.uint8, generator=gen),
                  torch.randint(118, 128, (n, k_ // 32), dtype=torch.uint8, generator=gen))
              for k, (n, k_) in SHAPES.items()}
    dense = {k: mxfp4.decode(p, s, torch.bfloat16) for k, (p, s) in packed.items()}
    packed_bytes = sum(p.numel() + s.numel() for p, s in packed.values())
    dense_bytes = sum(w.numel() * 2 for w in dense.values())
    weights = sum(w.numel() for w in dense.values())
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        memcpy = harness.memcpy_gbps(args.reps)
        for T in args.tokens:
            load0 = harness.loadavg()
            xs = {"w13": torch.randn(T, D).bfloat16(), "w2": torch.randn(T, I).bfloat16()}

            def fused(xs=xs):
                for k, (p, s) in packed.items():
                    mxfp4_cpu.linear(xs[k], p, s)

            def torch_dense(xs=xs):
                for k, w in dense.items():
                    xs[k] @ w.t()

            def kernel_dense(xs=xs):
                for k, w in dense.items():
                    mxfp4_cpu.bf16_linear(xs[k], w)

            def decode(xs=xs):
                for k, (p, s) in packed.items():
                    xs[k] @ mxfp4.decode(p, s, torch.bfloat16, check_scales=False).t()

            t_fused, t_torch, t_kernel = (best(f, args.reps) for f in (fused, torch_dense, kernel_dense))
            t_decode = best(decode, 1) if T <= 16 else None
            flops = 2 * T * weights
            row = {
                "threads": threads, "T": T, "memcpy_GBs": memcpy,
                "fused_ms": t_fused * 1e3, "fused_GBs": packed_bytes / t_fused / 1e9,
                "fused_vs_memcpy": packed_bytes / t_fused / 1e9 / memcpy,
                "fused_GFLOPs": flops / t_fused / 1e9,
                "decode_ms": None if t_decode is None else t_decode * 1e3,
                "torch_bf16_ms": t_torch * 1e3, "torch_bf16_GFLOPs": flops / t_torch / 1e9,
                "torch_bf16_GBs": dense_bytes / t_torch / 1e9,
                "kernel_bf16_ms": t_kernel * 1e3, "kernel_bf16_GFLOPs": flops / t_kernel / 1e9,
                "kernel_bf16_GBs": dense_bytes / t_kernel / 1e9,
                "fused_vs_torch_bf16_GFLOPs": t_torch / t_fused,
                "loadavg_start": load0, "loadavg_end": harness.loadavg(),
            }
            peak = max(row["loadavg_start"][0], row["loadavg_end"][0])
            row["loaded"] = is_contended(peak, harness.cpu_count())
            rows.append(row)
            print(describe(row), flush=True)
    return {"rows": rows, "packed_bytes_per_expert": packed_bytes, "dense_bytes_per_expert": dense_bytes,
            "kernel": mxfp4_cpu.unavailable_reason() or "built"}


def describe(r: dict) -> str:
    dec = "" if r["decode_ms"] is None else f", decode path {r['decode_ms']:.1f} ms"
    return (f"threads {r['threads']} T {r['T']:>3}: fused {r['fused_ms']:.2f} ms = {r['fused_GBs']:.2f} GB/s "
            f"({100 * r['fused_vs_memcpy']:.0f}% of memcpy {r['memcpy_GBs']:.2f}), "
            f"{r['fused_GFLOPs']:.1f} GFLOP/s"
            f" vs torch bf16 {r['torch_bf16_GFLOPs']:.1f}, bf16 kernel {r['kernel_bf16_GFLOPs']:.1f}{dec}; "
            f"load {r['loadavg_start'][0]:.1f}->{r['loadavg_end'][0]:.1f}")


def index_rows(results: dict) -> list[Target]:
    big = [r["fused_vs_torch_bf16_GFLOPs"] for r in results["rows"] if r["T"] >= 16]
    return [target("fused GFLOP/s / torch's dense bf16 GEMM's, worst row at T >= 16",
                   verdict(min(big, default=None), ">=", 0.5), ".1f")]


def markdown(results: dict, json_rel: str, png_rel: str) -> str:
    rows = results["rows"]
    lines = [
        section_start(
            SECTION, "fused_cpu", results["argv"], results["machine"],
            f"fused kernel {results['kernel']}", json_rel, png_rel),
        "",
        f"One Kimi-K3 expert, gate|up [6144, 3584] + down [3584, 3072]: "
        f"{results['packed_bytes_per_expert'] / 1e6:.1f} MB packed, "
        f"{results['dense_bytes_per_expert'] / 1e6:.1f} MB as bf16. memcpy measured in the same run (bytes "
        f"copied / s). GFLOP/s = 2 T x weights / time. `decode` = the fallback (decode to bf16, torch GEMM). "
        f"Minimum over repeats. Rows marked * were measured while the machine was loaded (other work "
        f"held at least half the CPUs): their absolute numbers are low and noisy.",
        "",
        "| threads | T | memcpy GB/s | fused ms | fused GB/s | % memcpy | fused GFLOP/s | torch bf16 GFLOP/s "
        "| bf16 kernel GFLOP/s | fused / torch bf16 | decode ms | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dec = "-" if r["decode_ms"] is None else f"{r['decode_ms']:.1f}"
        lines.append(
            f"| {r['threads']} | {r['T']} | {r['memcpy_GBs']:.2f} | {r['fused_ms']:.2f} "
            f"| {r['fused_GBs']:.2f} "
            f"| {100 * r['fused_vs_memcpy']:.0f}% | {r['fused_GFLOPs']:.1f} | {r['torch_bf16_GFLOPs']:.1f} "
            f"| {r['kernel_bf16_GFLOPs']:.1f} | {r['fused_vs_torch_bf16_GFLOPs']:.1f}x | {dec} "
            f"| {r['loadavg_start'][0]:.1f}-{r['loadavg_end'][0]:.1f}{' *' if r['loaded'] else ''} |")
    one = [r for r in rows if r["T"] == 1]
    big = [r for r in rows if r["T"] >= 16]
    lines.append("")
    if one:
        b = max(one, key=lambda r: r["fused_vs_memcpy"])
        speed = f"{b['decode_ms'] / b['fused_ms']:.0f}x faster than the decode path" if b["decode_ms"] else ""
        lines.append(f"- T = 1: best fused row reads the packed expert at {b['fused_GBs']:.2f} GB/s = "
                     f"{100 * b['fused_vs_memcpy']:.0f}% of memcpy ({b['threads']} threads), {speed}.")
    if big:
        worst = min(big, key=lambda r: r["fused_vs_torch_bf16_GFLOPs"])
        ratio = worst["fused_vs_torch_bf16_GFLOPs"]
        lines.append(f"- T >= 16: fused GFLOP/s is at least {ratio:.1f}x torch's "
                     f"dense bf16 GEMM of the same shapes (target >= 0.5x): "
                     f"{'MET' if worst['fused_vs_torch_bf16_GFLOPs'] >= 0.5 else 'MISSED'}.")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    fig, ax = harness.pyplot().subplots(figsize=(7, 4))
    for threads in sorted({r["threads"] for r in results["rows"]}):
        rows = [r for r in results["rows"] if r["threads"] == threads]
        ts = [r["T"] for r in rows]
        ax.plot(ts, [r["fused_GFLOPs"] for r in rows], "o-", label=f"fused MXFP4, {threads} thr")
        ax.plot(ts, [r["torch_bf16_GFLOPs"] for r in rows], "x--", label=f"torch bf16 GEMM, {threads} thr")
        ax.plot(ts, [r["kernel_bf16_GFLOPs"] for r in rows], "s:", label=f"bf16 kernel, {threads} thr")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("GFLOP/s")
    ax.set_title("one real-size K3 expert on CPU")
    ax.legend(fontsize=7)
    harness.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "fused_cpu")
    ap.add_argument("--tokens", default="1,2,4,8,16,64")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.threads = [int(t) for t in args.threads.split(",")]
    reason = mxfp4_cpu.unavailable_reason()
    if reason is not None:
        print(f"the fused kernel is unavailable here: {reason}")
        return 1
    machine = harness.machine_record()
    results = run(args)
    results.update(argv=args.argv, machine=dict(machine, loadavg_after=harness.loadavg()))
    write_results(results, args.out, "fused_cpu", plot, markdown, index_rows, args.docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
