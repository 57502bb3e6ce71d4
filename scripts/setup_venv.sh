#!/usr/bin/env bash
# Create (or reuse) .venv in the repository root and install amp-rewriter into it.
# Usage: scripts/setup_venv.sh [extra ...]   e.g. scripts/setup_venv.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
if [ "$#" -gt 0 ]; then
  extras=$(IFS=,; echo "$*")
  .venv/bin/python -m pip install --quiet -e ".[${extras}]"
else
  .venv/bin/python -m pip install --quiet -e .
fi
