"""Real-size benchmark: one Kimi-K3 MoE layer (MXFP4 experts held packed) at TP 1 and 2, bf16: the load
against plain sequential reads of the same files, then the forward *before* and *after* issue 48 at
each ``--tokens`` T against the memory-bound limit and torch's dense GEMMs. The page says more.

    python scripts/make_checkpoint.py --preset kimi-k3 --mxfp4 --moe-layers 1 --out /work/ckpt/k3-1layer
    python -m scripts.bench.real --checkpoint /work/ckpt/k3-1layer --tp 1
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter, namedtuple
from pathlib import Path
from typing import Any

import torch

from moe_runtime.checkpoint import load_threads
from moe_runtime.cli import process_rss
from moe_runtime.config import LatentMoEConfig
from moe_runtime.experts import DEFAULT_SCRATCH_BYTES, crossover, mxfp4_cpu
from moe_runtime.router import route
from moe_runtime.tp.collectives import Collectives  # the rank's type
from moe_runtime.tp.local_group import run_local_group
from moe_runtime.tp.runner import LatentMoERunner

from . import harness
from .docs import Target, pct, section_start, table, target, target_lines, verdict, verdict_word
from .rss import TreeSampler, proc_bytes

SECTION = "# Real-size layer on CPU: fused, batched and AVX-512 experts (`scripts/bench/real.py`)"
NAME = "real"
LAYER = 1
GB = 1e9
READ_CHUNK = 64 * 2**20
# the targets, judged at TP 1
LOAD_TARGET = 0.5  # load GB/s / sequential read GB/s
MEMORY_BOUND_TARGETS = {1: 0.9, 16: 0.8, 64: 0.8}  # T -> memory-bound limit / forward time (after)
GEMM_FROM_TOKENS, GEMM_TARGET = 512, 0.5  # forward GFLOP/s / dense GEMM GFLOP/s
# One GEMM shape of a forward: [m, k] @ [k, n] in dtype, count times; flops the forward's own
# (experts: from the exact token-slot count, not m x count).
Gemm = namedtuple("Gemm", "name m n k dtype count flops")
PEAK_SHAPE = (2048, 3584, 6144)  # m, k, n of the bf16 GEMM peak: a K3 expert's gate|up over 2048 rows


def packed_mode(mode: str) -> None:
    """*before*: the release before issue 48 (the page says what it ran); *after*: the defaults."""
    for key in (mxfp4_cpu.ISA_ENV, mxfp4_cpu.BATCHED_ENV):
        os.environ.pop(key, None)
    if mode == "before":
        os.environ.update({mxfp4_cpu.ISA_ENV: "avx2", mxfp4_cpu.BATCHED_ENV: "0"})


def before_and_after(call, reps: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """``call`` under each packed mode in turns (*after* last, left set): each mode's seconds, last answer."""
    outs: dict[str, Any] = {}

    def timed(mode: str) -> float:
        packed_mode(mode)
        start = time.perf_counter()
        outs[mode] = call()
        return time.perf_counter() - start

    return harness.in_turns(("before", "after"), reps, timed), outs


def bf16_peak_gflops(reps: int) -> float:
    """torch's bf16 GEMM GFLOP/s on ``PEAK_SHAPE``, best of ``reps``."""
    m, k, n = PEAK_SHAPE
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    return 2 * m * k * n / min(harness.time_calls(lambda: x @ w.t(), reps)) / GB


def sequential_read(files: list[Path], keep: bool, chunk: int = READ_CHUNK) -> dict[str, float]:
    """A sequential read of ``files`` in ``chunk``-byte reads: into one fresh buffer of their size held to
    the end (``keep``, as a load holds what it reads), or into one reused ``chunk`` buffer."""
    start = time.perf_counter()
    size = sum(p.stat().st_size for p in files) if keep else chunk
    buf = memoryview(torch.empty(size, dtype=torch.uint8).numpy())
    nbytes = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf[nbytes : nbytes + chunk] if keep else buf):
                nbytes += n
    seconds = time.perf_counter() - start
    del buf
    return {"bytes": nbytes, "s": seconds, "gbps": nbytes / seconds / GB}


