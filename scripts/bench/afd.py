"""Attention-FFN disaggregation benchmark: greedy decode with the MoE layers on the tier, with
``m`` ping-pong micro-batches, next to the same model entirely in process.

One run writes the checkpoint (small preset + the decoder's tensors, ``--layers`` layers: layer 0
dense, the rest MoE), measures the in-process model (``moe_forward`` as its MoE) at each batch
size, then starts a local Ray instance serving every MoE layer on one TP-group deployment and
measures the disaggregated decoder through lanes (``RemoteMoE``'s default) at each batch size and
``m``, then -- the lane closed, as it holds the group meanwhile -- through the Serve handles
(``RemoteMoE(lane=False)``) at each batch size with ``m = 1``. Per configuration: decode
tokens/s and per-step latency (median of ``--reps`` generations after a warm-up), the time the
client spends waiting on MoE calls, the fraction of the wall time the tier's TP group is busy
(``status()`` counters: forwards x mean forward_ms, over the whole generate call), and whether
every generation's tokens equal the in-process model's.

    python -m scripts.bench.afd                 # a few minutes on 2 cores
    python -m scripts.bench.afd --quick         # tiny preset, fewer tokens (smoke run)

Targets: through lanes at m = 1, >= 1.0x the in-process tokens/s at every batch size; m = 2
reaches >= 1.5x the tokens/s of m = 1 at batch 32. Results: JSON + PNG under --out, its page,
docs/benchmarks/afd.md, and its rows of the index (--docs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from examples.afd import Decoder, LocalMoE, MoELayers, RemoteMoE, tier_busy

from . import harness
from .docs import Target, commentary, section_start, target, verdict, verdict_word, write_results, yes_no

APP = "afd_bench"
DEPLOYMENT = "moe"
SECTION = "# Attention-FFN disaggregation (scripts/bench/afd.py)"
# Prose below that no run recomputes, and the run it was written for.
COMMENTARY_RUN = "2026-12-03 01:17 UTC (small preset, 2 CPUs, load 10.8-22.3)"
REMEDY = ("What stopped it in that run was CPU: the client's attention and the ranks shared the same "
          "cores, with other work on them. Ping-pong hides waiting, not work: with no idle CPU to fill "
          "it frees nothing. What it would take: attention and MoE on separate hardware (the case "
          "AFD is for), a per-forward fixed cost small next to the per-token work (the replica -> ranks "
          "hop), and batches large enough that a forward of B/m tokens costs about 1/m of one of B.")


class TimedMoE:
    """Wraps an :class:`MoELayers` and adds up the wall time spent awaiting its calls (with
    several micro-batches in flight these waits overlap, so the sum can exceed the wall time)."""

    def __init__(self, inner: MoELayers):
        self.inner, self.layers = inner, inner.layers
        self.wait_s, self.calls = 0.0, 0

    async def __call__(self, x_TH: torch.Tensor, layer: int) -> torch.Tensor:
        start = time.perf_counter()
        out = await self.inner(x_TH, layer)
        self.wait_s += time.perf_counter() - start
        self.calls += 1
        return out


def tier_status(tier: RemoteMoE, settle_s: float = 30.0) -> dict[str, Any]:
    """The deployment's ``status()`` once its counters hold every call of this client's lane: the
    replica reads a lane's counters from its ranks every 0.25 s (``serve.lanes``), so a read
    right after the calls can miss the last ones (waits at most ``settle_s``)."""
    deadline = time.monotonic() + settle_s
    while True:
        status = tier.deployment_statuses()[DEPLOYMENT]
        lane_calls = tier.lane.status()["deployments"][DEPLOYMENT]["lane_calls"] if tier.lane else 0
        if status["counters"]["lane"]["requests"] >= lane_calls or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(vocab, (batch, length), generator=gen).tolist()


def measure(model: Decoder, moe: TimedMoE, batch: int, m: int, args: argparse.Namespace,
            tier: RemoteMoE | None = None, reference: torch.Tensor | None = None
            ) -> tuple[dict[str, Any], torch.Tensor]:
    """The row of (batch, m) and the tokens generated; with ``reference`` (the in-process tokens)
    the row says whether every generation equalled it."""
    prompts = prompts_for(batch, args.prompt_len, model.cfg.vocab_size)
    model.generate(prompts, 2, m)  # warm-up: first calls, allocator, thread pools
    runs, identical = [], True
    for _ in range(args.reps):
        moe.wait_s, moe.calls = 0.0, 0
        before = tier_status(tier) if tier else None
        cpu = time.process_time()
        out = model.generate(prompts, args.tokens, m)
        identical &= reference is None or torch.equal(out.tokens, reference)
        wall = out.prefill_s + out.decode_s
        run = {"decode_s": out.decode_s, "prefill_s": out.prefill_s, "moe_wait_s": moe.wait_s,
               "moe_calls": moe.calls, "cpu_s": time.process_time() - cpu}
        if tier:
            forwards, busy_s = tier_busy(before, tier_status(tier))
            run.update(tier_forwards=forwards, tier_busy_s=busy_s, tier_busy_frac=busy_s / wall)
        runs.append(run)
    best = sorted(runs, key=lambda r: r["decode_s"])[len(runs) // 2]  # the median run
    steps = args.tokens - 1
    row = {
        "batch": batch, "m": m,
        "tokens_per_s": round(batch * steps / best["decode_s"], 1),
        "step_ms": round(best["decode_s"] / steps * 1e3, 2),
        "step_ms_all": [round(r["decode_s"] / steps * 1e3, 2) for r in runs],
        "moe_wait_ms_per_step": round(best["moe_wait_s"] / (steps + 1) * 1e3, 2),
        # this process's CPU time (attention, LM head, and on the tier path Serve's client side)
        "client_cpu_ms_per_step": round(best["cpu_s"] / (steps + 1) * 1e3, 2),
    }
    if tier:
        row["tier_busy_frac"] = round(best["tier_busy_frac"], 3)
        row["tier_forward_ms"] = round(best["tier_busy_s"] / max(1, best["tier_forwards"]) * 1e3, 2)
        row["tier_forwards_per_step"] = round(best["tier_forwards"] / (steps + 1), 2)
    if reference is not None:
        row["tokens_identical"] = identical
    print(json.dumps(row), flush=True)
    return row, out.tokens


def call_ms(moe: MoELayers, hidden: int, layer: int, sizes: list[int], reps: int,
            tier: RemoteMoE | None = None) -> dict[int, dict[str, float]]:
    """Per token count T: median ms of one MoE call awaited alone (in process: the forward; on
    the tier: the round trip) and, on the tier, the group's own forward ms from ``status()``.
    A batch of B in m micro-batches makes m calls of B/m tokens per layer, and a TP group runs
    one forward at a time, so these bound what ping-pong can win."""
    loop = asyncio.new_event_loop()
    out = {}
    try:
        for T in sizes:
            x = harness.seeded_randn(T, hidden, seed=T)
            loop.run_until_complete(moe(x, layer))  # warm-up
            before = tier_status(tier) if tier else None
            timed = harness.time_calls(lambda x=x: loop.run_until_complete(moe(x, layer)), reps, warmup=0)
            row = {"call_ms": round(statistics.median(timed.seconds) * 1e3, 2)}
            if tier:
                forwards, busy_s = tier_busy(before, tier_status(tier))
                row["forward_ms"] = round(busy_s / forwards * 1e3, 2)
            out[T] = row
    finally:
        loop.close()
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    fig, (ax1, ax2) = harness.pyplot().subplots(1, 2, figsize=(11, 4))
    series: dict[str, list[dict]] = {"in process": results["inprocess"]}
    for row in results["tier"]:
        series.setdefault(f"lane, m={row['m']}", []).append(row)
    series["Serve handles, m=1"] = results["tier_serve"]
    for name, rows in series.items():
        style = "k--" if name == "in process" else "o-"
        ax1.plot([r["batch"] for r in rows], [r["tokens_per_s"] for r in rows], style, label=name)
        ax2.plot([r["batch"] for r in rows], [r["step_ms"] for r in rows], style, label=name)
    for ax, label in ((ax1, "decode tokens/s"), (ax2, "ms per decode step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.suptitle(f"AFD decode, {results['env']['preset']} preset, {results['env']['moe_layers']} MoE layers "
                 f"on a TP-{results['env']['tp_size']} group")
    harness.save_figure(fig, path, dpi=120)


def index_rows(results: dict[str, Any]) -> list[Target]:
    s = results["summary"]
    return [target("tokens/s at m = 2 / m = 1, batch 32", s["target"]),
            target("lane / in-process tokens/s at m = 1, slowest batch", s["lane_target"]),
            target("generated tokens equal the in-process model's", s["tokens_identical"])]


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    env = results["env"]
    local = {r["batch"]: r for r in results["inprocess"]}
    lines = [
        section_start(
            SECTION, "afd", results["argv"], env,
            f"{env['preset']} preset, H = {env['hidden_size']}, {env['moe_layers']} MoE layers on "
            f"one TP-{env['tp_size']} deployment, {env['tail']} tail, float32; prompts of "
            f"{env['prompt_len']} tokens, {env['tokens']} new tokens; median of {env['reps']}; "
            f"{env['torch_threads']} torch thread(s) in this process, in process and as the AFD "
            "client", json_path, png_path),
        "",
        "Paths: in process (`LocalMoE`), lane (the tier through a lane: `RemoteMoE`'s default, every m), "
        "Serve handles (the tier through `RemoteMoE(lane=False)`, m = 1; run after the lane closed, as a "
        "lane holds the group while open).",
        "",
        "| batch | path | m | tokens/s | ms / step | vs in process | vs m = 1 | tokens = in process "
        "| client waits on MoE, ms / step | client CPU ms / step | tier busy | tier forward ms "
        "| forwards / step |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results["inprocess"]:
        lines.append(f"| {r['batch']} | in process | 1 | {r['tokens_per_s']} | {r['step_ms']} | 1.00 | | "
                     f"(reference) | {r['moe_wait_ms_per_step']} (MoE compute) | "
                     f"{r['client_cpu_ms_per_step']} | | | |")
    base = {r["batch"]: r for r in results["tier"] if r["m"] == 1}
    for path, rows in (("lane", results["tier"]), ("Serve handles", results["tier_serve"])):
        for r in rows:
            vs_m1 = f"{r['tokens_per_s'] / base[r['batch']]['tokens_per_s']:.2f}" if path == "lane" else ""
            lines.append(
                f"| {r['batch']} | {path} | {r['m']} | {r['tokens_per_s']} | {r['step_ms']} | "
                f"{r['tokens_per_s'] / local[r['batch']]['tokens_per_s']:.2f} | {vs_m1} | "
                f"{yes_no(r['tokens_identical'])} | {r['moe_wait_ms_per_step']} | "
                f"{r['client_cpu_ms_per_step']} | "
                f"{r['tier_busy_frac']:.0%} | {r['tier_forward_ms']} | {r['tier_forwards_per_step']} |"
            )
    s = results["summary"]
    lines += [
        "",
        "tier busy = forwards x mean `forward_ms` / wall time of the generate call, from the "
        "deployment's `status()` counters; the replica times each group call from its start to its "
        "answer, so with m > 1 the calls of two micro-batches at different layers overlap (the second "
        "waits for the group's lock) and the sum can pass 100%. client waits on MoE: the wall time the "
        "decoder spends awaiting MoE calls per step, summed over micro-batches (overlapping).",
        "",
        f"Disaggregation cost per MoE layer at m = 1, from whole steps (tier step − in-process step) / "
        f"{env['moe_layers']}: " + "; ".join(
            f"{name}: " + ", ".join(f"batch {b}: {c} ms" for b, c in s["cost_per_layer_ms"][path].items())
            for name, path in (("lane", "tier"), ("Serve handles", "tier_serve")))
        + "; from single calls through the lane (round trip − in-process forward): "
        + ", ".join(f"T = {t}: {r['call_ms'] - results['moe_call_ms'][t]['call_ms']:.1f} ms"
                    for t, r in results["tier_call_ms"].items()) + ".",
        "One MoE call of T tokens awaited alone, median ms (a batch of B in m micro-batches makes m "
        "calls of B/m tokens per layer): "
        + ", ".join(f"T = {t}: in process {results['moe_call_ms'][t]['call_ms']}, lane round trip "
                    f"{r['call_ms']} (group forward {r['forward_ms']})"
                    for t, r in results["tier_call_ms"].items()) + ".",
        "Ping-pong bound (the group runs one forward at a time, so a step takes at least m x layers "
        "group forwards of B/m tokens): tokens/s of m over m = 1 at most "
        + ", ".join(f"batch {k.replace('/', ', m = ')}: {v}x" for k, v in s["pingpong_bound"].items()) + ".",
        f"Target m = 2 ≥ 1.5× m = 1 at batch 32: measured {s['m2_over_m1_at_32']}× "
        f"({verdict_word(s['target']['met'])}).",
        "Target lane ≥ 1.0× the in-process tokens/s at m = 1, every batch: measured "
        + ", ".join(f"batch {b}: {v}×" for b, v in s["lane_over_inprocess"].items())
        + f" ({verdict_word(s['lane_target']['met'])}; the Serve handles: "
        + ", ".join(f"batch {r['batch']}: {r['tokens_per_s'] / local[r['batch']]['tokens_per_s']:.2f}×"
                    for r in results["tier_serve"]) + ").",
        "Generated tokens equal the in-process model's in every tier generation (lane and Serve handles, "
        f"every batch and m, every rep): {yes_no(s['tokens_identical'])}. Every lane call on "
        f"the lane (none on the Serve path; `Lane.status()`): {yes_no(s['lane_on_lane'])}.",
    ]
    rows = {(r["batch"], r["m"]): r for r in results["tier"]}
    if s["target"]["met"] is False and (32, 1) in rows and (32, 2) in rows:
        lines += ["", why_not(results, rows[(32, 1)], rows[(32, 2)]), "", commentary(COMMENTARY_RUN, REMEDY)]
    return "\n".join(lines)


def why_not(results: dict[str, Any], one: dict[str, Any], two: dict[str, Any]) -> str:
    """The missed target, from this run's numbers only: what the group's serial order would allow,
    what the group, the tier and the client did instead, and the CPUs they shared."""
    env, s, calls, half = results["env"], results["summary"], results["tier_call_ms"], 16
    bound = s["pingpong_bound"].get("32/2")
    text = (f"Why not, at batch 32 (computed from this run): the group's serial order alone would allow "
            f"{bound}x (a {half}-token forward alone: {calls[half]['forward_ms']} ms); measured "
            f"{s['m2_over_m1_at_32']}x. At m = 2 the group's forwards (timed by the replica, with the wait "
            f"for the group's lock) took {two['tier_forward_ms']} ms each, {two['tier_forwards_per_step']} "
            f"per step, against {one['tier_forward_ms']} ms x {one['tier_forwards_per_step']} at m = 1 "
            f"({two['tier_forward_ms'] / one['tier_forward_ms']:.2f}x per forward); the tier went from "
            f"{one['tier_busy_frac']:.0%} to {two['tier_busy_frac']:.0%} busy, and the client's CPU per step "
            f"from {one['client_cpu_ms_per_step']} to {two['client_cpu_ms_per_step']} ms. ")
    text += (f"The {env['tp_size']} TP ranks, the replica and the client shared this machine's "
             f"{env['cpus']} CPUs.")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "afd", quick="tiny preset, 6 tokens, 1 rep")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=4, help="num_hidden_layers (layer 0 dense, the rest MoE)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tail", default="sharded")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--micro-batches", default="1,2,4")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=17, help="new tokens per sequence (the first from prefill)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of this process (the in-process model and the AFD client alike; "
                         "on the busy 2-core machine, 2 threads took the in-process batch-1 step from "
                         "157 to 2069 ms in one run: OpenMP threads spinning against other work)")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.layers, args.tokens, args.reps = "tiny", 3, 6, 1
    batches = [int(b) for b in args.batches.split(",")]
    micro = [int(m) for m in args.micro_batches.split(",")]
    ckpt = harness.preset_checkpoint(args.preset, args.layers, decoder=True)
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)

    sizes = sorted({max(1, b // m) for b in batches for m in micro})
    local_moe = TimedMoE(LocalMoE(ckpt))
    local = Decoder(ckpt, local_moe)
    cfg = local.cfg.moe
    results: dict[str, Any] = {
        "argv": args.argv,
        "env": harness.machine_record(
            with_ray=True, preset=args.preset, hidden_size=cfg.hidden_size, moe_layers=len(cfg.moe_layers),
            tp_size=args.tp, tail=args.tail, prompt_len=args.prompt_len, tokens=args.tokens, reps=args.reps,
            torch_threads=args.threads),
        "inprocess": [],
        "moe_call_ms": call_ms(local_moe.inner, cfg.hidden_size, cfg.moe_layers[0], sizes, args.reps * 3),
        "tier": [],  # through lanes (RemoteMoE's default), every m
        "tier_serve": [],  # through the Serve handles, m = 1
    }
    reference = {}  # batch -> the in-process tokens, which every tier generation must equal
    for b in batches:
        row, reference[b] = measure(local, local_moe, b, 1, args)
        results["inprocess"].append(row)
    del local, local_moe  # free the in-process MoE weights before the tier loads its own
    deployment = {"name": DEPLOYMENT, "tp_size": args.tp, "tail": args.tail, "dtype": "float32",
                  "batch_wait_timeout_s": 0.0, "max_batch_tokens": 4096, "replica_cpus": 0.5}
    with harness.local_app(ckpt, APP, [deployment], num_cpus=4, num_gpus=args.tp):
        # The lane holds the group while open (the Serve path waits), so the two run one after the other.
        with RemoteMoE.connect(APP) as tier:
            moe = TimedMoE(tier)
            results["tier_call_ms"] = call_ms(tier, cfg.hidden_size, cfg.moe_layers[0], sizes,
                                              args.reps * 3, tier)
            model = Decoder(ckpt, moe)
            for b in batches:
                for m in micro:
                    if m <= b:
                        results["tier"].append(measure(model, moe, b, m, args, tier, reference[b])[0])
            results["lane_status"] = tier.lane.status()
        with RemoteMoE.connect(APP, lane=False) as tier:
            moe = TimedMoE(tier)
            model = Decoder(ckpt, moe)
            results["tier_serve"] = [measure(model, moe, b, 1, args, tier, reference[b])[0] for b in batches]
    results["env"]["loadavg_after"] = harness.loadavg()
    local_rows = {r["batch"]: r for r in results["inprocess"]}
    layers = len(cfg.moe_layers)
    tps = {(r["batch"], r["m"]): r["tokens_per_s"] for r in results["tier"]}
    tier_m1 = {r["batch"]: r for r in results["tier"] if r["m"] == 1}
    lane_over_local = {b: round(r["tokens_per_s"] / local_rows[b]["tokens_per_s"], 2)
                       for b, r in tier_m1.items()}
    # Calls the lane sent down the Serve path (no group leased, or a failed call) measure no lane.
    on_lane = all(g["serve_calls"] == 0 for g in results["lane_status"]["deployments"].values())
    lane_target = verdict(min(lane_over_local.values(), default=None), ">=", 1.0)
    lane_target["met"] = lane_target["met"] and on_lane
    ratio = round(tps[(32, 2)] / tps[(32, 1)], 2) if (32, 2) in tps and (32, 1) in tps else None
    target = verdict(ratio, ">=", 1.5)
    results["summary"] = {
        "cost_per_layer_ms": {
            path: {r["batch"]: round((r["step_ms"] - local_rows[r["batch"]]["step_ms"]) / layers, 2)
                   for r in results[path] if r["m"] == 1}
            for path in ("tier", "tier_serve")
        },
        # The group runs one forward at a time: m micro-batches need m x layers forwards of B/m
        # tokens per step, so the step cannot beat that sum (the ping-pong bound).
        "pingpong_bound": {
            f"{r['batch']}/{r['m']}": round(tier_m1[r["batch"]]["step_ms"] / (r["m"] * layers
                                            * results["tier_call_ms"][r["batch"] // r["m"]]["forward_ms"]), 2)
            for r in results["tier"] if r["m"] > 1
        },
        "m2_over_m1_at_32": ratio,
        "target": target,
        "target_met": target["met"],
        "lane_over_inprocess": lane_over_local,
        "lane_on_lane": on_lane,
        "lane_target": lane_target,  # the slowest batch size decides
        "tokens_identical": all(r["tokens_identical"] for r in results["tier"] + results["tier_serve"]),
    }
    write_results(results, args.out, "afd", plot, markdown, index_rows, args.docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
