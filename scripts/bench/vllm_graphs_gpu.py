"""The vLLM plugin under CUDA graphs on one GPU: scripts/gpu_check.sh's ``vllm_graphs`` stage
(docs/vllm.md, "Compilation, CUDA graphs and tensor-parallel engines").

    python -m scripts.bench.vllm_graphs_gpu --out DIR [--budget-s 100] [--smoke | --on-cpu]

Writes ``DIR/vllm_graphs.json`` (the Kimi-K3 stage's record, with each engine's report and decode
tokens/s) and each engine's log. Three engines decode the tiny Qwen3-MoE model in turn: the
plugin's alias with piecewise CUDA graphs, the same alias eager, and vLLM's own model, eager.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from . import vllm_kimi_gpu as kimi

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
    return None if "decode_s" not in report else len(kimi.PROMPTS) * kimi.MAX_TOKENS / report["decode_s"]


def check(out: Path, budget_s: float) -> dict[str, Any]:
    """The graphs engine passes when its op ran once per MoE layer per model step (a replay that
    skipped the tier would call it less) and it agrees with the eager and the native engine."""
    from scripts import make_vllm_model

    deadline, reports = time.monotonic() + budget_s, {}
    with tempfile.TemporaryDirectory(prefix="vllm-graphs-") as tmp:
        model = Path(tmp) / "model"
        make_vllm_model.main(["--out", str(model)])
        for name, (arch, engine, share) in ENGINES.items():
            spec = {"model": str(model), "arch": arch, "engine": TEXT | engine,
                    "additional_config": {"latent_moe": {"checkpoint": str(model)}}}
            timeout_s = share * (deadline - time.monotonic())
            reports[name] = kimi.start_engine(out, f"graphs_{name}", spec, timeout_s)
    problems = [f"{n} engine: {r['error']}" for n, r in reports.items() if "error" in r]
    if "error" not in reports["graphs"]:
        problems += kimi.tier_problems(reports["graphs"], MOE_LAYERS)
    comparisons = {}
    for other in ("eager", "native"):
        if not {"error"} & (reports["graphs"].keys() | reports[other].keys()):
            who = f"graphs and {other} engines"
            comparisons[other] = kimi.agreement(reports[other], reports["graphs"], who, problems)
    speed = {n: tokens_per_s(r) for n, r in reports.items()}
    return kimi.outcome(problems) | {"tokens_per_s": speed, "comparisons": comparisons, "engines": reports}


def main(argv: list[str] | None = None) -> int:
    ap = kimi.stage_parser(__doc__, 100.0)
    ap.add_argument("--on-cpu", action="store_true",
                    help="run without a GPU (the lane's check of this script: no CUDA graphs)")
    args = ap.parse_args(argv)
    reason = "cpu-smoke: CUDA graphs need a GPU" if args.smoke else None
    if not (args.smoke or args.on_cpu):
        reason = kimi.skip_reason(False)
    if args.on_cpu:  # vLLM's CPU backend would reserve most of the machine's memory for its KV cache
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return kimi.run_stage(args.out, "vllm_graphs", reason, lambda: check(args.out, args.budget_s))


if __name__ == "__main__":
    raise SystemExit(main())
