"""The vLLM plugin on one GPU, scripts/gpu_check.sh's two vLLM stages: ``vllm_kimi``, the Kimi-K3 alias
(docs/vllm.md, "What stays GPU-only"), and ``vllm_graphs``, the plugin under CUDA graphs (docs/vllm.md,
"Compilation, CUDA graphs and tensor-parallel engines").

    python -m scripts.bench.vllm_kimi_gpu --out DIR [--stage vllm_graphs] [--budget-s S] [--smoke | --on-cpu]

Writes ``DIR/STAGE.json`` (``status`` passed, failed or skipped, ``reason``, ``problems``, the engines'
reports, their comparisons and decode tokens/s) and each engine's log; exits 1 only when the check
failed. Skipped: ``--smoke``, no vLLM, no GPU, or a vLLM without ``vllm.models.kimi_k3``. The stage's
engines (:func:`kimi_engines`, :func:`graphs_engines`) greedy-decode the same prompts in turn, each in
its own process; the first, on the tier, is judged by :func:`tier_problems` and compared with each
other one (:func:`compare`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [300, 301, 302, 303, 304, 305], [42]]
MAX_TOKENS = 12
TOP = 5
TOLERANCE = 0.1
# In-process engine core (apply_model reaches the model to hook its forward); Kimi-K3's GEMM + all-reduce
# fusion, which imports CUTLASS's DSL, off: at TP 1 it has nothing to fuse.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_KIMI_K3_GEMM_AR": "0"}
# Small and bounded: four short prompts, no prefix cache (hybrid KDA state), half the GPU at most.
ENGINE = {"enforce_eager": True, "language_model_only": True, "max_model_len": 128,
          "max_num_batched_tokens": 128, "max_num_seqs": 8, "skip_tokenizer_init": True,
          "enable_prefix_caching": False, "seed": 0}
GPU_ENGINE = {"gpu_memory_utilization": 0.5}


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Build ``spec``'s engine, greedy-decode PROMPTS and report what it did (no judging here)."""
    import torch
    import vllm

    try:
        found = not spec.get("requires") or importlib.util.find_spec(spec["requires"]) is not None
    except ModuleNotFoundError:  # a parent package is missing too
        found = False
    if not found:
        return {"skipped": f"vLLM {vllm.__version__} has no {spec['requires']}"}
    from vllm import LLM, SamplingParams

    from deployments.vllm_plugin import register, tier_stats
    from deployments.vllm_plugin.models import TierMoE

    register()  # vLLM's entry point finds the plugin only where the project is pip-installed
    engine = ENGINE | (GPU_ENGINE if torch.cuda.is_available() else {}) | spec.get("engine", {})
    llm = LLM(model=spec["model"], hf_overrides={"architectures": [spec["arch"]]},
              additional_config=spec.get("additional_config") or {}, **engine)
    (model,) = llm.apply_model(lambda m: m)  # the in-process engine hands back the module itself
    blocks = [m for m in model.modules() if isinstance(m, TierMoE)]
    steps = [0]
    model.register_forward_pre_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))

    def calls() -> dict[int, int]:
        return {layer: s["calls"] for layer, s in tier_stats(llm).items()}

    before, steps_before = calls(), steps[0]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    decode_s, after = time.perf_counter() - start, calls()
    prefixes = tuple(b.prefix + "." for b in blocks)
    return {
        "vllm": vllm.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "model_class": type(model).__name__,
        "tier_blocks": [b.layer for b in blocks],
        "tier_block_params": sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefixes)),
        "moe_params": sum(p.numel() for n, p in model.named_parameters() if ".block_sparse_moe." in n),
        "steps": steps[0] - steps_before,
        "decode_s": decode_s,
        "calls": {str(k): after[k] - before.get(k, 0) for k in sorted(after)},
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        # Per prompt and position: {token id: log-probability} of the top TOP (and the pick).
        "logprobs": [[{str(t): lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                     for o in outs],
    }


def engine_main(spec_path: Path) -> None:
    """The engine process: run its spec's engine, write the result where the spec says."""
    spec = json.loads(spec_path.read_text())
    try:
        result = run_engine(spec)
    except Exception as exc:  # reported in the record; the traceback goes to the engine's log
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    Path(spec["result"]).write_text(json.dumps(result))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)  # the result is written; an engine's teardown has nothing left to say


