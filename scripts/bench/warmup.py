"""Warm-up: time from `serve.run` to the first answer, cold (no stored tail plan) and warm (the stored
plan reused), and from a rank's SIGKILL to the next answer; each phase deploys the same app (TP --tp,
tail auto) and sends one --tokens forward, whose answer must equal the first phase's bit for bit.

    python -m scripts.bench.warmup                                   # small preset, ~2 min
    python -m scripts.bench.warmup --checkpoint /work/ckpt/k3-1layer --dtype bfloat16 --layers 1 \\
        --max-tokens 64                                              # real size (heavy demo)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from . import harness
from .docs import Target, section_start, table, target, target_lines, verdict

APP = "warmup"
SECTION = "# Warm-up (scripts/bench/warmup.py)"
CALL_TIMEOUT_S = 600.0  # the client's bound on one call after the kill: a call reaching it hung


def deploy_and_answer(args: dict[str, Any], x: torch.Tensor, layer: int) -> dict[str, Any]:
    """Seconds from serve.run to ready and to the first answer, the plan it used, the answer."""
    from deployments.client import MoEClient

    start = time.perf_counter()
    harness.deploy(args, APP)
    ready = time.perf_counter() - start
    client = MoEClient(APP, timeout_s=3600)
    out = client.forward(x, layer)
    answered = time.perf_counter() - start
    plan = client.status()["deployments"]["moe"]["controller"]
    return {"ready_s": ready, "answered_s": answered, "plan_source": plan["plan_source"],
            "plan": plan["choice"], "out": out}


def answer_after_rank_kill(x: torch.Tensor, layer: int, deadline_s: float) -> dict[str, Any]:
    """SIGKILL rank 0 of the serving replica; seconds until a forward answers again, the calls
    that failed meanwhile (each retried after 1 s until the deadline) and the answer."""
    from deployments.client import MoEClient

    client = MoEClient(APP, timeout_s=CALL_TIMEOUT_S)
    os.kill(client.status()["deployments"]["moe"]["workers"][0]["pid"], signal.SIGKILL)
    start, failed = time.perf_counter(), []
    while time.perf_counter() - start < deadline_s:
        sent = time.perf_counter()
        try:
            out = client.forward(x, layer)
        except Exception as e:
            took = time.perf_counter() - sent
            failed.append({"s": took, "error": f"{type(e).__name__}: {str(e)[:200]}",
                           "hung": took >= CALL_TIMEOUT_S})
            time.sleep(1.0)
            continue
        plan = client.status()["deployments"]["moe"]["controller"]
        return {"answered_s": time.perf_counter() - start, "failed": failed, "out": out,
                "plan_source": plan["plan_source"]}
    raise TimeoutError(f"no answer within {deadline_s:.0f} s after the rank was killed")


def index_rows(results: dict[str, Any]) -> list[Target]:
    warm, rep = results["warm"], results["replaced"]
    return [target("warm start reuses the stored plan", warm["plan_source"] == "reused"),
            target("the replaced replica reuses it", rep["plan_source"] == "reused"),
            target("answers equal across phases", results["answers_equal"]),
            target("time to answer after a rank's SIGKILL / the warm start's",
                   verdict(rep["answered_s"] / warm["answered_s"], "<=", 1.5)),
            target("no call hung", not any(c["hung"] for c in rep["failed"]))]


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    cold, warm, rep = results["cold"], results["warm"], results["replaced"]
    failed, errors = rep["failed"], sorted({c["error"].split(":")[0] for c in rep["failed"]})
    slowest = max([0.0, *(c["s"] for c in failed)])
    what = f"checkpoint `{results['checkpoint_name']}`, TP {results['tp']}, {results['dtype']}, CPU ranks"
    seen = f"; errors the failed calls saw: {errors}." if errors else "."
    return "\n".join([
        section_start(SECTION, "warmup", results["argv"], results["machine"], what, json_path), "",
        *table("phase | plan | ready (s) | first answer (s) | / cold's", [
            *([name, p["plan_source"], f"{p['ready_s']:.1f}", f"{p['answered_s']:.1f}",
               f"{p['answered_s'] / cold['answered_s']:.2f}"]
              for name, p in (("cold: nothing stored", cold), ("warm: stored plan", warm))),
            ["rank SIGKILL -> answered again", rep["plan_source"], "", f"{rep['answered_s']:.1f} "
             f"({len(failed)} failed call(s) before, the slowest {slowest:.1f} s)",
             f"{rep['answered_s'] / cold['answered_s']:.2f}"]]), "",
        f"Measured tail plan: {cold['plan']}. Hung calls (reaching the {CALL_TIMEOUT_S:.0f} s client "
        f"timeout): {sum(c['hung'] for c in failed)}{seen}", "",
        *target_lines(index_rows(results))])


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "warmup", tp=2)
    ap.add_argument("--checkpoint", type=Path, help="default: checkpoints/small (written once)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layers", default=None, help="served layers (default: all)")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=None, help="max_tokens_per_request / max_batch_tokens")
    args = ap.parse_args(argv)
    from ray import serve

    from deployments.client import MoEClient
    from deployments.cluster import kv
    from moe_runtime.config import LatentMoEConfig
    from moe_runtime.units import torch_dtype

    ckpt = args.checkpoint or harness.preset_checkpoint("small")
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    layer = cfg.moe_layers[0] if args.layers is None else int(str(args.layers).split(",")[0].split("-")[0])
    app = {"checkpoint": str(ckpt), "tp_size": args.tp, "dtype": args.dtype, "tail": "auto",
           "accelerator": "cpu", "auto_tune_tokens": [1, 16, 128, 1024], "ingress_replicas": 1,
           **({} if args.layers is None else {"layers": args.layers}),
           **({} if args.max_tokens is None else {"max_tokens_per_request": args.max_tokens,
                                                  "max_batch_tokens": args.max_tokens})}
    x = harness.seeded_randn(args.tokens, cfg.hidden_size, seed=0, dtype=torch_dtype(args.dtype))
    machine = harness.machine_record(with_ray=True)
    with harness.local_serve(num_cpus=4):
        for key in kv.entries(kv.PLAN_PREFIX):  # cold: nothing stored
            kv.delete(key)
        cold = deploy_and_answer(app, x, layer)
        serve.delete(APP)
        warm = deploy_and_answer(app, x, layer)
        replaced = answer_after_rank_kill(x, layer, deadline_s=3600)
        outs = [phase.pop("out") for phase in (cold, warm, replaced)]
        outs.append(MoEClient(APP, timeout_s=600).forward(x, layer))
    results = {"cold": cold, "warm": warm, "replaced": replaced, "checkpoint_name": ckpt.name, "tp": args.tp,
               "dtype": args.dtype, "answers_equal": all(torch.equal(outs[0], out) for out in outs[1:])}
    return harness.report(args, results, machine, markdown, index_rows)


if __name__ == "__main__":
    raise SystemExit(main())
