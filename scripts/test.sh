#!/usr/bin/env bash
# The whole test suite (CPU only; GPU-marked tests skip themselves without a GPU).
# `scripts/test.sh --vllm [pytest args]` instead runs the opt-in vLLM lane in its separate venv: our code
# against vLLM's and AMD Quark's own (tests/conformance, docs/conformance.md) and the vLLM plugin end to
# end (tests/vllm_lane, docs/vllm.md). CI never runs it.
if [ "${1:-}" = "--vllm" ]; then
  shift
  # The lane's tier (tests/vllm_lane) runs in the project venv: build it first, then switch to the lane's.
  source "$(dirname "$0")/env.sh"
  source "$(dirname "$0")/vllm_env.sh"
  python -c "import vllm, torch, quark; print('vllm', vllm.__version__, '| amd-quark', quark.__version__, '| torch', torch.__version__)"
  exec python scripts/conformance_lane.py "$@"   # pytest -q -ra tests/conformance tests/vllm_lane; records artifacts/conformance-lane.json
fi
source "$(dirname "$0")/env.sh"
ruff check .
# Two processes (pytest-xdist), whole modules each: the modules using Ray run in two sets, one per
# process (set 1: those starting a Ray of their own, plus two that share one; set 2: the other
# sharing ones; tests/conftest.py splits them), and the modules without Ray fill in wherever a
# process is free. LMS_TEST_WORKERS=0 runs it all in this process, one module at a time.
exec python -m pytest -q -ra -n "${LMS_TEST_WORKERS:-2}" --no-loadscope-reorder "$@"
