#!/usr/bin/env bash
# Create (or reuse) .venv in the repository root and install amp-rewriter into it.
# Usage: scripts/setup_venv.sh [extra ...]   e.g. scripts/setup_venv.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
spec="."
if [ "$#" -gt 0 ]; then
  spec=".[$(IFS=,; echo "$*")]"
fi
# pip's build chatter goes to a log; it is shown only if the install fails.
if ! .venv/bin/python -m pip install --quiet -e "$spec" >.venv/pip-install.log 2>&1; then
  cat .venv/pip-install.log >&2
  exit 1
fi