def forward_gemms(cfg: LatentMoEConfig, runner: LatentMoERunner, T: int, active: int) -> list[Gemm]:
    """The GEMMs one rank's forward of T tokens runs; routed experts at the mean rows per active expert."""
    H, D, E, K = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts, cfg.num_experts_per_token
    P, bf16 = runner.shard.world, "bfloat16"
    I_l, S_l = cfg.moe_intermediate_size // P, cfg.shared_intermediate_size // P
    slots = T * K
    m = max(1, round(slots / active))
    up_rows = H // P if runner.plan.tail_for(T) == "sharded" else H
    gemms = [Gemm("router", T, E, H, "float32", 1, 2 * T * E * H),
             Gemm("latent down", T, D, H, bf16, 1, 2 * T * D * H),
             Gemm("experts gate|up", m, 2 * I_l, D, bf16, active, 2 * slots * 2 * I_l * D),
             Gemm("experts down", m, D, I_l, bf16, active, 2 * slots * D * I_l),
             Gemm("up projection", T, up_rows, D, bf16, 1, 2 * T * up_rows * D)]
    if cfg.num_shared_experts:
        gemms += [Gemm("shared gate|up", T, S_l, H, bf16, 2, 2 * 2 * T * S_l * H),
                  Gemm("shared down", T, H, S_l, bf16, 1, 2 * T * H * S_l)]
    return gemms


def dense_gemm_seconds(gemms: list[Gemm], reps: int) -> tuple[float, list[dict]]:
    """Seconds the GEMMs take as torch matmuls of the same shapes and dtypes (best of ``reps`` each)."""
    total, rows = 0.0, []
    gen = torch.Generator().manual_seed(0)
    for g in gemms:
        dtype = getattr(torch, g.dtype)
        x = torch.randn(g.m, g.k, generator=gen).to(dtype)
        w = torch.randn(g.n, g.k, generator=gen).to(dtype)
        best = min(harness.time_calls(lambda x=x, w=w: x @ w.t(), reps))
        gflops = 2 * g.m * g.n * g.k / best / GB
        total += g.flops / GB / gflops
        rows.append({**g._asdict(), "gflops": gflops})
        del x, w
    return total, rows


