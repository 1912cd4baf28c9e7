#!/usr/bin/env bash
# Set up everything the tests need, from scratch, idempotently: a virtual environment in
# .venv with the CPU build of torch, the project with its extras, and test-only tools.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[test,plot]"
