"""The routed-experts stage: the ``torch`` and ``grouped`` backends against a dense GEMM of the same
FLOPs (6·T·K·D·I) and a naive per-token loop, per token count T, dtype and experts format (dense, or
MXFP4 decoded per batch); the page says more. Packed CPU experts at real size: ``real``.
Target: ``torch`` >= 40 % of dense at T = 4096.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import statistics
from pathlib import Path

import torch

from moe_runtime import mxfp4
from moe_runtime.activation import GatedActivation
from moe_runtime.checkpoint import load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.experts import get_backend
from moe_runtime.layer import down_project
from moe_runtime.router import route
from moe_runtime.units import dtype_name
from moe_runtime.weights import ExpertWeights

from . import harness
from .docs import Target, section_start, table, table_row, target, target_lines, verdict
from .rss import Cores

SECTION = "# Experts backends: `torch` and `grouped` against a dense GEMM (scripts/bench/experts.py)"
TARGET_FRACTION = 0.40  # issue target: at T = 4096 the backend reaches >= 40% of dense GFLOP/s
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FORMATS = ("dense", "mxfp4")
PATHS = ("torch", "grouped", "dense", "naive")


def in_format(ex: ExpertWeights, fmt: str) -> ExpertWeights:
    """The layer's experts dense, or MXFP4-packed (encoded here, in memory)."""
    if fmt == "dense":
        return ex
    (p13, s13), (p2, s2) = mxfp4.encode(ex.w13), mxfp4.encode(ex.w2)
    return ExpertWeights(p13, p2, s13, s2, dtype=ex.dtype)


def naive_experts(h_TD, ids_TK, weights_TK, w13_EFD, w2_EDI, act: GatedActivation) -> torch.Tensor:
    """One token, one slot at a time: the textbook loop, same math and dtypes as the backend."""
    T, K = ids_TK.shape
    I = w2_EDI.shape[2]
    out = torch.zeros(T, w2_EDI.shape[1], dtype=torch.float32, device=h_TD.device)
    ids, weights = ids_TK.tolist(), weights_TK.tolist()
    for t in range(T):
        for k in range(K):
            e = ids[t][k]
            gate_up = w13_EFD[e] @ h_TD[t]
            a = act(gate_up[:I], gate_up[I:]).to(h_TD.dtype)
            out[t] += weights[t][k] * (w2_EDI[e] @ a).float()
    return out


def bench_one(cfg: LatentMoEConfig, w, ex: ExpertWeights, fmt: str, T: int, dtype: torch.dtype,
              device: torch.device, args) -> dict:
    D, E, K, I = (cfg.routed_expert_hidden_size, cfg.num_experts, cfg.num_experts_per_token,
                  cfg.moe_intermediate_size)
    gen = torch.Generator().manual_seed(T)
    x_TH = torch.randn(T, cfg.hidden_size, generator=gen).to(dtype).to(device)
    h_TD = down_project(x_TH, w)
    ids_TK, weights_TK = route(x_TH, w.gate_EH, w.bias_E, cfg)
    act = GatedActivation.from_config(cfg)
    # dense GEMMs of the same shape-product: M = T*K rows through one [2I, D] and one [D, I]
    hr_MD = torch.randn(T * K, D, generator=gen).to(dtype).to(device)
    a_MI = torch.randn(T * K, I, generator=gen).to(dtype).to(device)
    w13_EFD, w2_EDI = ex.decode(torch.arange(E, device=device))  # dense copies for the baselines
    w13_FD, w2_DI = w13_EFD[0].contiguous(), w2_EDI[0].contiguous()
    n = min(T, args.naive_max_tokens)
    backend, grouped = get_backend("torch"), get_backend("grouped")
    calls = {"torch": lambda: backend(h_TD, ids_TK, weights_TK, ex, act),
             "grouped": lambda: grouped(h_TD, ids_TK, weights_TK, ex, act),
             "dense": lambda: (hr_MD @ w13_FD.t(), a_MI @ w2_DI.t())}

    def naive() -> torch.Tensor:
        return naive_experts(h_TD[:n], ids_TK[:n], weights_TK[:n], w13_EFD, w2_EDI, act)

    sync = harness.synchronizer(device)
    times = harness.time_interleaved(calls, args.min_reps, min_time_s=args.min_time, sync=sync)
    times["naive"] = harness.time_calls(naive, 1, min_time_s=args.min_time, sync=sync)

    out_t = calls["torch"]()  # the backend against the naive loop on its tokens, grouped against the backend
    diffs = {"backend_vs_naive_max_rel_diff": harness.rel_diff(out_t[:n], naive()),
             "grouped_vs_torch_max_rel_diff": harness.rel_diff(calls["grouped"](), out_t)}
    active = int(torch.bincount(ids_TK.reshape(-1), minlength=E).gt(0).sum())
    return timing_row(T, dtype, fmt, K, active, 6 * T * K * D * I, n, times, diffs)