class LoneRank(Collectives):
    """Rank ``rank`` of a TP group of ``world`` run alone: the other ranks' partials count as
    zero. Measures one rank's load memory and compute when the machine cannot hold them all."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.device = rank, world, torch.device("cpu")
        self.counts = Counter()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_reduce_async(self, t: torch.Tensor):
        return Collectives().all_reduce_async(t)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        rows = t.shape[0] // self.world
        return t[self.rank * rows : (self.rank + 1) * rows]

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat(self.world, *([1] * (t.dim() - 1)))


def _lone_rank(_: Collectives, world: int, *args) -> dict:
    return _rank(LoneRank(0, world), *args)


def forward_row(runner: Any, cfg: LatentMoEConfig, T: int, reps: int, active_bytes: int, dense_bytes: int
                ) -> tuple[dict[str, Any], torch.Tensor]:
    """``T`` tokens through both paths, in turns (a disturbance slows both alike), ``reps`` times:
    the row (medians, what the forward must read, its FLOPs) and the *after* output."""
    x = harness.seeded_randn(T, cfg.hidden_size, seed=T, dtype=torch.bfloat16)
    load0 = harness.loadavg()
    times, outs = before_and_after(lambda: runner.forward(x), reps)
    ids, _ = route(x, runner.w.gate_EH, runner.w.bias_E, cfg)
    active = len(torch.unique(ids))
    gemms = forward_gemms(cfg, runner, T, active)
    # ms: after's (before's under "before"); must read: the active experts' packed bytes, every dense tensor
    row = {"T": T, "ms": harness.median_ms(times["after"]),
           "before": {"ms": harness.median_ms(times["before"])},
           "all_ms": {mode: [s * 1e3 for s in t] for mode, t in times.items()},
           "loadavg": [load0[0], harness.loadavg()[0]], "active_experts": active,
           "must_read_bytes": active * active_bytes + dense_bytes, "flops": sum(g.flops for g in gemms),
           "after_vs_before": harness.rel_diff(outs["after"].float(), outs["before"].float())}
    if T >= GEMM_FROM_TOKENS:
        row["dense_gemm_s"], row["dense_gemms"] = dense_gemm_seconds(gemms, reps)
    return row, outs["after"].float()


def _rank(comm: Collectives, ckpt: str, tokens: list[int], reps: int, scratch_bytes: int,
          check_tokens: int) -> dict:
    packed_mode("after")  # the load measures the experts' crossover
    runner = harness.rank_runner(comm, ckpt, LAYER, "auto", torch.bfloat16, scratch_bytes=scratch_bytes,
                                 progress=comm.rank == 0 and sys.stderr.isatty())
    cfg, parts = runner.cfg, runner.resident_bytes_by_part()
    res: dict[str, Any] = {
        "pid": os.getpid(), "threads": torch.get_num_threads(), "load_threads": load_threads(),
        "load_s": runner.load_s, "bytes_read": runner.load_bytes_read, "resident_by_part": parts,
        "rss_after_load": process_rss(), "tail_plan": runner.plan.describe(),
        "experts_path": f"{runner.experts_path} ({runner.experts_path_reason})", "isa": mxfp4_cpu.isa(),
        "gemm_engine": crossover.gemm_engine(), "forward": []}
    dense_bytes = sum(v for k, v in parts.items() if k != "experts_packed")
    packed_per_expert = parts["experts_packed"] // runner.w.experts.num_experts
    with torch.inference_mode():
        warm = harness.seeded_randn(tokens[0], cfg.hidden_size, seed=0, dtype=torch.bfloat16)
        before_and_after(lambda: runner.forward(warm), 1)  # the AVX2 build, the dense crossovers
        for T in tokens:
            row, after = forward_row(runner, cfg, T, reps, packed_per_expert, dense_bytes)
            if T == check_tokens:
                res["check_out"] = after
            res["forward"].append(row)
            print(f"  T {T}: before {row['before']['ms']:.1f} ms, after {row['ms']:.1f} ms "
                  f"(medians of {reps}); after vs before {row['after_vs_before']:.2e}", flush=True)
        res["bf16_peak_gflops"] = bf16_peak_gflops(reps)
        res["dense_crossovers"] = {str(list(k[:2])): c.describe("bf16 kernel", "torch")
                                   for k, c in mxfp4_cpu.DENSE_CROSSOVERS.items()}
    return res


def run_tp(ckpt: str, files: list[Path], P: int, tokens: list[int], reps: int, scratch_bytes: int, lone: bool,
           check_tokens: int) -> dict:
    # the page compares this TP size's loads with these reads
    seq = sequential_read(files, keep=True)
    cached = max((sequential_read(files, keep=False) for _ in range(2)), key=lambda r: r["gbps"])
    print(f"TP {P}: sequential read of {seq['bytes'] / GB:.2f} GB kept at {seq['gbps']:.2f} GB/s, "
          f"into a reused buffer at {cached['gbps']:.2f} GB/s; loading and running ...", flush=True)
    args = (ckpt, tokens, reps, scratch_bytes, check_tokens)
    # anon + shmem of every process (PSS is not read: smaps_rollup of a 16 GB rank is slow)
    with TreeSampler(os.getpid(), 0.1, pss=False) as sampler:
        start = time.perf_counter()
        # TP 1 too runs in a spawned rank: this process's sampler thread would otherwise
        # contend with torch's OpenMP threads (tens of times slower on 2 cores)
        if lone:
            results = run_local_group(1, _lone_rank, P, *args, timeout_s=7200.0)
        else:
            results = run_local_group(P, _rank, *args, timeout_s=7200.0, collective_timeout_s=1800.0)
        wall_s = time.perf_counter() - start
    for rank, r in enumerate(results):
        r["peak_rss"] = sampler.peak_by_pid.get(r["pid"], 0)
        r["peak_rss_over_packed"] = r["peak_rss"] / r["bytes_read"]
        r["load_gbps"] = r["bytes_read"] / r["load_s"] / GB
        r["load_vs_sequential"] = r["load_gbps"] / seq["gbps"]
        print(f"  rank {rank}: load {r['load_s']:.2f} s, read {r['bytes_read'] / GB:.2f} GB at "
              f"{r['load_gbps']:.2f} GB/s = {r['load_vs_sequential']:.0%} of the kept sequential read, "
              f"peak RSS {r['peak_rss'] / GB:.2f} GB = {r['peak_rss_over_packed']:.3f} x packed", flush=True)
    group_gbps = sum(r["bytes_read"] for r in results) / max(r["load_s"] for r in results) / GB
    return {"P": P, "lone_rank": lone, "wall_s": wall_s, "peak_tree_rss": sampler.peak["rss"],
            "sequential_read": seq, "sequential_read_reused": cached, "ranks": results,
            "group_load_gbps": group_gbps,
            "load_verdict": verdict(group_gbps / seq["gbps"], ">=", LOAD_TARGET)}


def forward_verdicts(results: dict[str, Any]) -> None:
    """Per forward row, *after* (top level) and *before*: the memory-bound fraction and GFLOP/s, the
    dense GEMMs' share at T >= 512, the verdicts (TP 1) and at TP > 1 the group's fraction."""
    for run in results["runs"]:
        for r in run["ranks"]:
            for f in r["forward"]:
                f["memory_bound_ms"] = f["must_read_bytes"] / GB / results["memcpy_gbps"] * 1e3
                for path in (f, f["before"]):
                    path["memory_bound_fraction"] = f["memory_bound_ms"] / path["ms"]
                    path["gflops"] = f["flops"] / GB / (path["ms"] / 1e3)
                f["peak_fraction"] = f["gflops"] / r["bf16_peak_gflops"]
                if "dense_gemm_s" in f:
                    f["dense_gemm_gflops"] = f["flops"] / GB / f["dense_gemm_s"]
                    f["gemm_fraction"] = f["gflops"] / f["dense_gemm_gflops"]
                if run["P"] == 1 and f["T"] in MEMORY_BOUND_TARGETS:
                    f["verdict"] = verdict(f["memory_bound_fraction"], ">=", MEMORY_BOUND_TARGETS[f["T"]])
                elif run["P"] == 1 and f["T"] >= GEMM_FROM_TOKENS:
                    f["verdict"] = verdict(f.get("gemm_fraction"), ">=", GEMM_TARGET)
        if run["P"] > 1 and not run["lone_rank"]:
            for rows in zip(*(r["forward"] for r in run["ranks"]), strict=True):
                fraction = sum(f["memory_bound_ms"] for f in rows) / max(f["ms"] for f in rows)
                for f in rows:
                    f["group_memory_bound_fraction"] = fraction


def compare_with_tp1(runs: list[dict], check_tokens: int) -> list[dict]:
    """Each TP size's rank-0 output at ``check_tokens`` tokens against TP 1's (full runs only)."""
    outs = {run["P"]: run["ranks"][0].pop("check_out") for run in runs if "check_out" in run["ranks"][0]}
    for run in runs:
        for r in run["ranks"]:
            r.pop("check_out", None)
    if 1 not in outs:
        return []
    ref, rows = outs.pop(1), []
    scale = ref.abs().max().item()
    for P, got in outs.items():
        err = (got - ref).abs().max().item()
        # bf16 output of sums over the active experts + the shared ones: TP changes the fp32
        # summation order and where bf16 rounding happens; a few bf16 ulps of the output scale
        rows.append({"P": P, "T": check_tokens, "max_abs_err_vs_tp1": err, "ref_abs_max": scale,
                     "ok": err <= 0.02 * scale + 1e-2})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, NAME)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[1])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--reps", type=int, default=3, help="forwards per path and T (the median is kept)")
    ap.add_argument("--lone-rank", action="store_true", help="run only rank 0 of each TP size (identity "
                    "collectives): per-rank memory and compute when the machine cannot hold every rank")
    ap.add_argument("--scratch-mb", type=float, default=DEFAULT_SCRATCH_BYTES / 2**20)
    args = ap.parse_args(argv)
    files = sorted(args.checkpoint.glob("*.safetensors"))
    shard_bytes = sum(f.stat().st_size for f in files)
    need = 1.15 * shard_bytes / (min(args.tp) if args.lone_rank else 1) + 2 * GB
    available = proc_bytes("/proc/meminfo", "MemAvailable") or 0
    if available < need:
        print(f"refusing: MemAvailable {available / GB:.1f} GB < {need / GB:.1f} GB "
              f"(1.15 x {shard_bytes / GB:.1f} GB of shards + 2 GB)", file=sys.stderr)
        return 2
    scratch = int(args.scratch_mb * 2**20)
    check_tokens = 16 if 16 in args.tokens else args.tokens[0]
    machine = harness.machine_record()
    memcpy = harness.memcpy_gbps()  # before any run, so that its buffers stay out of the RSS peaks
    print(f"memcpy: {memcpy:.2f} GB/s", flush=True)
    runs = [run_tp(str(args.checkpoint), files, P, args.tokens, args.reps, scratch, args.lone_rank,
                   check_tokens) for P in args.tp]
    results = {"checkpoint": str(args.checkpoint), "checkpoint_name": args.checkpoint.name,
               "shard_bytes": shard_bytes, "scratch_bytes": scratch, "memcpy_gbps": memcpy, "runs": runs,
               "tp_vs_tp1": compare_with_tp1(runs, check_tokens), "reps": args.reps}
    forward_verdicts(results)
    return harness.report(args, results, machine, markdown, index_rows, plot)


def index_rows(results: dict[str, Any]) -> list[Target]:
    """A row per verdict: each TP size's load, and each TP 1 forward that has a target."""
    rows = [target(f"load GB/s / kept sequential read, TP {run['P']} group", run["load_verdict"])
            for run in results["runs"]]
    for run in results["runs"]:
        for f in run["ranks"][0]["forward"]:
            if f.get("verdict") is not None:
                what = ("memory-bound limit / forward" if f["T"] in MEMORY_BOUND_TARGETS
                        else "forward GFLOP/s / dense GEMM's")
                rows.append(target(f"{what}, TP {run['P']}, T = {f['T']}", f["verdict"]))
    return rows


