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
# One module at a time by default. LMS_TEST_WORKERS=N runs N modules at once (pytest-xdist, whole
# modules per process): faster on a machine with cores to spare; on 2 cores the open lanes' and
# cohorts' graph loops (each keeps a core busy) push the tight time bounds of the fault tests
# past their limits (docs/design.md, section 7).
exec python -m pytest -q -ra -n "${LMS_TEST_WORKERS:-0}" --dist loadfile "$@"
