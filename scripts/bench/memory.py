"""The memory planner (``moe_runtime.memory``) against measured memory: per dtype, experts format and T,
a fresh process loads one MoE layer (TP 1) and runs one forward: resident bytes by part against the
plan, and the forward's peak RSS growth (``VmHWM`` after a reset, minus ``VmRSS``) against its workspace.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from . import ROOT, harness
from .docs import Target, section_start, table, target
from .rss import proc_bytes

SECTION = "# Memory planner vs measured memory (scripts/bench/memory.py)"


def measure_one(ckpt: str, dtype: str, tokens: int) -> dict:
    """In a child process: load layer 1, one warm-up and one measured forward of ``tokens``."""
    import torch

    from moe_runtime.checkpoint import checkpoint_expert_formats, load_layer_weights
    from moe_runtime.config import LatentMoEConfig
    from moe_runtime.layer import moe_forward
    from moe_runtime.planning import memory
    from moe_runtime.units import torch_dtype

    torch.set_num_threads(1)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    w = load_layer_weights(ckpt, cfg, 1, torch_dtype(dtype))
    held = "mxfp4" if w.experts.packed else "dense"
    plan = memory.plan_memory(cfg, {1: held}, dtype, 1, max_tokens=tokens)
    x = harness.seeded_randn(tokens, cfg.hidden_size, seed=0, dtype=torch_dtype(dtype))
    with torch.inference_mode():
        moe_forward(x[:8], w, cfg)  # allocator and thread pools warm
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to now
        before = proc_bytes("/proc/self/status", "VmRSS")
        moe_forward(x, w, cfg)
        growth = proc_bytes("/proc/self/status", "VmHWM") - before
    return {"dtype": dtype, "tokens": tokens, "experts_held": held,
            "checkpoint_format": checkpoint_expert_formats(ckpt, cfg, [1])[1],
            "resident_by_part": w.nbytes_by_part(), "planned_by_part": plan.by_part,
            "weights_exact": w.nbytes_by_part() == plan.by_part, "forward_peak_growth_bytes": growth,
            "activation_allowance_bytes": plan.workspace.activation_bytes,
            "workspace_bytes": plan.workspace.total, "ratio": growth / plan.workspace.activation_bytes}


def index_rows(results: dict) -> list[Target]:
    rows = results["rows"]
    return [target("resident weights = the planner's bytes, part by part, every row",
                  all(r["weights_exact"] for r in rows)),
            target("forward peak RSS growth <= the planned workspace, every row",
                  all(r["forward_peak_growth_bytes"] <= r["workspace_bytes"] for r in rows))]


def markdown(results: dict, json_path: str, png_path: str) -> str:
    sizes = ("forward_peak_growth_bytes", "activation_allowance_bytes", "workspace_bytes")
    what = f"preset `{results['preset']}`, TP 1, one fresh process per row, 1 torch thread"
    return "\n".join([
        section_start(SECTION, "memory", results["argv"], results["machine"], what, json_path), "",
        *table("checkpoint | held | dtype | T | weights = plan | forward peak MB | allowance MB "
               "| workspace MB | ratio (peak / allowance)",
               ([r["checkpoint_format"], r["experts_held"], r["dtype"], r["tokens"], r["weights_exact"],
                 *(f"{r[k] / 1e6:.1f}" for k in sizes), f"{r['ratio']:.2f}"] for r in results["rows"]),
               "lllrlrrrr"), "",
        *(f"- {t.target}: {t.measured}" for t in index_rows(results))])


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "memory")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", default="256,2048,8192")
    ap.add_argument("--child", nargs=3, metavar=("CKPT", "DTYPE", "T"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure_one(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    machine = harness.machine_record()
    rows = []
    for fmt in ("dense", "mxfp4"):
        ckpt = harness.preset_checkpoint(args.preset, 2, mxfp4=fmt == "mxfp4")
        for dtype in ("float32", "bfloat16"):
            for T in harness.int_list(args.tokens):
                child = [sys.executable, "-m", "scripts.bench.memory", "--child", str(ckpt), dtype, str(T)]
                out = subprocess.run(child, cwd=ROOT, capture_output=True, text=True, check=True).stdout
                rows.append(row := json.loads(out.strip().splitlines()[-1]))
                print(f"{fmt} {dtype} T={T}: weights exact {row['weights_exact']}, ratio {row['ratio']:.2f}")
    ok = all(r["weights_exact"] for r in rows)
    return harness.report(args, {"preset": args.preset, "rows": rows}, machine, markdown, index_rows, ok=ok)


if __name__ == "__main__":
    raise SystemExit(main())
