"""Real-size benchmark: one Kimi-K3 MoE layer (MXFP4 experts held packed) at TP 1 and 2, bf16.

Per TP size, side by side in one run: peak RSS per rank (anonymous + shared memory, sampled
from /proc; page cache of the mmapped checkpoint is reclaimable and not counted) divided by the
packed bytes that rank read, load seconds and GB/s read, forward ms and tokens/s at T = 1, 16,
128, and the MXFP4 decode cost per forward (the active experts of that batch, timed alone)
with its throughput divided by this machine's memcpy bandwidth, measured in the same run, and
each forward's memory-bound limit (bytes it must read: active experts packed + every dense
tensor, over that memcpy bandwidth) and the fraction of it reached (issue 17 targets >= 25 %).
The TP 2 output is checked against the TP 1 output within bf16 tolerance.

    python scripts/make_checkpoint.py --preset kimi-k3 --mxfp4 --moe-layers 1 --out /work/ckpt/k3-1layer
    python scripts/bench_real.py --checkpoint /work/ckpt/k3-1layer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from moe_runtime.cli import process_rss  # noqa: E402
from moe_runtime.config import LatentMoEConfig  # noqa: E402
from moe_runtime.experts import DEFAULT_SCRATCH_BYTES  # noqa: E402
from moe_runtime.router import route  # noqa: E402
from moe_runtime.tp.collectives import Collectives  # noqa: E402  (the rank's type)
from moe_runtime.tp.local_group import run_local_group  # noqa: E402
from moe_runtime.tp.plan import resolve_tail  # noqa: E402
from moe_runtime.tp.runner import build_rank_runners  # noqa: E402

LAYER = 1
GB = 1e9


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # the thread or process is gone
            kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


class TreeSampler:
    """Samples anon + shmem RSS of this process and its descendants every ``period`` s."""

    def __init__(self, period: float = 0.1):
        self.period, self.peak_by_pid, self.peak_total = period, {}, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pids, todo = [], [os.getpid()]
            while todo:
                pid = todo.pop()
                pids.append(pid)
                todo += _children(pid)
            total = 0
            for pid in pids:
                r = process_rss(pid)
                mine = r["anon"] + r["shmem"]
                total += mine
                self.peak_by_pid[pid] = max(self.peak_by_pid.get(pid, 0), mine)
            self.peak_total = max(self.peak_total, total)
            time.sleep(self.period)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def memcpy_gbps(nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Best-of-``reps`` bytes copied per second between two buffers."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / GB


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


def _input(T: int, H: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)


def _rank(
    comm: Collectives, ckpt: str, tokens: list[int], reps: int, scratch_bytes: int, decode_sample: int
) -> dict:
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    plan = resolve_tail("auto", cfg, comm.world)
    runner = build_rank_runners(
        ckpt, cfg, [LAYER], comm, plan, dtype=torch.bfloat16, scratch_bytes=scratch_bytes,
        progress=comm.rank == 0 and sys.stderr.isatty(),
    )[LAYER]
    res = {
        "pid": os.getpid(),
        "load_s": runner.load_s,
        "bytes_read": runner.load_bytes_read,
        "resident_by_part": runner.resident_bytes_by_part(),
        "rss_after_load": process_rss(),
        "tail_plan": plan.describe(),
        "experts_path": f"{runner.experts_path} ({runner.experts_path_reason})",
        "forward": {},
    }
    parts = runner.resident_bytes_by_part()
    dense_bytes = sum(v for k, v in parts.items() if k != "experts_packed")
    packed_per_expert = parts["experts_packed"] // runner.w.experts.num_experts
    ex = runner.w.experts
    per_chunk = max(1, scratch_bytes // ex.decoded_bytes_per_expert())
    decoded_bytes_per_expert = 3 * ex.intermediate_size * ex.latent_size * 2  # bf16 w13 + w2
    with torch.inference_mode():
        for T in tokens:
            x = _input(T, cfg.hidden_size)
            times, load0 = [], os.getloadavg()
            for _ in range(reps):
                start = time.perf_counter()
                out = runner.forward(x)
                times.append(time.perf_counter() - start)
            ids, _ = route(x, runner.w.gate_EH, runner.w.bias_E, cfg)
            active = torch.unique(ids)
            # Decode cost per forward: the batch's active experts decoded alone, in the backend's
            # chunks; beyond ``decode_sample`` experts the per-expert time is extrapolated.
            sample = active[:decode_sample]
            start = time.perf_counter()
            for first in range(0, len(sample), per_chunk):
                ex.decode(sample[first : first + per_chunk])
            decode_s = (time.perf_counter() - start) * len(active) / len(sample)
            res["forward"][T] = {
                "ms": min(times) * 1e3,
                "first_ms": times[0] * 1e3,
                "loadavg": [load0[0], os.getloadavg()[0]],
                # what this forward must read at least: the active experts' packed bytes and every
                # dense tensor (shared experts, projections, router) once
                "must_read_bytes": len(active) * packed_per_expert + dense_bytes,
                "active_experts": len(active),
                "decode_sampled_experts": len(sample),
                "decode_ms": decode_s * 1e3,
                "decode_gbps": len(active) * decoded_bytes_per_expert / decode_s / GB,
                "out": out if T == tokens[0] or T == 16 else None,
            }
    return res


def run_tp(
    ckpt: str, P: int, tokens: list[int], reps: int, scratch_bytes: int, decode_sample: int, lone: bool
) -> dict:
    args = (ckpt, tokens, reps, scratch_bytes, decode_sample)
    with TreeSampler() as sampler:
        start = time.perf_counter()
        # TP 1 too runs in a spawned rank: this process's sampler thread would otherwise
        # contend with torch's OpenMP threads (tens of times slower on 2 cores)
        if lone:
            results = run_local_group(1, _lone_rank, P, *args, timeout_s=7200.0)
        else:
            results = run_local_group(P, _rank, *args, timeout_s=7200.0, collective_timeout_s=1800.0)
        wall_s = time.perf_counter() - start
    for r in results:
        r["peak_rss"] = sampler.peak_by_pid.get(r["pid"], 0)
        r["peak_rss_over_packed"] = r["peak_rss"] / r["bytes_read"]
    peak_tree = sampler.peak_total
    return {"P": P, "lone_rank": lone, "wall_s": wall_s, "peak_tree_rss": peak_tree, "ranks": results}


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--lone-rank", action="store_true",
        help="run only rank 0 of each TP size (identity collectives): per-rank memory and compute "
        "when the machine cannot hold every rank",
    )
    ap.add_argument("--decode-sample", type=int, default=8, help="experts decoded to time decoding")
    ap.add_argument("--scratch-mb", type=float, default=DEFAULT_SCRATCH_BYTES / 2**20)
    ap.add_argument("--out", type=Path, default=Path("artifacts/bench_real"))
    args = ap.parse_args(argv)
    ckpt = str(args.checkpoint)
    shard_bytes = sum(f.stat().st_size for f in args.checkpoint.glob("*.safetensors"))
    need = 1.15 * shard_bytes / (min(args.tp) if args.lone_rank else 1) + 2 * GB
    if _mem_available() < need:
        print(f"refusing: MemAvailable {_mem_available() / GB:.1f} GB < {need / GB:.1f} GB "
              f"(1.15 x {shard_bytes / GB:.1f} GB of shards + 2 GB)", file=sys.stderr)
        return 2
    scratch = int(args.scratch_mb * 2**20)
    # measured before any run so its buffers stay out of the RSS peaks
    memcpy = memcpy_gbps()
    print(f"memcpy: {memcpy:.2f} GB/s", flush=True)
    runs = {}
    for P in args.tp:
        print(f"TP {P}: loading and running ...", flush=True)
        runs[P] = run_tp(ckpt, P, args.tokens, args.reps, scratch, args.decode_sample, args.lone_rank)
        for rank, r in enumerate(runs[P]["ranks"]):
            print(f"  rank {rank}: load {r['load_s']:.1f} s, read {r['bytes_read'] / GB:.2f} GB, "
                  f"peak RSS {r['peak_rss'] / GB:.2f} GB = {r['peak_rss_over_packed']:.3f} x packed")
    check = {}
    if 1 in runs and len(runs) > 1 and not args.lone_rank:
        ref = runs[1]["ranks"][0]["forward"][16]["out"].float()
        for P, run in runs.items():
            got = run["ranks"][0]["forward"][16]["out"].float()
            err = (got - ref).abs().max().item()
            # bf16 output of sums over 16 experts + 2 shared: TP changes the fp32 summation order
            # and where bf16 rounding happens; a few bf16 ulps of the output scale
            check[P] = {"max_abs_err_vs_tp1": err, "ref_abs_max": ref.abs().max().item(),
                        "ok": err <= 0.02 * ref.abs().max().item() + 1e-2}
    for run in runs.values():
        for r in run["ranks"]:
            for f in r["forward"].values():
                f.pop("out")
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "checkpoint": ckpt,
        "shard_bytes": shard_bytes,
        "scratch_bytes": scratch,
        "memcpy_gbps": memcpy,
        "runs": runs,
        "tp_vs_tp1": check,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    _plot(report, args.out.with_suffix(".png"))
    _table(report)
    return 0


def _table(report: dict) -> None:
    print("| TP | rank | load s | GB read | GB/s | peak RSS GB | ÷ packed | T | fwd ms | tok/s "
          "| active | decode ms | decode GB/s | ÷ memcpy | must read GB | memory-bound ms | % of limit "
          "| load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for P, run in report["runs"].items():
        for rank, r in enumerate(run["ranks"]):
            for T, f in r["forward"].items():
                print(f"| {P} | {rank} | {r['load_s']:.1f} | {r['bytes_read'] / GB:.2f} | "
                      f"{r['bytes_read'] / GB / r['load_s']:.2f} | {r['peak_rss'] / GB:.2f} | "
                      f"{r['peak_rss_over_packed']:.3f} | {T} | {f['ms']:.0f} | "
                      f"{int(T) / f['ms'] * 1e3:.1f} | "
                      f"{f['active_experts']} | {f['decode_ms']:.0f} | {f['decode_gbps']:.2f} | "
                      f"{f['decode_gbps'] / report['memcpy_gbps']:.3f} | {f['must_read_bytes'] / GB:.3f} | "
                      f"{limit_ms(f, report):.1f} | {100 * limit_ms(f, report) / f['ms']:.1f}% | "
                      f"{f['loadavg'][0]:.1f}-{f['loadavg'][1]:.1f} |")


def limit_ms(f: dict, report: dict) -> float:
    """The forward's memory-bound limit: bytes it must read / memcpy bandwidth of the same run."""
    return f["must_read_bytes"] / GB / report["memcpy_gbps"] * 1e3


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for P, run in report["runs"].items():
        fw = run["ranks"][0]["forward"]
        Ts = [int(T) for T in fw]
        a.plot(Ts, [f["ms"] for f in fw.values()], "o-", label=f"TP {P} forward")
        a.plot(Ts, [f["decode_ms"] for f in fw.values()], "x--", label=f"TP {P} decode (rank 0)")
        b.bar([f"TP {P} r{i}" for i in range(len(run["ranks"]))],
              [r["peak_rss_over_packed"] for r in run["ranks"]])
    a.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms", title="real-size K3 layer, bf16")
    a.legend()
    b.axhline(1.15, color="r", ls=":", label="target 1.15")
    b.set(ylabel="peak anon+shmem RSS / packed bytes read", title="load memory")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
