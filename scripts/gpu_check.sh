#!/usr/bin/env bash
# One prepared GPU check (issue 11 item 7), bounded to under 10 minutes (one device call): the
# GPU-marked tests (tests/test_gpu.py), then the GPU timings of scripts/bench/gpu_timings.py: torch vs grouped experts
# backend (and vLLM's fused MoE kernels, the vllm backend, where this Python has vLLM on CUDA) at
# Kimi-K3 per-rank shapes for T = 1..8192, each against the HBM floor of the bytes its point reads,
# all-reduce / reduce-scatter of the latent,
# and a TP-2 tail comparison when two GPUs exist; last, the vLLM plugin's Kimi-K3 alias on the GPU
# (scripts/bench/vllm_kimi_gpu.py: a tiny Kimi-K3 with its MoE blocks on the tier against vLLM's own
# Kimi-K3 with the same experts; skipped, and listed as such, where this Python has no vLLM) and the
# plugin under CUDA graphs (the same script's vllm_graphs stage: a tiny Qwen3-MoE with piecewise CUDA
# graphs split at the tier's op, against the same engine eager and vLLM's own model; tokens/s of each).
# Writes under OUT_DIR each stage's log, the timings as JSON lines (experts.jsonl, collectives.jsonl,
# tail.jsonl: one record per point, written the moment it is measured, so a stage cut off by its
# limit keeps what it measured), vllm_kimi.json, vllm_graphs.json and summary.json.
#
#   scripts/gpu_check.sh [OUT_DIR] [--cpu-smoke]     (OUT_DIR default: $OUT, else artifacts/gpu_check)
#
# --cpu-smoke runs every stage on the CPU with tiny shapes (the vLLM stages record themselves as
# skipped: vLLM's CPU backend runs neither that model nor CUDA graphs): a dry run where no GPU is lent.
# It uses $PYTHON (default python3) as it finds it: a GPU machine brings its own torch build and
# nothing is installed here. Exit status (scripts/bench/gpu_report.py --summary): 0 when every stage passed
# (or, for a vLLM stage, was skipped: see "skipped" in summary.json) and, outside --cpu-smoke,
# torch saw a GPU and at least one GPU-marked test ran rather than skipped; else 1, with the reasons
# under "problems" in summary.json.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=()
REPS=10
OUT_DIR="${OUT:-artifacts/gpu_check}"
for arg in "$@"; do
  case "$arg" in
    --cpu-smoke) SMOKE=(--smoke); REPS=3 ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    *) OUT_DIR="$arg" ;;
  esac
done
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STAGES=()

# stage NAME LIMIT_S CMD...: run with a hard time limit, log to OUT_DIR/NAME.log, record rc and seconds.
stage() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout -k 10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  rc=$?
  STAGES+=("$name:$rc:$((SECONDS - t0)):$limit")
  echo "== $name: exit $rc after $((SECONDS - t0)) s (limit $limit s)"
  tail -n 4 "$OUT_DIR/$name.log"
}

# Budget (s): 30 + 80 + 120 + 40 + 40 + 130 + 120 = 560 < 600, each a hard limit (an H200 run took 12 s of
# GPU tests, 61 s of experts, 10 s of collectives, 4 s of tail).
stage environment 30 "$PY" -c "
import json, sys, torch
info = {'python': sys.version.split()[0], 'torch': torch.__version__, 'hip': torch.version.hip,
        'cuda': torch.version.cuda, 'cuda_available': torch.cuda.is_available(),
        'gpus': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        'grouped_mm': hasattr(torch, '_grouped_mm')}
for mod in ('pytest', 'safetensors', 'yaml', 'aiter', 'vllm'):
    try:
        __import__(mod); info[mod] = True
    except Exception as exc:
        info[mod] = f'{type(exc).__name__}: {exc}'
json.dump(info, open('$OUT_DIR/environment.json', 'w'), indent=2)
print(json.dumps(info))
"
stage gpu_tests 80 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py --junitxml "$OUT_DIR/gpu_tests.xml"
stage experts 120 "$PY" -m scripts.bench.gpu_timings experts --out "$OUT_DIR/experts.jsonl" --reps "$REPS" \
  --point-budget-s 2 "${SMOKE[@]}"
stage collectives 40 "$PY" -m scripts.bench.gpu_timings collectives --out "$OUT_DIR/collectives.jsonl" \
  --reps "$REPS" "${SMOKE[@]}"
stage tail 40 "$PY" -m scripts.bench.gpu_timings tail --out "$OUT_DIR/tail.jsonl" --reps "$REPS" "${SMOKE[@]}"
# Its own budget leaves the stage's limit 15 s to write its record after a slow engine.
stage vllm_kimi 130 "$PY" -m scripts.bench.vllm_kimi_gpu --out "$OUT_DIR" --budget-s 115 "${SMOKE[@]}"
stage vllm_graphs 120 "$PY" -m scripts.bench.vllm_kimi_gpu --stage vllm_graphs --out "$OUT_DIR" --budget-s 105 \
  "${SMOKE[@]}"

"$PY" -m scripts.bench.gpu_report "$OUT_DIR" "${SMOKE[@]}" --summary "${STAGES[@]}"