def start_engine(out: Path, name: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one engine process within ``timeout_s`` (files ``out/NAME.*``); its result, or {"error": ...}."""
    spec_path, result_path = out / f"{name}.spec.json", out / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec | {"result": str(result_path)}))
    result_path.unlink(missing_ok=True)
    log = out / f"{name}.log"
    start = time.monotonic()
    with log.open("w") as f:
        cmd = [sys.executable, "-m", "scripts.bench.vllm_kimi_gpu", "--out", str(out), "--engine",
               str(spec_path)]
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **ENGINE_ENV}, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the engine and anything it started
            proc.wait()
    seconds = round(time.monotonic() - start, 1)
    if result_path.exists():
        return json.loads(result_path.read_text()) | {"seconds": seconds}
    killed = proc.returncode == -signal.SIGKILL
    why = f"timed out after {timeout_s:.0f} s" if killed else f"exited {proc.returncode}"
    tail = log.read_text(errors="replace")[-1500:]
    return {"error": f"the engine process {why} without a result; log tail: {tail}", "seconds": seconds}


def tier_problems(tier: dict[str, Any], moe_layers: list[int], who: str = "tier") -> list[str]:
    """What the engine on the tier (``who``) got wrong: its blocks, their parameters, its tokens, its op
    calls (a CUDA-graph replay that skipped the tier would call it less than once per step)."""
    if "error" in tier:
        return [f"{who} engine: {tier['error']}"]
    problems = []
    if tier["tier_blocks"] != moe_layers:
        problems.append(f"{who} engine built TierMoE blocks at layers {tier['tier_blocks']}, expected one "
                        f"per MoE layer {moe_layers}")
    if tier["tier_block_params"] or tier["moe_params"]:
        problems.append(f"{who} engine holds MoE parameters ({tier['tier_block_params']} under its TierMoE "
                        f"blocks, {tier['moe_params']} under block_sparse_moe)")
    short = [i for i, t in enumerate(tier["tokens"]) if len(t) != MAX_TOKENS]
    if short:
        problems.append(f"{who} engine decoded fewer than {MAX_TOKENS} tokens for prompt(s) {short}")
    calls = {int(k): v for k, v in tier["calls"].items()}
    if tier["steps"] < 1 or calls != dict.fromkeys(moe_layers, tier["steps"]):
        problems.append(f"tier op calls per layer {calls} over {tier['steps']} model steps: expected "
                        f"exactly one per MoE layer per step")
    return problems


def compare(native: dict[str, Any], tier: dict[str, Any], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Two engines' greedy tokens and top log-probabilities, at each prompt's positions up to and
    including the first differing pick (both saw the same tokens): within tolerance when each pick
    is in the other's top k and the log-probabilities both list differ by at most ``tolerance`` (a
    differing pick is then a near-tie). ``max_logprob_diff_same_picks``: before the difference."""
    worst, same, compared, first_diff, outside = 0.0, 0.0, 0, [], []
    pairs = zip(native["tokens"], tier["tokens"], native["logprobs"], tier["logprobs"], strict=True)
    for prompt, (n_tok, t_tok, n_lp, t_lp) in enumerate(pairs):
        diff = next((i for i, (a, b) in enumerate(zip(n_tok, t_tok, strict=True)) if a != b), None)
        first_diff.append(diff)
        for pos in range(len(n_tok) if diff is None else diff + 1):
            common = n_lp[pos].keys() & t_lp[pos].keys()
            compared += bool(common)
            here = max((abs(n_lp[pos][t] - t_lp[pos][t]) for t in common), default=0.0)
            worst, same = max(worst, here), same if pos == diff else max(same, here)
            if str(n_tok[pos]) not in t_lp[pos] or str(t_tok[pos]) not in n_lp[pos]:
                outside.append([prompt, pos])
    return {"tokens_equal": [d is None for d in first_diff], "first_difference": first_diff,
            "positions_compared": compared, "max_logprob_diff": worst, "max_logprob_diff_same_picks": same,
            "tolerance": tolerance, "picks_outside_top": outside,
            "within_tolerance": worst <= tolerance and compared >= len(first_diff) and not outside}


def make_inputs(folder: Path) -> tuple[Path, Path, list[int]]:
    """The tiny Kimi-K3 model, its tier checkpoint (the same MoE tensors) and its MoE layers."""
    from moe_runtime.config import LatentMoEConfig
    from scripts import make_checkpoint, make_vllm_model

    model, ckpt = folder / "model", folder / "tier"
    make_vllm_model.main(["--arch", "kimi_k3", "--out", str(model), "--preset", "tiny", "--seed", "0"])
    make_checkpoint.main(["--preset", "tiny", "--out", str(ckpt), "--seed", "0"])
    return model, ckpt, LatentMoEConfig.from_pretrained(ckpt).moe_layers


def kimi_engines(folder: Path) -> tuple[list[tuple[str, dict[str, Any], float]], list[int]]:
    """The ``vllm_kimi`` stage's engines on the tiny Kimi-K3 model, each with its share of the time left
    when it starts (at gpu_check.sh's 115 s, 40 s stay for the native engine, whose kernels are then
    cached), and the model's MoE layers."""
    model, ckpt, moe_layers = make_inputs(folder)
    spec = {"model": str(model), "requires": "vllm.models.kimi_k3"}
    latent = {"latent_moe": {"checkpoint": str(ckpt), "dtype": "float32"}}
    tier = spec | {"arch": "LatentMoeKimiK3ForConditionalGeneration", "additional_config": latent}
    native = spec | {"arch": "KimiK3ForConditionalGeneration"}
    return [("tier", tier, 0.65), ("native", native, 1.0)], moe_layers


def graphs_engines(folder: Path) -> tuple[list[tuple[str, dict[str, Any], float]], list[int]]:
    """The ``vllm_graphs`` stage's engines on the tiny Qwen3-MoE model (a text model, compared in float32;
    make_vllm_model.py's qwen3 default has layer 0 dense): compiling and capturing graphs takes the
    graphs engine most of the budget; the references run eager (:data:`ENGINE`'s default)."""
    from scripts import make_vllm_model

    model = folder / "model"
    make_vllm_model.main(["--out", str(model)])
    text = {"language_model_only": False, "dtype": "float32"}
    spec = {"model": str(model), "additional_config": {"latent_moe": {"checkpoint": str(model)}}}
    alias = spec | {"arch": "LatentMoeQwen3MoeForCausalLM"}
    graphs = text | {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    return [("graphs", alias | {"engine": graphs}, 0.6), ("eager", alias | {"engine": text}, 0.5),
            ("native", spec | {"arch": "Qwen3MoeForCausalLM", "engine": text}, 1.0)], [1, 2]


def check(out: Path, stage: str, budget_s: float) -> dict[str, Any]:
    """Run the stage's engines in turn; the first (on the tier) must pass :func:`tier_problems` and agree
    with each other one."""
    deadline, reports = time.monotonic() + budget_s, {}
    with tempfile.TemporaryDirectory(prefix=f"{stage}-") as tmp:
        engines, moe_layers = STAGES[stage][0](Path(tmp))
        for name, spec, share in engines:
            reports[name] = start_engine(out, f"{stage}_{name}", spec, share * (deadline - time.monotonic()))
            if "skipped" in reports[name]:
                return {"status": "skipped", "reason": reports[name]["skipped"], "problems": []}
    (first, tier), *others = reports.items()
    problems = tier_problems(tier, moe_layers, first)
    problems += [f"{n} engine: {r['error']}" for n, r in others if "error" in r]
    comparisons = {n: compare(r, tier) for n, r in others if "error" not in r and "error" not in tier}
    problems += [f"{first} and {n} engines disagree: log-probabilities differ by up to "
                 f"{c['max_logprob_diff']:.3g} (tolerance {c['tolerance']}) over {c['positions_compared']} "
                 f"positions; first differing picks {c['first_difference']}; picks outside the top {TOP} "
                 f"{c['picks_outside_top']}" for n, c in comparisons.items() if not c["within_tolerance"]]
    speed = {n: len(PROMPTS) * MAX_TOKENS / r["decode_s"] for n, r in reports.items() if "decode_s" in r}
    return {"status": "failed" if problems else "passed", "reason": "; ".join(problems)[:500] or None,
            "problems": problems, "moe_layers": moe_layers, "engines": reports, "comparisons": comparisons,
            "tokens_per_s": speed}


# stage -> (its engines, its default budget s, its --smoke skip)
STAGES = {"vllm_kimi": (kimi_engines, 150.0, "cpu-smoke: vLLM's CPU backend runs neither KDA nor "
                        "Kimi-K3's MLA"),
          "vllm_graphs": (graphs_engines, 100.0, "cpu-smoke: CUDA graphs need a GPU")}


def skip_reason(stage: str, smoke: bool, on_cpu: bool) -> str | None:
    if smoke:
        return STAGES[stage][2]
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed in this Python ({sys.executable})"
    import torch

    if not (on_cpu or torch.cuda.is_available()):
        return "no GPU visible to torch"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for the record and the engines' logs")
    ap.add_argument("--stage", choices=STAGES, default="vllm_kimi", help="the check (default vllm_kimi)")
    ap.add_argument("--budget-s", type=float, help="time for the whole check (the stage's limit must be "
                    "larger; default 150 s for vllm_kimi, 100 s for vllm_graphs)")
    ap.add_argument("--smoke", action="store_true", help="gpu_check.sh --cpu-smoke: record a skip")
    ap.add_argument("--on-cpu", action="store_true",
                    help="run without a GPU (the lane's check of the vllm_graphs stage: no CUDA graphs)")
    ap.add_argument("--engine", type=Path, help=argparse.SUPPRESS)  # the child process of this spec
    args = ap.parse_args(argv)
    if args.engine:
        engine_main(args.engine)
    if args.on_cpu:  # vLLM's CPU backend would reserve most of the machine's memory for its KV cache
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    record_path = args.out / f"{args.stage}.json"
    record_path.unlink(missing_ok=True)  # a run cut off by its limit leaves no record, not an old one
    start = time.monotonic()
    if skip := skip_reason(args.stage, args.smoke, args.on_cpu):
        record = {"status": "skipped", "reason": skip, "problems": []}
    else:
        record = check(args.out, args.stage, args.budget_s or STAGES[args.stage][1])
    record = {"stage": args.stage, **record, "seconds": round(time.monotonic() - start, 1)}
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{record['status']}" + (f": {record['reason']}" if record["reason"] else ""))
    return 1 if record["status"] == "failed" else 0


if __name__ == "__main__":
    raise SystemExit(main())
