"""The vLLM plugin under CUDA graphs on one GPU: scripts/gpu_check.sh's ``vllm_graphs`` stage.

    python -m scripts.bench.vllm_graphs_gpu --out DIR [--budget-s 100] [--smoke]

Writes ``DIR/vllm_graphs.json`` (``status`` passed, failed or skipped, ``reason``, ``problems``, the
engines' reports and tokens/s) and each engine's log; exits 1 only when the check failed. Skipped
as the Kimi-K3 stage is (``--smoke``, no vLLM, no GPU). Otherwise the tiny Qwen3-MoE model of
``make_vllm_model.py`` is decoded by three engines in turn, each in its own process: ``graphs``,
the plugin's alias with vLLM's piecewise compilation and CUDA graphs (``cudagraph_mode``
PIECEWISE: the op splits the graphs), ``eager``, the same engine with ``enforce_eager``, and
``native``, vLLM's own Qwen3MoeForCausalLM (eager). Both alias engines run the folder's
own MoE layers through the tier's op (``{"checkpoint": <the folder>}``). The graphs engine passes
when its op ran once per MoE layer per model step (a replay that skipped the tier would call it
less) and its log-probabilities agree with the eager engine's and the native engine's within the
Kimi-K3 stage's tolerance; the record has each engine's decode tokens/s.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from .vllm_kimi_gpu import MAX_TOKENS, PROMPTS, compare, run_stage, skip_reason, start_engine, tier_problems

RECORD = "vllm_graphs.json"
ALIAS, NATIVE = "LatentMoeQwen3MoeForCausalLM", "Qwen3MoeForCausalLM"
MOE_LAYERS = [1, 2]  # make_vllm_model.py's qwen3 default: layer 0 dense
TEXT = {"language_model_only": False, "dtype": "float32"}  # a text model, compared in float32
# name -> (architecture, engine settings, share of the time left when it starts): compiling and
# capturing graphs takes the graphs engine most of the budget; the references run eager.
PIECEWISE = {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"}}
ENGINES = {"graphs": (ALIAS, PIECEWISE, 0.6),
           "eager": (ALIAS, {"enforce_eager": True}, 0.5),
           "native": (NATIVE, {"enforce_eager": True}, 1.0)}


def tokens_per_s(report: dict[str, Any]) -> float | None:
    return None if "decode_s" not in report else len(PROMPTS) * MAX_TOKENS / report["decode_s"]


def check(out: Path, budget_s: float) -> dict[str, Any]:
    from scripts import make_vllm_model

    deadline, reports = time.monotonic() + budget_s, {}
    with tempfile.TemporaryDirectory(prefix="vllm-graphs-") as tmp:
        model = Path(tmp) / "model"
        make_vllm_model.main(["--out", str(model)])
        for name, (arch, engine, share) in ENGINES.items():
            spec = {"model": str(model), "arch": arch, "engine": TEXT | engine,
                    "additional_config": {"latent_moe": {"checkpoint": str(model)}}}
            reports[name] = start_engine(out, f"graphs_{name}", spec, share * (deadline - time.monotonic()))
    problems = [f"{n} engine: {r['error']}" for n, r in reports.items() if "error" in r]
    if "error" not in reports["graphs"]:
        problems += tier_problems(reports["graphs"], MOE_LAYERS)
    comparisons = {}
    for other in ("eager", "native"):
        if not {"error"} & (reports["graphs"].keys() | reports[other].keys()):
            comparisons[other] = c = compare(reports[other], reports["graphs"])
            if not c["within_tolerance"]:
                problems.append(f"graphs and {other} engines disagree: log-probabilities differ by up to "
                                f"{c['max_logprob_diff']:.3g} (tolerance {c['tolerance']})")
    speed = {n: tokens_per_s(r) for n, r in reports.items()}
    return {"status": "failed" if problems else "passed", "reason": "; ".join(problems)[:500] or None,
            "problems": problems, "tokens_per_s": speed, "comparisons": comparisons, "engines": reports}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for the record and the engines' logs")
    ap.add_argument("--budget-s", type=float, default=100.0, help="time for the whole check")
    ap.add_argument("--smoke", action="store_true", help="gpu_check.sh --cpu-smoke: record a skip")
    ap.add_argument("--on-cpu", action="store_true",
                    help="run without a GPU (the lane's check of this script: no CUDA graphs)")
    args = ap.parse_args(argv)
    reason = "cpu-smoke: CUDA graphs need a GPU" if args.smoke else None
    if not (args.smoke or args.on_cpu):
        reason = skip_reason(False)
    if args.on_cpu:  # vLLM's CPU backend would reserve most of the machine's memory for its KV cache
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return run_stage(args.out, "vllm_graphs", RECORD, reason, lambda: check(args.out, args.budget_s))

if __name__ == "__main__":
    raise SystemExit(main())
