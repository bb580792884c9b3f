"""Warm-up: time from `serve.run` to the first answer, cold (no stored tail plan) and warm (the
plan measured by an earlier replica reused), and from a rank's SIGKILL to the next answer (the
replaced replica reuses the plan). One run, one local Ray instance, CPU ranks.

    python -m scripts.bench.warmup                                   # small preset, ~2 min
    python -m scripts.bench.warmup --checkpoint /work/ckpt/k3-1layer --dtype bfloat16 --layers 1 \\
        --max-tokens 64                                              # real size (heavy demo)

Each phase deploys the same app (TP --tp, tail auto, ``auto_tune_tokens`` 1,16,128,1024, the
default ``warmup_limit_s``) and sends one --tokens forward; it checks that the answer equals the
first phase's bit for bit.
Target: warm start <= cold start - the cold measurement's time (nothing measured again), and a
replaced replica answers again without measuring (plan_source: reused). After the rank's SIGKILL:
answered again within 1.5x the warm start (a load without measuring; the cold
ratio is printed too), no call hung (each call's seconds are recorded; a call that ran into the
client's timeout counts as hung), no answer wrong (every answer equals the cold one).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from . import harness
from .docs import Target, section_start, target, verdict, verdict_word

APP = "warmup"
SECTION = "# Warm-up (scripts/bench/warmup.py)"


def deploy_and_answer(args: dict[str, Any], x: torch.Tensor, layer: int) -> tuple[float, float, Any, dict]:
    """Seconds from serve.run to ready and to the first answer, the answer, and the status."""
    from deployments.client import MoEClient

    start = time.perf_counter()
    harness.deploy(args, APP)
    ready = time.perf_counter() - start
    client = MoEClient(APP, timeout_s=3600)
    out = client.forward(x, layer)
    answered = time.perf_counter() - start
    return ready, answered, out, client.status()


CALL_TIMEOUT_S = 600.0  # the client's bound on one call after the kill: a call reaching it hung


def answer_after_rank_kill(x: torch.Tensor, layer: int, deadline_s: float) -> dict[str, Any]:
    """SIGKILL rank 0 of the serving replica; seconds until a forward answers again, the calls
    that failed meanwhile (each retried after 1 s until the deadline) with their seconds and
    errors, and the answer."""
    from deployments.client import MoEClient

    client = MoEClient(APP, timeout_s=CALL_TIMEOUT_S)
    pid = client.status()["deployments"]["moe"]["workers"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
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
        return {"answered_s": time.perf_counter() - start, "failed": failed, "out": out,
                "status": client.status()}
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
    reuse, reuse_after, equal, restart, none_hung = (verdict_word(t.met) for t in index_rows(results))
    slowest = max((c["s"] for c in rep["failed"]), default=0.0)
    lines = [
        section_start(
            SECTION, "warmup", results["argv"], results["machine"],
            f"checkpoint `{results['checkpoint_name']}`, TP {results['tp']}, {results['dtype']}, "
            "CPU ranks", json_path), "",
        "| phase | plan | ready (s) | first answer (s) |", "|---|---|---|---|",
        f"| cold: nothing stored | {cold['plan_source']} | {cold['ready_s']:.1f} "
        f"| {cold['answered_s']:.1f} |",
        f"| warm: stored plan | {warm['plan_source']} | {warm['ready_s']:.1f} | {warm['answered_s']:.1f} |",
        f"| rank SIGKILL -> answered again | {rep['plan_source']} | | {rep['answered_s']:.1f} "
        f"({len(rep['failed'])} failed call(s) before, the slowest {slowest:.1f} s) |", "",
        f"Measured tail plan: {cold['plan']}. Warm start saves "
        f"{cold['answered_s'] - warm['answered_s']:.1f} s "
        f"({warm['answered_s'] / cold['answered_s']:.2f} x the cold time). "
        f"Verdicts: warm start reuses the plan — {reuse}; the replaced replica reuses it — {reuse_after}; "
        f"answers equal across phases — {equal}.",
        "",
        f"Restart: answered again {rep['answered_s']:.1f} s after the SIGKILL = "
        f"{rep['answered_s'] / warm['answered_s']:.2f} x the warm start "
        f"({rep['answered_s'] / cold['answered_s']:.2f} x the cold one), target <= 1.5 x — {restart}; hung "
        f"calls (reaching the {CALL_TIMEOUT_S:.0f} s client timeout): "
        f"{sum(c['hung'] for c in rep['failed'])} — {none_hung}; wrong answers: "
        f"{0 if results['answers_equal'] else 'some'} — {equal}."
        + (f" Errors the failed calls saw: {sorted({c['error'].split(':')[0] for c in rep['failed']})}."
           if rep["failed"] else ""),
    ]
    return "\n".join(lines)


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

    ckpt = args.checkpoint or harness.preset_checkpoint("small")
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    layer = cfg.moe_layers[0] if args.layers is None else int(str(args.layers).split(",")[0].split("-")[0])
    app = {"checkpoint": str(ckpt), "tp_size": args.tp, "dtype": args.dtype, "tail": "auto",
           "accelerator": "cpu", "auto_tune_tokens": [1, 16, 128, 1024], "ingress_replicas": 1}
    if args.layers is not None:
        app["layers"] = args.layers
    if args.max_tokens is not None:
        app.update(max_tokens_per_request=args.max_tokens, max_batch_tokens=args.max_tokens)
    x = harness.seeded_randn(args.tokens, cfg.hidden_size, seed=0,
                     dtype=torch.float32 if args.dtype == "float32" else torch.bfloat16)
    machine = harness.machine_record(with_ray=True)
    with harness.local_serve(num_cpus=4):
        for key in kv.entries(kv.PLAN_PREFIX):  # cold: nothing stored
            kv.delete(key)
        phases: dict[str, Any] = {}
        ready, answered, cold_out, status = deploy_and_answer(app, x, layer)
        ctl = status["deployments"]["moe"]["controller"]
        phases["cold"] = {"ready_s": ready, "answered_s": answered, "plan_source": ctl["plan_source"],
                          "plan": ctl["choice"]}
        serve.delete(APP)
        ready, answered, warm_out, status = deploy_and_answer(app, x, layer)
        phases["warm"] = {"ready_s": ready, "answered_s": answered,
                          "plan_source": status["deployments"]["moe"]["controller"]["plan_source"]}
        kill = answer_after_rank_kill(x, layer, deadline_s=3600)
        ctl = kill["status"]["deployments"]["moe"]["controller"]
        phases["replaced"] = {"answered_s": kill["answered_s"], "failed": kill["failed"],
                              "plan_source": ctl["plan_source"]}
        replaced_out = MoEClient(APP, timeout_s=600).forward(x, layer)
    results = {
        **phases, "checkpoint_name": ckpt.name, "tp": args.tp, "dtype": args.dtype,
        "answers_equal": all(torch.equal(cold_out, out) for out in (warm_out, kill["out"], replaced_out)),
    }
    return harness.report(args, results, machine, markdown, index_rows)


if __name__ == "__main__":
    raise SystemExit(main())
