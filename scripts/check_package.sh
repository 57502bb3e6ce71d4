#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel, check their metadata with twine,
# install the wheel into a fresh venv outside the source tree and run the README's first example
# with it; then run the pre-commit hook from this repository on a model with an fp16 deny-list
# op (it must fail) and on one `convert` wrote (it must pass). Needs the test extra's build,
# twine and pre-commit in .venv (scripts/setup_venv.sh test) and the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PYTHON=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/amp-rewriter-package.XXXXXX")
trap 'rm -rf "$work"' EXIT
step() { printf '\n== %s\n' "$*"; }
fail() { echo "check_package: $*" >&2; exit 1; }
# pip's notes go to a log, shown only when an install fails.
pip_install() {
  "$work/venv/bin/python" -m pip install --quiet "$@" >>"$work/pip.log" 2>&1 \
    || { cat "$work/pip.log" >&2; fail "pip install $* failed"; }
}

step "build the sdist and the wheel"
.venv/bin/python -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 \
  || { cat "$work/build.log" >&2; fail "python -m build failed"; }
ls "$work/dist"
wheel=$(ls "$work/dist"/*.whl)
ls "$work/dist"/*.tar.gz >/dev/null
.venv/bin/twine check --strict "$work/dist"/*
version=$(.venv/bin/python -c "import sys, zipfile; from email.parser import Parser
[meta] = [n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith('.dist-info/METADATA')]
print(Parser().parsestr(zipfile.ZipFile(sys.argv[1]).read(meta).decode())['Version'])" "$wheel")

step "install the wheel with [cpu] into a fresh venv away from the checkout"
"$PYTHON" -m venv "$work/venv"
venv=$work/venv/bin
pip_install "$wheel[cpu]"
mkdir "$work/run"
cp examples/tiny_cnn.onnx "$work/run/"
cd "$work/run"
location=$("$venv/python" -c "import amp_rewriter; print(amp_rewriter.__file__)")
[[ $location == "$work/venv/"* ]] || fail "amp_rewriter imported from $location, not the venv"
[[ $("$venv/amp-rewriter" --version) == "amp-rewriter $version" ]] || fail "--version is not $version"
[[ $("$venv/python" -m amp_rewriter --version) == "amp-rewriter $version" ]] \
  || fail "python -m amp_rewriter --version is not $version"
echo "amp-rewriter $version from $location"

step "--plot without matplotlib: one line naming the extra, exit 2"
set +e
"$venv/amp-rewriter" convert tiny_cnn.onnx plot_test.onnx --plot map.png 2>stderr.txt
status=$?
set -e
[[ $status == 2 && $(wc -l <stderr.txt) == 1 ]] && grep -q "amp-rewriter\[plot\]" stderr.txt \
  || fail "--plot without matplotlib gave exit $status: $(cat stderr.txt)"
[[ ! -e plot_test.onnx && ! -e map.png ]] || fail "--plot without matplotlib wrote files"
cat stderr.txt

step "add [tensorflow,plot] and run the README's first example"
pip_install "$wheel[cpu,tensorflow,plot]"
# The README block after the "first example" marker, run as written.
awk '/<!-- first example:/ {found=1; next} found && /^```bash/ {inside=1; next}
     inside && /^```/ {exit} inside {print}' "$root/README.md" >example.sh
[[ -s example.sh ]] || fail "no first example found in README.md"
cat example.sh
PATH="$venv:$PATH" bash -euo pipefail example.sh
"$venv/amp-rewriter" convert tiny_cnn.onnx map_fp16.onnx --plot map.png --plot map.svg --quiet
head -c 4 map.png | grep -q PNG || fail "--plot wrote no PNG"
grep -q "<svg" map.svg || fail "--plot wrote no SVG"

step "the tensorflow extra: a GraphDef converts to bf16 and validates"
TF_CPP_MIN_LOG_LEVEL=2 "$venv/python" - 2>tf_stderr.txt <<'EOF' \
  || { cat tf_stderr.txt >&2; fail "could not build a GraphDef with TensorFlow"; }
import numpy as np
import tensorflow as tf

graph = tf.Graph()
with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 8], name="x")
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    tf.identity(tf.nn.relu(tf.matmul(x, w)), name="y")
open("mlp.pb", "wb").write(graph.as_graph_def().SerializeToString())
EOF
TF_CPP_MIN_LOG_LEVEL=2 "$venv/amp-rewriter" convert mlp.pb mlp_bf16.pb --outputs y --target bf16 \
  --validate 2>tf_stderr.txt || { cat tf_stderr.txt >&2; fail "TensorFlow conversion failed"; }
grep "warning:" tf_stderr.txt || true  # on a CPU without native bf16: it will likely be slower

step "the pre-commit hook, from this repository"
"$venv/python" - <<'EOF'
from onnx import TensorProto, helper, save

nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
         helper.make_node("Exp", ["x16"], ["e16"], name="exp"),  # on the fp16 deny list
         helper.make_node("Cast", ["e16"], ["y"], to=TensorProto.FLOAT)]
graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "exp_fp16.onnx")
EOF
git init --quiet models-repo
mv exp_fp16.onnx models-repo/
cp tiny_cnn_fp16.onnx models-repo/
cd models-repo
git add exp_fp16.onnx tiny_cnn_fp16.onnx
export PRE_COMMIT_HOME=$work/pre-commit-home
set +e
"$root/.venv/bin/pre-commit" try-repo "$root" amp-rewriter-check --files exp_fp16.onnx >hook.txt 2>&1
status=$?
set -e
[[ $status == 1 ]] && grep -q "deny_op_in_low_precision" hook.txt \
  || { cat hook.txt >&2; fail "the hook did not fail on exp_fp16.onnx (exit $status)"; }
grep "deny_op_in_low_precision" hook.txt
"$root/.venv/bin/pre-commit" try-repo "$root" amp-rewriter-check --files tiny_cnn_fp16.onnx \
  >hook.txt 2>&1 || { cat hook.txt >&2; fail "the hook failed on a model convert wrote"; }
echo "pre-commit hook: fails on exp_fp16.onnx, passes tiny_cnn_fp16.onnx"

printf '\ncheck_package: ok (amp-rewriter %s)\n' "$version"
