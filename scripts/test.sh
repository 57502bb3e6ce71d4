#!/usr/bin/env bash
# Set up .venv with the test dependencies and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
.venv/bin/python -m pytest -q "$@"
