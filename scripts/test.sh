#!/usr/bin/env bash
# Set up .venv with the test dependencies, lint and type-check, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
.venv/bin/ruff check amp_rewriter testkit tests scripts examples
.venv/bin/mypy
# A worker per core, at most 4 (each holds TensorFlow, torch and onnxruntime: about 1.5 GB);
# CI has 2. A test file stays on one worker, so its module-scoped fixtures (the fuzz run, the
# exported models) are built once. PYTEST_WORKERS=0 runs everything in this process.
cores=$(nproc)
.venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}" --dist loadfile "$@"