def timing_row(T: int, dtype: torch.dtype, fmt: str, K: int, active: int, flops: float, n_naive: int,
               times: dict[str, list[float]], diffs: dict[str, float]) -> dict:
    med = {k: statistics.median(t) for k, t in times.items()}
    best = {k: min(t) for k, t in times.items()}
    med["naive"] *= T / n_naive
    return {
        "T": T, "dtype": dtype_name(dtype), "format": fmt, "slots": T * K, "active_experts": active,
        "flops": flops, **{f"{k}_ms": 1e3 * med[k] for k in PATHS}, "naive_tokens_timed": n_naive,
        "naive_scaled": n_naive < T, **{f"{k}_gflops": flops / med[k] / 1e9 for k in PATHS},
        "torch_vs_dense": med["dense"] / med["torch"], "torch_vs_dense_best": best["dense"] / best["torch"],
        "torch_vs_naive": med["naive"] / med["torch"], "grouped_speedup": med["torch"] / med["grouped"],
        "grouped_speedup_best": best["torch"] / best["grouped"], "reps": {k: len(times[k]) for k in PATHS},
        "min_ms": {k: 1e3 * best[k] for k in PATHS[:3]}, **diffs}


def machine_info(device: torch.device) -> dict:
    info = harness.machine_record(processor=platform.processor() or platform.machine(),
                                  torch_threads=torch.get_num_threads(), device=str(device))
    with contextlib.suppress(OSError, IndexError):
        info["cpu_model"] = re.findall(r"^model name\s*: (.*)$", Path("/proc/cpuinfo").read_text(), re.M)[0]
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def row_cells(r: dict) -> list:
    return [r["dtype"], r["format"], r["T"], r["slots"], r["active_experts"], f"{r['torch_ms']:.2f}",
            f"{r['grouped_ms']:.2f}", f"{r['grouped_speedup']:.2f}x; {r['grouped_speedup_best']:.2f}x",
            f"{r['dense_ms']:.2f}", f"{r['naive_ms']:.1f}" + ("*" if r["naive_scaled"] else ""),
            f"{r['torch_gflops']:.1f}", f"{r['grouped_gflops']:.1f}", f"{r['dense_gflops']:.1f}",
            f"{100 * r['torch_vs_dense']:.0f}%; {100 * r['torch_vs_dense_best']:.0f}%",
            f"{r['torch_vs_naive']:.1f}x"]


def shape_text(results: dict) -> str:
    cfg = results["config"]
    return (f"preset {results['preset']} (D={cfg['routed_expert_hidden_size']}, E={cfg['num_experts']}, "
            f"K={cfg['num_experts_per_token']}, I={cfg['moe_intermediate_size']})")


def index_rows(results: dict) -> list[Target]:
    """Each dtype and format at T = 4096: the torch backend's share of the dense GEMM's GFLOP/s."""
    return [target(f"torch backend / dense GEMM GFLOP/s, {r['dtype']} {r['format']}, T = 4096",
                   verdict(r["torch_vs_dense"], ">=", TARGET_FRACTION))
            for r in results["rows"] if r["T"] == 4096]


