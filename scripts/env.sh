# Sourced by run.sh and test.sh: create (once) and activate the project virtualenv.
#
# torch: by default the 2.13.0 CPU wheel this fleet keeps on disk (pip finds it there). On a
# machine where `pip install torch` would fetch the multi-GB CUDA build, pick the CPU build:
#   LMS_TORCH_INDEX=https://download.pytorch.org/whl/cpu scripts/test.sh     # PyTorch's CPU index
#   LMS_TORCH=/path/to/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl scripts/test.sh
# (LMS_TORCH is any pip requirement or wheel path; default torch==2.13.0.) They apply when the
# venv is (re)built: delete .venv to switch. Torch is installed first and on its own only to pick
# that build; every version range (Ray, torch, ruff, ...) lives in pyproject.toml, which the
# `-e .[test]` install below reads. That install is constrained to the torch just installed, so it
# fails on a torch outside pyproject's range instead of swapping in another build. ruff is pinned
# in the `test` extra, so a new ruff release cannot change what `ruff check .` reports.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LMS_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
STAMP="$VENV/.lms-installed"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "${LMS_TORCH:-torch==2.13.0}" \
    ${LMS_TORCH_INDEX:+--index-url "$LMS_TORCH_INDEX"}
  "$VENV/bin/python" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" \
    > "$VENV/.lms-torch-pin.txt"
  "$VENV/bin/python" -m pip install -q -c "$VENV/.lms-torch-pin.txt" -e "$ROOT[test]"
  touch "$STAMP"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
# Every Ray worker a run starts imports the project's modules. Where PYTHONDONTWRITEBYTECODE is
# set (it is on the machines this suite was timed on) Python caches no bytecode, and each of the
# ~150 workers of a test run compiled them anew (~0.25 CPU-s each): compile them once here
# (compileall writes regardless of that variable, and only what changed since).
python -m compileall -q -j 0 deployments moe_runtime scripts tests
