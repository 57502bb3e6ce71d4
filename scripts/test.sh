#!/usr/bin/env bash
# Set up .venv with the test dependencies, lint and type-check, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
.venv/bin/ruff check amp_rewriter tests scripts models examples
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
