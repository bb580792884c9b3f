"""Tail benchmark: every legal tail (and the earlier wide single all-reduce) at several TP sizes and
token counts, the tail alone and the whole layer, by stage, with the bytes each rank hands to the
collectives, and the token-sharded routed input per mode. The page says more.

    python -m scripts.bench.tail --tp 1 2 --tokens 1 16 256 2048       # small preset, minutes
    python -m scripts.bench.tail --preset tiny --tp 1 2 --tokens 1 16 --docs ''   # seconds
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from moe_runtime.activation import GatedActivation
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import routed_experts, shared_experts
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group
from moe_runtime.tp.plan import TailPlan
from moe_runtime.tp.routed_input import RoutedInputConfig
from moe_runtime.tp.runner import LatentMoERunner, build_rank_runners
from moe_runtime.units import torch_dtype

from . import harness
from .docs import Target, model_text, render_section, section_start, table, target, verdict, verdict_text

LAYER = 1
SECTION = "# Tails (scripts/bench/tail.py)"
ROUTED_INPUT_MODES = ("off", "none", "fp8-approx", "mxfp4-approx")  # dense experts: no exact mxfp4
WIDE = "single_allreduce_wide"


def timed_replays(calls: dict[str, tuple[LatentMoERunner, Callable]], reps: int) -> dict[str, dict]:
    """Each ``(runner, fn)`` once, then ``reps`` rounds of all in turn, timed whole and by stage: per
    call the median (lower middle) replay's ``ms``, its ``stages_ms``, ``other_ms`` (the rest), ``all_ms``."""
    def replay(name: str) -> tuple[float, dict[str, float]]:
        timer, fn = calls[name][0].timer, calls[name][1]
        timer.enabled = True  # its totals are empty: a disabled timer records nothing
        try:
            timer.sync()
            start = time.perf_counter()
            timer.start()
            fn()
            timer.sync()
            return (time.perf_counter() - start) * 1e3, {s: secs * 1e3 for s, secs in timer.totals.items()}
        finally:
            timer.enabled = False
            timer.totals.clear()

    for _, fn in calls.values():
        fn()
    out = {}
    for name, runs in harness.in_turns(calls, reps, replay).items():
        total, stages = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]
        out[name] = {"ms": total, "stages_ms": stages, "other_ms": total - sum(stages.values()),
                     "all_ms": [r[0] for r in runs]}
    return out


def _replay_wide_single_allreduce(runner: LatentMoERunner, L, S, dtype) -> torch.Tensor:
    """The earlier single all-reduce of ``[S | (gamma * L) Wup^T | L]`` (RMSNorm is a per-row scale:
    the rms is applied after it), for comparison only."""
    H, w = runner.cfg.hidden_size, runner.w
    PR_TH = runner._up(L if w.norm_D is None else L * w.norm_D, dtype).float()
    runner.timer.mark("up_proj")
    buf = runner.comm.all_reduce(torch.cat([PR_TH, L] if S is None else [S.float(), PR_TH, L], dim=1))
    runner.timer.mark("collectives")
    offset = 0 if S is None else H
    R_TH = buf[:, offset : offset + H]
    if w.norm_D is not None:
        L_sum = buf[:, offset + H :]
        R_TH = R_TH * torch.rsqrt(L_sum.pow(2).mean(-1, keepdim=True) + runner.cfg.rms_norm_eps)
    return (R_TH if S is None else buf[:, :H] + R_TH).to(dtype)


