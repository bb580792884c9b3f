"""Tail benchmark: every legal tail at several TP sizes and token counts, side by side.

For each P and T it reports the median time of the tail alone (everything after the
experts, replayed on the same partials) and of the whole layer, the per-stage breakdown,
the bytes per token each rank hands to the tail's collectives (measured by counting), the
fastest tail per T (crossovers), and the token-sharded routed input's down-projection
time. ``single_allreduce_wide`` is the earlier packing of the single all-reduce,
``[S | (gamma*L)Wup^T | L]`` in fp32 (width 2H + D), replayed here for comparison with
today's ``[S | L]`` in the deployment dtype (H + D). The load average before and after the
run goes into the JSON (the machine may be shared). Writes JSON + PNG; the table goes to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from moe_runtime.activation import GatedActivation  # noqa: E402
from moe_runtime.config import LatentMoEConfig  # noqa: E402
from moe_runtime.layer import routed_experts, shared_experts  # noqa: E402
from moe_runtime.synthetic import preset_config, write_checkpoint  # noqa: E402
from moe_runtime.tp.collectives import Collectives  # noqa: E402
from moe_runtime.tp.local_group import run_local_group  # noqa: E402
from moe_runtime.tp.plan import TailPlan  # noqa: E402
from moe_runtime.tp.routed_input import RoutedInputConfig  # noqa: E402
from moe_runtime.tp.runner import LatentMoERunner, build_rank_runners  # noqa: E402
from moe_runtime.units import torch_dtype  # noqa: E402

LAYER = 1


def _median_ms(fn, reps: int, sync) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _replay_tail(runner: LatentMoERunner, tail: str, L, S, dtype) -> None:
    runner.apply_tail(tail, L.clone(), None if S is None else S.clone(), dtype)


def _replay_wide_single_allreduce(runner: LatentMoERunner, L, S, dtype) -> torch.Tensor:
    """The earlier single all-reduce (for comparison only): RMSNorm is a per-row scale, so
    ``R = ((gamma * L) Wup^T) / rms(L)`` and one fp32 all-reduce of
    ``[S | (gamma * L) Wup^T | L]`` carries everything; the rms is applied after it."""
    H, w = runner.cfg.hidden_size, runner.w
    scaled = L if w.norm_D is None else L * w.norm_D
    PR_TH = runner._up(scaled, dtype).float()
    runner.timer.mark("up_proj")
    parts = [PR_TH, L] if S is None else [S.float(), PR_TH, L]
    buf = runner.comm.all_reduce(torch.cat(parts, dim=1))
    runner.timer.mark("collectives")
    offset = 0 if S is None else H
    R_TH = buf[:, offset : offset + H]
    if w.norm_D is not None:
        L_sum = buf[:, offset + H :]
        R_TH = R_TH * torch.rsqrt(L_sum.pow(2).mean(-1, keepdim=True) + runner.cfg.rms_norm_eps)
    return (R_TH if S is None else buf[:, :H] + R_TH).to(dtype)


WIDE = "single_allreduce_wide"


def _collective_bytes_per_token(comm: Collectives, run, T: int) -> float:
    comm.nbytes.clear()
    run()
    return sum(comm.nbytes.values()) / T


def _stage_medians(runner: LatentMoERunner, run, reps: int) -> dict[str, float]:
    runner.timer.enabled = True
    per_stage: dict[str, list[float]] = {}
    for _ in range(reps):
        runner.timer.totals.clear()
        runner.timer.start()
        run()
        for stage, secs in runner.timer.totals.items():
            per_stage.setdefault(stage, []).append(secs * 1e3)
    runner.timer.enabled = False
    return {stage: statistics.median(v) for stage, v in per_stage.items()}


def _rank_bench(comm: Collectives, ckpt: str, tokens: list[int], dtype_name: str, tail_reps: int) -> dict:
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    dtype = torch_dtype(dtype_name)
    P = comm.world
    base = build_rank_runners(ckpt, cfg, [LAYER], comm, TailPlan.single("replicated", "bench"), dtype=dtype)[
        LAYER
    ]
    shard = base.shard
    runners = {tail: base for tail in base.legal_tails}
    if P > 1:
        sp_plan = TailPlan.single("sequence_parallel", "bench")
        runners["sequence_parallel"] = LatentMoERunner(cfg, base.w, comm, sp_plan, shard)
    act = GatedActivation.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    rows, routed = [], []
    for T in tokens:
        x = torch.randn(T, cfg.hidden_size, generator=gen).to(dtype)
        full_reps = 1 if T >= 4096 else 3
        L = routed_experts(x, base.routed_input_latent(x), base.w, cfg, base.backend, act)
        S = shared_experts(x, base.w, act)
        tails = {
            tail: (runner, partial(_replay_tail, runner, tail, L, S, dtype))
            for tail, runner in runners.items()
        }
        if "single_allreduce" in tails:
            tails[WIDE] = (base, partial(_replay_wide_single_allreduce, base, L.clone(), S, dtype))
        for tail, (runner, run_tail) in tails.items():
            run_layer = None if tail == WIDE else partial(runner.forward, x, tail=tail)
            tail_ms = _median_ms(run_tail, tail_reps if T < 4096 else max(3, tail_reps // 2), base.timer.sync)
            rows.append(
                {
                    "P": P,
                    "T": T,
                    "tail": tail,
                    "tail_ms": tail_ms,
                    "layer_ms": None
                    if run_layer is None
                    else _median_ms(run_layer, full_reps, base.timer.sync),
                    "collective_bytes_per_token": _collective_bytes_per_token(comm, run_tail, T),
                    "tail_stages_ms": _stage_medians(runner, run_tail, 3),
                    "layer_stages_ms": {}
                    if run_layer is None
                    else _stage_medians(runner, run_layer, full_reps),
                }
            )
        if P > 1:
            for quant in ("off", "none", "fp8-approx", "mxfp4-approx"):  # dense experts: no exact mxfp4
                ri = RoutedInputConfig(quant != "off", "none" if quant == "off" else quant, 1)
                r = LatentMoERunner(cfg, base.w, comm, base.plan, shard, routed_input=ri)
                st = _stage_medians(r, partial(r.routed_input_latent, x), max(3, tail_reps // 2))
                routed.append(
                    {
                        "P": P,
                        "T": T,
                        "routed_input": quant,
                        "down_proj_ms": st.get("down_proj", 0.0),
                        "gather_ms": st.get("collectives", 0.0),
                    }
                )
    return {"rows": rows, "routed_input": routed}


def _crossovers(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for P in sorted({r["P"] for r in rows}):
        best = []
        for T in sorted({r["T"] for r in rows if r["P"] == P}):
            cands = [
                r
                for r in rows
                if r["P"] == P and r["T"] == T and r["tail"] not in ("sequence_parallel", WIDE)
            ]
            win = min(cands, key=lambda r: r["tail_ms"])
            best.append({"T": T, "fastest_tail": win["tail"], "tail_ms": win["tail_ms"]})
        out[P] = best
    return out


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ps = sorted({r["P"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(Ps) + 1, figsize=(6 * (len(Ps) + 1), 4.5))
    for ax, P in zip(axes, Ps, strict=False):
        for tail in sorted({r["tail"] for r in result["rows"] if r["P"] == P}):
            pts = sorted((r["T"], r["tail_ms"]) for r in result["rows"] if r["P"] == P and r["tail"] == tail)
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=tail,
                ls="--" if tail == WIDE else "-",
            )
        ax.set(
            xscale="log", yscale="log", xlabel="tokens T", ylabel="tail time (ms, median)", title=f"TP {P}"
        )
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[-1]
    ri = [r for r in result["routed_input"]]
    if ri:
        Tmax = max(r["T"] for r in ri)
        sel = [r for r in ri if r["T"] == Tmax]
        ax.bar([r["routed_input"] for r in sel], [r["down_proj_ms"] for r in sel], label="down-projection")
        ax.bar(
            [r["routed_input"] for r in sel],
            [r["gather_ms"] for r in sel],
            bottom=[r["down_proj_ms"] for r in sel],
            label="all-gather (+quant)",
        )
        ax.set(title=f"routed input per rank, TP {sel[0]['P']}, T={Tmax}", ylabel="ms")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", type=Path, help="default: generate the small preset")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048, 8192])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--tail-reps", type=int, default=9)
    ap.add_argument("--out", type=Path, default=Path("artifacts/bench_tail"))
    args = ap.parse_args(argv)
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = Path("artifacts/checkpoints/small")
        if not (ckpt / "config.json").is_file():
            write_checkpoint(ckpt, preset_config("small"), progress=True)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    load_before = os.getloadavg()
    rows, routed = [], []
    for P in args.tp:
        print(f"TP {P}: timing tails at T = {args.tokens} ...", flush=True)
        res = run_local_group(
            P, _rank_bench, str(ckpt), args.tokens, args.dtype, args.tail_reps, timeout_s=3600
        )
        rows += res[0]["rows"]
        routed += res[0]["routed_input"]
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "dtype": args.dtype,
        "model": {
            k: getattr(cfg, k)
            for k in (
                "hidden_size",
                "routed_expert_hidden_size",
                "num_experts",
                "num_experts_per_token",
                "moe_intermediate_size",
                "num_shared_experts",
            )
        },
        "rows": rows,
        "routed_input": routed,
        "crossovers": _crossovers(rows),
    }

    def tail_ms(P: int, T: int, tail: str) -> float | None:
        hit = [r["tail_ms"] for r in rows if (r["P"], r["T"], r["tail"]) == (P, T, tail)]
        return hit[0] if hit else None

    targets = {}
    for T in [t for t in args.tokens if t >= 2048]:
        s, r = tail_ms(2, T, "sharded"), tail_ms(2, T, "replicated")
        if s and r:
            targets[f"P2_T{T}_sharded_over_replicated"] = {
                "ratio": s / r,
                "target": "<= 0.75",
                "met": s / r <= 0.75,
            }
    for P in [p for p in args.tp if p > 1]:
        for T in args.tokens:
            new, old = tail_ms(P, T, "single_allreduce"), tail_ms(P, T, WIDE)
            if new and old:
                targets[f"P{P}_T{T}_single_allreduce_over_wide"] = {
                    "ratio": new / old,
                    "target": "< 1",
                    "met": new < old,
                }
    for P in [p for p in args.tp if p > 1]:  # at P = 1 there is no collective to save
        s, r = tail_ms(P, 1, "single_allreduce"), tail_ms(P, 1, "replicated")
        if s and r:
            targets[f"P{P}_T1_single_allreduce_over_replicated"] = {
                "ratio": s / r,
                "target": "< 1",
                "met": s < r,
            }
    Tmax = max(args.tokens)
    off = [x for x in routed if x["P"] == 2 and x["T"] == Tmax and x["routed_input"] == "off"]
    on = [x for x in routed if x["P"] == 2 and x["T"] == Tmax and x["routed_input"] == "none"]
    if off and on:
        speedup = off[0]["down_proj_ms"] / on[0]["down_proj_ms"]
        targets[f"P2_T{Tmax}_down_proj_speedup"] = {
            "ratio": speedup,
            "target": ">= 1.6",
            "met": speedup >= 1.6,
        }
    result["targets"] = targets

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_tail.json").write_text(json.dumps(result, indent=1))
    _plot(result, args.out / "bench_tail.png")

    print(f"load average before {load_before}, after {result['machine']['loadavg_after']}")
    header = f"{'P':>2} {'T':>5} {'tail':<22} {'tail ms':>9} {'layer ms':>9} {'B/token':>8}"
    print(f"\n{header}  stages of the tail (ms)")
    for r in rows:
        st = ", ".join(f"{k} {v:.2f}" for k, v in r["tail_stages_ms"].items())
        layer = "-" if r["layer_ms"] is None else f"{r['layer_ms']:.1f}"
        print(
            f"{r['P']:>2} {r['T']:>5} {r['tail']:<22} {r['tail_ms']:>9.2f} {layer:>9} "
            f"{r['collective_bytes_per_token']:>8.0f}  {st}"
        )
    print("\nrouted input (per rank):")
    for x in routed:
        print(
            f"P {x['P']} T {x['T']:>5} {x['routed_input']:<12} down-proj {x['down_proj_ms']:8.2f} ms  "
            f"gather {x['gather_ms']:7.2f} ms"
        )
    print("\nfastest tail per T:", json.dumps(result["crossovers"]))
    print("targets:")
    for name, t in targets.items():
        print(f"  {name}: {t['ratio']:.3f} (target {t['target']}) {'MET' if t['met'] else 'MISSED'}")
    print(f"wrote {args.out / 'bench_tail.json'} and {args.out / 'bench_tail.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
