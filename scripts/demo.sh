#!/usr/bin/env bash
# Set up .venv and convert the bundled example model to fp16, validating it against fp32.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh cpu
mkdir -p out
.venv/bin/amp-rewriter convert examples/tiny_cnn.onnx out/tiny_cnn_fp16.onnx \
  --report out/tiny_cnn_report.json --validate
echo
echo "Why is the final Softmax fp32?"
.venv/bin/amp-rewriter explain out/tiny_cnn_report.json softmax
