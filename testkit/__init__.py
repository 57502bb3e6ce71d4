"""What the tests, the scripts and the benchmarks share, as one package under ruff and mypy.

- `models`: small deterministic fp32 models (ONNX builders, TF1 graphs and SavedModels, TF1
  training graphs, torch exports of real architectures) and `python -m testkit.models OUT_DIR`;
- `builder`: the tiny ONNX graph builder the pass tests use; `training_ir`: the training core on
  plain IR graphs;
- `synthetic`: transformer-like graphs of any size, for the scale benchmarks;
- `fuzz_cases` (recipes and the files they become) and `fuzz` (running and judging cases): the
  CLI fuzzer behind scripts/fuzz.py;
- `same_output_cases`, `same_output_corpus`, `record_cases`: the cases scripts/same_output.py
  replays under two code versions, and the test-suite hook that records more;
- `onnx_corpus`: amp_rewriter over onnx's backend test corpus, each outcome classified;
- `ort_kernels`: what onnxruntime's CPU provider runs for each contrib op in fp16 and bf16;
- `training_identity`: two versions of the TF1 training rewrite trained side by side;
- `bench`: resident-set readings, sampled runs and output errors for the benchmark scripts.

The command lines stay in scripts/ (each a thin argument parser over these modules). Nothing here
imports amp_rewriter at module level where a module must run under another code version
(`same_output_cases`, `training_identity`, `fuzz`).
"""
