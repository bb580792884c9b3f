#!/usr/bin/env bash
# Main job: serve the tiny generated checkpoint on a local Ray instance (CPU, TP 2 on logical
# GPUs), check the outputs of every path (handle, HTTP, lane, cohort) against the single-device
# forward, print the tail decision and latencies, then shut down everything it started.
#
#   scripts/run.sh            # run the checks and exit
#   scripts/run.sh --serve    # ... then keep serving on http://127.0.0.1:8000 until Ctrl-C
#
# Extra arguments go to `python scripts/demo.py` (--config, --port, --repeats, ...).
source "$(dirname "$0")/env.sh"
CKPT="${LMS_CHECKPOINT:-checkpoints/tiny}"
if [ ! -f "$CKPT/config.json" ]; then
  python scripts/make_checkpoint.py --preset tiny --out "$CKPT"
fi
exec python scripts/demo.py --checkpoint "$CKPT" "$@"
