#!/usr/bin/env bash
# The whole test suite (CPU only; GPU-marked tests skip themselves without a GPU).
source "$(dirname "$0")/env.sh"
ruff check .
exec python -m pytest -q -ra "$@"