def load_table(results: dict[str, Any]) -> list[str]:
    cells = [[run["P"], rank, f"{run['sequential_read']['gbps']:.2f}", f"{reused:.2f}", f"{r['load_s']:.2f}",
              f"{r['bytes_read'] / GB:.3f}", f"{r['load_gbps']:.2f}", f"{run['group_load_gbps']:.2f}",
              pct(run["load_verdict"]["value"]), pct(run["group_load_gbps"] / reused),
              verdict_word(run["load_verdict"]["met"]), r["load_threads"], f"{r['peak_rss'] / GB:.2f}",
              f"{r['peak_rss_over_packed']:.3f}"]
             for run in results["runs"] for reused in [run["sequential_read_reused"]["gbps"]]
             for rank, r in enumerate(run["ranks"])]
    return table("TP | rank | kept read GB/s | reused read GB/s | load s | GB read | load GB/s | group GB/s "
                 "| group ÷ kept | group ÷ reused | verdict | reader threads | peak RSS GB | ÷ packed", cells)


def forward_cells(P: int, rank: int, f: dict[str, Any]) -> list[Any]:
    b, v = f["before"], f.get("verdict")
    return [P, rank, f["T"], f["active_experts"], f"{f['must_read_bytes'] / GB:.3f}",
            f"{f['memory_bound_ms']:.1f}", f"{b['ms']:.1f}", f"{f['ms']:.1f}", f"{f['ms'] / b['ms']:.2f}",
            pct(b["memory_bound_fraction"]), pct(f["memory_bound_fraction"]),
            pct(f.get("group_memory_bound_fraction")), f"{b['gflops']:.1f}", f"{f['gflops']:.1f}",
            pct(f["peak_fraction"]), pct(f.get("gemm_fraction")), f"{f['after_vs_before']:.1e}",
            "" if v is None else verdict_word(v["met"]), f"{f['loadavg'][0]:.1f}-{f['loadavg'][1]:.1f}"]