def _tail_rows(comm: Collectives, runners: dict, base: LatentMoERunner, x: torch.Tensor, dtype,
               tail_reps: int, act: GatedActivation) -> list[dict]:
    """Every tail (and the wide single all-reduce) replayed on the same partials of ``x``."""
    T, cfg = x.shape[0], base.cfg
    L = routed_experts(x, base.routed_input_latent(x), base.w, cfg, base.backend, act)
    S = shared_experts(x, base.w, act)
    tails = {tail: (runner, lambda r=runner, t=tail: r.apply_tail(  # it may modify its partials: copies
                 t, L.clone(), None if S is None else S.clone(), dtype)) for tail, runner in runners.items()}
    if "single_allreduce" in tails:
        tails[WIDE] = (base, partial(_replay_wide_single_allreduce, base, L.clone(), S, dtype))
    tail_ts = timed_replays(tails, tail_reps if T < 4096 else max(3, tail_reps // 2))
    layer_ts = timed_replays({tail: (runner, partial(runner.forward, x, tail=tail)) for tail, runner
                              in runners.items()}, 1 if T >= 4096 else 3)
    rows = []
    for tail, (_, run_tail) in tails.items():
        tail_t, layer_t = tail_ts[tail], layer_ts.get(tail)
        comm.nbytes.clear()
        run_tail()
        rows.append({"P": comm.world, "T": T, "tail": tail, "tail_ms": tail_t["ms"],
                     "tail_stages_ms": tail_t["stages_ms"], "tail_other_ms": tail_t["other_ms"],
                     "tail_all_ms": tail_t["all_ms"], "layer_ms": layer_t and layer_t["ms"],
                     "layer_stages_ms": {} if layer_t is None else layer_t["stages_ms"],
                     "layer_other_ms": layer_t and layer_t["other_ms"],
                     "collective_bytes_per_token": sum(comm.nbytes.values()) / T})
    return rows


def _routed_input_rows(comm: Collectives, base: LatentMoERunner, x: torch.Tensor, reps: int) -> list[dict]:
    """The token-sharded routed input's down-projection and gather, per routed-input mode."""
    rows = []
    for quant in ROUTED_INPUT_MODES:
        ri = RoutedInputConfig(quant != "off", "none" if quant == "off" else quant, 1)
        r = LatentMoERunner(base.cfg, base.w, comm, base.plan, base.shard, routed_input=ri)
        st = timed_replays({quant: (r, partial(r.routed_input_latent, x))}, reps)[quant]
        rows.append({"P": comm.world, "T": x.shape[0], "routed_input": quant, "total_ms": st["ms"],
                     "down_proj_ms": st["stages_ms"].get("down_proj", 0.0),
                     "gather_ms": st["stages_ms"].get("collectives", 0.0), "other_ms": st["other_ms"]})
    return rows


def _rank_bench(comm: Collectives, ckpt: str, tokens: list[int], dtype_name: str, tail_reps: int) -> dict:
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    dtype = torch_dtype(dtype_name)
    plan = TailPlan.single("replicated", "bench")
    base = build_rank_runners(ckpt, cfg, [LAYER], comm, plan, dtype=dtype)[LAYER]
    runners = {tail: base for tail in base.legal_tails}
    if comm.world > 1:
        sp_plan = TailPlan.single("sequence_parallel", "bench")
        runners["sequence_parallel"] = LatentMoERunner(cfg, base.w, comm, sp_plan, base.shard)
    act = GatedActivation.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    rows, routed = [], []
    for T in tokens:
        x = torch.randn(T, cfg.hidden_size, generator=gen).to(dtype)
        rows += _tail_rows(comm, runners, base, x, dtype, tail_reps, act)
        if comm.world > 1:
            routed += _routed_input_rows(comm, base, x, max(3, tail_reps // 2))
    return {"rows": rows, "routed_input": routed}


def _crossovers(rows: list[dict]) -> dict[int, list[dict]]:
    """Per P and T the fastest tail (not sequence_parallel, which returns a rank's rows, nor the wide)."""
    out: dict[int, list[dict]] = {}
    for P, T in sorted({(r["P"], r["T"]) for r in rows}):
        win = min((r for r in rows if (r["P"], r["T"]) == (P, T)
                   and r["tail"] not in ("sequence_parallel", WIDE)), key=lambda r: r["tail_ms"])
        out.setdefault(P, []).append({"T": T, "fastest_tail": win["tail"], "tail_ms": win["tail_ms"]})
    return out


def compute_targets(rows: list[dict], routed: list[dict], tp: list[int], tokens: list[int]) -> dict:
    """Each target's measured ratio and its verdict, from the rows (nothing assumed)."""
    ms = {(r["P"], r["T"], r["tail"]): r["tail_ms"] for r in rows}
    targets = {}

    def ratio(name: str, a: tuple, b: tuple, op: str, limit: float) -> None:
        if ms.get(a) and ms.get(b):
            targets[name] = verdict(ms[a] / ms[b], op, limit)

    for T in [t for t in tokens if t >= 2048]:
        ratio(f"P2_T{T}_sharded_over_replicated", (2, T, "sharded"), (2, T, "replicated"), "<=", 0.75)
    for P in [p for p in tp if p > 1]:
        for T in tokens:
            ratio(f"P{P}_T{T}_single_allreduce_over_wide", (P, T, "single_allreduce"), (P, T, WIDE), "<", 1)
    for P in [p for p in tp if p > 1]:  # at P = 1 there is no collective to save (listed after the above)
        ratio(f"P{P}_T1_single_allreduce_over_replicated", (P, 1, "single_allreduce"), (P, 1, "replicated"),
              "<", 1)
    down = {x["routed_input"]: x["down_proj_ms"] for x in routed if (x["P"], x["T"]) == (2, max(tokens))}
    if down.get("off") and down.get("none"):
        targets[f"P2_T{max(tokens)}_down_proj_speedup"] = verdict(down["off"] / down["none"], ">=", 1.6)
    return targets


def median_targets(rounds: list[dict]) -> dict:
    """Each target's median over the rounds' ratios: at T = 1 a ratio swings 3x between runs here."""
    bounds = {name: v["target"].split() for name, v in rounds[0].items()}  # "< 1" -> "<", 1
    return {name: verdict(statistics.median(r[name]["value"] for r in rounds), op,
                          int(limit) if limit.isdigit() else float(limit))
            for name, (op, limit) in bounds.items()}


def index_rows(result: dict) -> list[Target]:
    return [target(name, v) for name, v in result["targets"].items()]


def tail_cells(r: dict) -> list:
    tail, layer = r["tail_stages_ms"], r["layer_stages_ms"]
    ms = [r["tail_ms"], tail.get("collectives"), tail.get("up_proj"), r["tail_other_ms"], r["layer_ms"],
          *(layer.get(s) for s in ("down_proj", "experts", "collectives", "up_proj")), r["layer_other_ms"]]
    return [r["P"], r["T"], r["tail"], *("" if v is None else f"{v:.2f}" for v in ms),
            f"{r['collective_bytes_per_token']:.0f}"]


def markdown(result: dict, json_path: str, png_path: str) -> str:
    what = (f"`{result['preset']}` preset ({model_text(result['model'])}), {result['dtype']}, gloo on CPU, "
            f"TP {', '.join(map(str, result['tp']))}")
    lines = [
        section_start(SECTION, "tail", result["argv"], result["machine"], what, json_path), "",
        *table("P | T | tail | tail ms | tail: collectives | tail: up-proj | tail: other | layer ms "
               "| layer: down-proj | layer: experts | layer: collectives | layer: up-proj | layer: other "
               "| B/token", map(tail_cells, result["rows"]), "rrlrrrrrrrrrrr"), "",
        "Fastest tail per token count (sequence_parallel and the wide replay excluded):", "",
        *(f"- TP {P}: " + " -> ".join(f"T={b['T']}: {b['fastest_tail']} ({b['tail_ms']:.2f} ms)"
                                      for b in best) for P, best in result["crossovers"].items())]
    if result["routed_input"]:
        lines += ["", "Token-sharded routed input (per rank), stages of the median replay:", "",
                  *table("P | T | routed input | total ms | down-proj ms | all-gather (+quant) ms | other ms",
                         ([x["P"], x["T"], x["routed_input"], *(f"{x[k]:.2f}" for k in (
                             "total_ms", "down_proj_ms", "gather_ms", "other_ms"))]
                          for x in result["routed_input"]), "rrlrrrr")]
    rounds = result.get("rounds", [])
    return "\n".join([*lines, "", f"Targets (median of {len(rounds)} rounds' ratios; tables: the last):", "",
                      *([f"- {name}: {verdict_text(t)}; rounds " + ", ".join(f"{r[name]:.2f}" for r in rounds)
                         for name, t in result["targets"].items()]
                        or ["- none measurable with these TP sizes and token counts"]), "", *reading(result)])


def reading(result: dict) -> list[str]:
    """The sharded tail against the replicated one, and the exact token-sharded routed input's
    down-projection against the replicated one's at the largest T, per TP size."""
    by, out = {(r["P"], r["T"], r["tail"]): r for r in result["rows"]}, []
    for (P, T, tail), s in sorted(by.items()):
        rp = by.get((P, T, "replicated"))
        su, ru = s["tail_stages_ms"].get("up_proj"), rp and rp["tail_stages_ms"].get("up_proj")
        if tail == "sharded" and su is not None and ru:
            out.append(f"- TP {P}, T = {T}: sharded / replicated tail {s['tail_ms'] / rp['tail_ms']:.2f}x, "
                       f"up-projection {su:.2f} / {ru:.2f} ms ({su / ru:.2f}x).")
    routed = result["routed_input"]
    for P in sorted({x["P"] for x in routed}):
        Tmax = max(x["T"] for x in routed if x["P"] == P)
        by = {x["routed_input"]: x for x in routed if (x["P"], x["T"]) == (P, Tmax)}
        if "off" in by and by.get("none", {}).get("down_proj_ms"):
            off, on = by["off"]["down_proj_ms"], by["none"]["down_proj_ms"]
            gathers = ", ".join(f"{q} {by[q]['gather_ms']:.2f}" for q in ROUTED_INPUT_MODES[1:] if q in by)
            out.append(f"- Token-sharded routed input, TP {P}, T = {Tmax}: down-projection {off:.2f} -> "
                       f"{on:.2f} ms ({off / on:.2f}x); all-gather ms: {gathers}.")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "tail")
    ap.add_argument("--checkpoint", type=Path, help="default: the --preset checkpoint under checkpoints/")
    ap.add_argument("--preset", default="small", choices=("tiny", "medium", "small"))
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048, 8192])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--tail-reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3, help="runs of every TP size (targets: their median)")
    ap.add_argument("--render", type=Path, help="measure nothing: rewrite the page from this JSON")
    args = ap.parse_args(argv)
    if args.render:
        render_section(args.render, markdown, index_rows, args.docs, "tail")
        return 0
    ckpt = args.checkpoint or harness.preset_checkpoint(args.preset)
    machine, rounds = harness.machine_record(), []
    for i in range(args.rounds):
        rows, routed = [], []
        for P in args.tp:
            print(f"round {i + 1}/{args.rounds}, TP {P}: timing tails at T = {args.tokens} ...", flush=True)
            res = run_local_group(P, _rank_bench, str(ckpt), args.tokens, args.dtype, args.tail_reps,
                                  timeout_s=3600)[0]
            rows, routed = rows + res["rows"], routed + res["routed_input"]
        rounds.append(compute_targets(rows, routed, args.tp, args.tokens))
    result = {"preset": args.preset if args.checkpoint is None else f"checkpoint {args.checkpoint}",
              "tp": args.tp, "dtype": args.dtype, "rows": rows, "routed_input": routed,
              "model": harness.model_record(LatentMoEConfig.from_pretrained(ckpt)),
              "crossovers": _crossovers(rows), "targets": median_targets(rounds),
              "rounds": [{name: v["value"] for name, v in r.items()} for r in rounds]}
    return harness.report(args, result, machine, markdown, index_rows)


if __name__ == "__main__":
    raise SystemExit(main())
