#!/usr/bin/env bash
# The whole test suite (CPU only; GPU-marked tests skip themselves without a GPU).
# `scripts/test.sh --vllm [pytest args]` instead runs the opt-in conformance lane: our code against
# vLLM's and AMD Quark's own (tests/conformance, docs/conformance.md) in its separate venv. CI never runs it.
if [ "${1:-}" = "--vllm" ]; then
  shift
  source "$(dirname "$0")/vllm_env.sh"
  python -c "import vllm, torch, quark; print('vllm', vllm.__version__, '| amd-quark', quark.__version__, '| torch', torch.__version__)"
  exec python scripts/conformance_lane.py "$@"   # pytest -q -ra tests/conformance; records docs/conformance-lane.json
fi
source "$(dirname "$0")/env.sh"
ruff check .
# Whole modules run in parallel (pytest-xdist): most tests wait on Ray processes, not on a core.
# LMS_TEST_WORKERS=0 runs them in this one process.
exec python -m pytest -q -ra -n "${LMS_TEST_WORKERS:-3}" --dist loadfile "$@"