def forward_text(results: dict[str, Any]) -> list[str]:
    """The forward table with its introduction (the page says what *before*, *after* and the limit are)."""
    first, (m, k, n) = results["runs"][0]["ranks"][0], PEAK_SHAPE
    cells = [forward_cells(run["P"], rank, f) for run in results["runs"]
             for rank, r in enumerate(run["ranks"]) for f in r["forward"]]
    return ["", f"**Forward**, *before* and *after* in turns, medians of {results['reps']}; *after* on the "
            f"{first['isa']} build; bf16 GEMM peak {first['bf16_peak_gflops']:.0f} GFLOP/s (torch's "
            f"[{m}, {k}] x [{k}, {n}] bf16 GEMM, {first['gemm_engine']}, in the rank).", "", *table(
        "TP | rank | T | active | must read GB | memory-bound ms | before ms | after ms | after / before "
        "| before % of limit | after % of limit | group % of limit | before GFLOP/s | after GFLOP/s "
        "| after % of bf16 peak | % of GEMM | after vs before | verdict | load avg", cells)]


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    first = results["runs"][0]["ranks"][0]
    what = (f"checkpoint `{results['checkpoint_name']}` ({results['shard_bytes'] / GB:.2f} GB of shards), "
            f"bfloat16, experts path {first['experts_path']}; memcpy {results['memcpy_gbps']:.2f} GB/s in "
            "the same run")
    lines = [section_start(SECTION, NAME, results["argv"], results["machine"], what, json_path, png_path), "",
             "**Load** against plain sequential reads of the same files just before:", "",
             *load_table(results), *forward_text(results), "", *target_lines(index_rows(results)), "",
             "Crossovers measured in rank 0: experts " + first["experts_path"] + "; dense GEMMs "
             + "; ".join(f"{shape}: {c}" for shape, c in first["dense_crossovers"].items()) + "."]
    lines += [f"TP {c['P']} vs TP 1 at T = {c['T']}: max abs error {c['max_abs_err_vs_tp1']:.4f} (output max "
              f"{c['ref_abs_max']:.2f}): {'within' if c['ok'] else '**outside**'} the bf16 tolerance (2 % of "
              "the output scale + 0.01)." for c in results["tp_vs_tp1"]]
    if any(run["lone_rank"] for run in results["runs"]):
        lines.append("Lone-rank runs: only rank 0 ran, its collectives the identity: its timings and memory "
                     "are a rank's, its output is not the layer's.")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    fig, (a, b, c) = harness.pyplot().subplots(1, 3, figsize=(15, 4))
    runs = results["runs"]
    for run in runs:
        fw, P = run["ranks"][0]["forward"], run["P"]
        Ts = [f["T"] for f in fw]
        a.plot(Ts, [f["before"]["ms"] for f in fw], "s--", label=f"TP {P} forward before (rank 0)")
        a.plot(Ts, [f["ms"] for f in fw], "o-", label=f"TP {P} forward after (rank 0)")
        a.plot(Ts, [f["memory_bound_ms"] for f in fw], "x:", label=f"TP {P} memory-bound limit")
        c.bar([f"TP {P} r{i}" for i in range(len(run["ranks"]))],
              [r["peak_rss_over_packed"] for r in run["ranks"]])
    a.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms", title="forward, bf16")
    x, seq = range(len(runs)), [run["sequential_read"]["gbps"] for run in runs]
    b.bar([i - 0.2 for i in x], seq, 0.4, label="sequential read of the files, kept")
    load = [run["group_load_gbps"] for run in runs]
    b.bar([i + 0.2 for i in x], load, 0.4, label="load (all ranks together)")
    b.plot([i + 0.2 for i in x], [LOAD_TARGET * s for s in seq], "r_", ms=20,
           label=f"target {pct(LOAD_TARGET)}")
    b.set_xticks(list(x), [f"TP {run['P']}" for run in runs])
    b.set(ylabel="GB/s", title="load vs sequential read, same run")
    c.axhline(1.15, color="r", ls=":", label="target 1.15")
    c.set(ylabel="peak anon+shmem RSS / packed bytes read", title="load memory")
    for ax in (a, b, c):
        ax.legend(fontsize=7)
    harness.save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
