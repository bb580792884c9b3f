# Sourced by run.sh and test.sh: create (once) and activate the project virtualenv.
# torch is pinned to the CPU wheel this fleet keeps on disk; an unpinned torch would pull
# a multi-GB CUDA build.
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
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" "ray[serve]==2.60.*"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
  touch "$STAMP"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
