#!/usr/bin/env bash
# One prepared GPU check (issue 11 item 7), bounded to under 8 minutes: the GPU-marked tests
# (tests/test_gpu.py), then the GPU timings of scripts/bench/gpu_timings.py: torch vs grouped experts
# backend at Kimi-K3 per-rank shapes for T = 1..8192, all-reduce / reduce-scatter of the latent,
# and a TP-2 tail comparison when two GPUs exist. Writes under OUT_DIR each stage's log, the
# timings as JSON lines (experts.jsonl, collectives.jsonl, tail.jsonl: one record per point, written
# the moment it is measured, so a stage cut off by its limit keeps what it measured) and summary.json.
#
#   scripts/gpu_check.sh [OUT_DIR] [--cpu-smoke]     (OUT_DIR default: $OUT, else artifacts/gpu_check)
#
# --cpu-smoke runs every stage on the CPU with tiny shapes: a dry run where no GPU is lent.
# It uses $PYTHON (default python3) as it finds it: a GPU machine brings its own torch build and
# nothing is installed here. Exit status (scripts/bench/gpu_check_summary.py): 0 when every stage passed
# and, outside --cpu-smoke, torch saw a GPU and at least one GPU-marked test ran rather than
# skipped; else 1, with the reasons under "problems" in summary.json.
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

# Budget (s): 30 + 110 + 180 + 60 + 90 = 470 < 480, each a hard limit.
stage environment 30 "$PY" -c "
import json, sys, torch
info = {'python': sys.version.split()[0], 'torch': torch.__version__, 'hip': torch.version.hip,
        'cuda': torch.version.cuda, 'cuda_available': torch.cuda.is_available(),
        'gpus': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        'grouped_mm': hasattr(torch, '_grouped_mm')}
for mod in ('pytest', 'safetensors', 'yaml', 'aiter'):
    try:
        __import__(mod); info[mod] = True
    except Exception as exc:
        info[mod] = f'{type(exc).__name__}: {exc}'
json.dump(info, open('$OUT_DIR/environment.json', 'w'), indent=2)
print(json.dumps(info))
"
stage gpu_tests 110 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py --junitxml "$OUT_DIR/gpu_tests.xml"
stage experts 180 "$PY" -m scripts.bench.gpu_timings experts --out "$OUT_DIR/experts.jsonl" --reps "$REPS" \
  --point-budget-s 2 "${SMOKE[@]}"
stage collectives 60 "$PY" -m scripts.bench.gpu_timings collectives --out "$OUT_DIR/collectives.jsonl" \
  --reps "$REPS" "${SMOKE[@]}"
stage tail 90 "$PY" -m scripts.bench.gpu_timings tail --out "$OUT_DIR/tail.jsonl" --reps "$REPS" "${SMOKE[@]}"

"$PY" -m scripts.bench.gpu_check_summary "$OUT_DIR" "${SMOKE[@]}" "${STAGES[@]}"
