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

The command lines are in scripts/ (each a thin argument parser over these modules); the only ones
here are the model writers (`python -m testkit.models...`, from the checkout's root) and the replay
entry of `same_output_cases`, which scripts/same_output.py runs by path under each code version.
The modules that must run under another code version (`same_output_cases`, `training_identity`,
`fuzz`, `fuzz_cases`) import no amp_rewriter at module level; tests/test_architecture.py checks.
"""