def markdown(results: dict, json_path: str, png_path: str) -> str:
    m, rows = results["machine"], results["rows"]
    busy = m.get("other_processes_cpu_fraction")
    details = (f"{m.get('cpu_model', m['processor'])}, torch with {m['torch_threads']} threads on "
               f"{m['device']}; {shape_text(results)}, layer {results['layer']}; FLOPs = 6·T·K·D·I"
               + ("" if busy is None else f"; other processes used {100 * busy:.0f} % of the CPU time"))
    lines = [section_start(SECTION, "experts", results["argv"], m, details, json_path, png_path), "",
             *table("dtype | experts | T | slots T·K | active experts | torch ms | grouped ms "
                    "| grouped speedup (median; best) | dense ms | naive ms | torch GFLOP/s "
                    "| grouped GFLOP/s | dense GFLOP/s | torch / dense (median; best) | torch vs naive",
                    map(row_cells, rows))]
    if any(r["naive_scaled"] for r in rows):
        lines += ["", "\\* naive loop timed on the first `naive_tokens_timed` tokens, scaled by T / n."]
    return "\n".join([*lines, "", *target_lines(index_rows(results))])


def plot(results: dict, path: Path) -> None:
    rows = results["rows"]
    panels = sorted({(r["dtype"], r["format"]) for r in rows},
                    key=lambda p: (list(DTYPES).index(p[0]), FORMATS.index(p[1])))
    fig, axes = harness.pyplot().subplots(1, len(panels), figsize=(6.8 * len(panels), 4.2), squeeze=False)
    labels = {"dense": "dense GEMM (same FLOPs)", "torch": "torch backend", "grouped": "grouped backend",
              "naive": "naive per-token loop"}
    for ax, (dt, fmt) in zip(axes[0], panels, strict=True):
        sub = [r for r in rows if (r["dtype"], r["format"]) == (dt, fmt)]
        for i, (key, label) in enumerate(labels.items()):
            vals = [r[f"{key}_gflops"] for r in sub]
            bars = ax.bar([x + (i - 1.5) * 0.21 for x in range(len(sub))], vals, 0.21, label=label)
            ax.bar_label(bars, labels=[f"{v:.1f}" for v in vals], fontsize=7)
        ax.set_xticks(range(len(sub)), [f"T={r['T']}" for r in sub])
        ax.set(yscale="log", ylabel="GFLOP/s", title=f"{dt}, {fmt} experts")
        ax.set_ylim(ax.get_ylim()[0], ax.get_ylim()[1] * 30)  # headroom for the legend above the bars
        ax.legend(fontsize=7, loc="upper left", ncols=2)
    fig.suptitle(f"routed experts, {shape_text(results)}, {results['machine']['torch_threads']} threads",
                 fontsize=10)
    harness.save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "experts")
    ap.add_argument("--checkpoint", type=Path, help="default: checkpoints/PRESET; written where missing")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layer", type=int, help="MoE layer to load (default: the first)")
    ap.add_argument("--tokens", default="16,512,4096", help="comma-separated token counts")
    ap.add_argument("--dtypes", default="float32", help=f"comma-separated, from {list(DTYPES)}")
    ap.add_argument("--formats", default="dense", help=f"experts formats, comma-separated, from {FORMATS}")
    ap.add_argument("--naive-max-tokens", type=int, default=256, help="tokens the naive loop times (x T / n)")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per measurement")
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    dtypes, formats = args.dtypes.split(","), args.formats.split(",")
    if not set(dtypes) <= set(DTYPES) or not set(formats) <= set(FORMATS):
        ap.error(f"choose dtypes from {list(DTYPES)} and experts formats from {FORMATS}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ckpt = harness.ensure_checkpoint(args.checkpoint or harness.CHECKPOINTS / args.preset, args.preset)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    layer = args.layer if args.layer is not None else cfg.moe_layers[0]
    info, rows, cores = machine_info(device), [], Cores({"this process": [os.getpid()]})
    for dtype in dtypes:
        w = load_layer_weights(ckpt, cfg, layer, dtype=DTYPES[dtype]).to(device)
        for fmt in formats:
            for T in harness.int_list(args.tokens):
                rows.append(bench_one(cfg, w, in_format(w.experts, fmt), fmt, T, DTYPES[dtype], device, args))
                print(table_row(row_cells(rows[-1])), flush=True)
    busy = cores.read()  # the share of the machine's CPU time (all its CPUs) other processes used
    info["other_processes_cpu_fraction"] = max(0.0, busy["cores_busy"] - busy["cores_used"]) / os.cpu_count()
    results = {"preset": args.preset, "layer": layer, "config": cfg.to_dict(), "rows": rows}
    return harness.report(args, results, info, markdown, index_rows, plot)


if __name__ == "__main__":
    raise SystemExit(main())
