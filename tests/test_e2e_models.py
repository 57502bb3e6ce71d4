"""End-to-end tests: convert the test models in ``testkit/models/`` with the CLI and compare against fp32.

Each (model, target) pair is converted once per module (see ``converted``) and the
individual tests inspect that one result, which keeps the suite to a handful of CLI runs.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import CliRunner, describe_run
from onnx import TensorProto

from amp_rewriter.formats.onnx.emulation import EVERY_NODE, emulate_low_precision
from testkit.models import BUILDERS, MODEL_NAMES
from testkit.models.cnn import TINY_EXAMPLE_PATH, build_tiny_model
from testkit.models.custom_op import CUSTOM_DOMAIN, CUSTOM_NODE_NAME, CUSTOM_OP

#: max|converted - fp32| / max|fp32| allowed per output. fp16 has an 11-bit significand
#: (~5e-4 per rounding) and a few dozen roundings compound along these graphs; 2e-2 leaves room
#: while still catching a wrong cast or a saturated constant. bf16 keeps only 8 bits.
RELATIVE_TOLERANCE = {"fp16": 2e-2, "bf16": 6e-2}
#: Targets other than fp16 are only exercised where the brief asks for them.
BF16_MODELS = ("cnn", "transformer_block")
REPORT_SUMMARY_KEYS = {
    "nodes",
    "low_precision_nodes",
    "casts_inserted",
    "casts_removed",
    "constants_converted",
    "constants_kept_fp32",
}
REPORT_NODE_KEYS = {"name", "op", "precision", "class", "reason"}
#: Element types of onnxruntime's type strings, for feeding a model whose inputs were converted.
ORT_TYPE_TO_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


@dataclass(frozen=True)
class Conversion:
    """One CLI conversion and where its results were written."""

    name: str
    target: str
    source: Path
    output: Path
    report: Path
    result: subprocess.CompletedProcess

    def require_success(self) -> onnx.ModelProto:
        """Assert the CLI succeeded and return the converted model."""
        assert self.result.returncode == 0, describe_run(self.result)
        assert self.output.is_file(), f"CLI exited 0 but wrote no {self.output.name}"
        return onnx.load(str(self.output))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All fp32 test models, written once for the module."""
    directory = tmp_path_factory.mktemp("fp32_models")
    for name, build_model in BUILDERS.items():
        (directory / f"{name}.onnx").write_bytes(build_model().SerializeToString())
    return directory


@pytest.fixture(scope="module")
def converted(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, amp_cli: CliRunner):
    """Return ``convert(name, target)``, which runs the CLI the first time and caches the result."""
    out_dir = tmp_path_factory.mktemp("converted")
    cache: dict[tuple[str, str], Conversion] = {}

    def convert(name: str, target: str = "fp16") -> Conversion:
        if (name, target) not in cache:
            source = model_dir / f"{name}.onnx"
            output = out_dir / f"{name}.{target}.onnx"
            report = out_dir / f"{name}.{target}.report.json"
            args = ["convert", source, output, "--report", report]
            if target != "fp16":  # fp16 is the default; leaving it out also tests that default.
                args += ["--target", target]
            cache[name, target] = Conversion(name, target, source, output, report, amp_cli(*args))
        return cache[name, target]

    return convert


def make_feeds(name: str) -> list[dict[str, np.ndarray]]:
    """Seeded fp32 inputs for a test model (several feeds where one would miss a code path)."""
    rng = np.random.default_rng(1234)
    if name == "cnn":
        return [{"image": rng.normal(size=(2, 3, 32, 32)).astype(np.float32)}]
    if name == "transformer_block":
        mask = np.ones((3, 8), dtype=np.int64)
        mask[1, 5:] = 0  # padded sequence
        mask[2, 1:] = 0  # everything masked except the first token
        return [{"hidden": rng.normal(size=(3, 8, 64)).astype(np.float32), "attention_mask": mask}]
    if name == "control_flow":
        x = rng.normal(size=(4, 8)).astype(np.float32)
        # x and -x have sums of opposite sign, so both If branches run.
        return [{"x": x}, {"x": -x}]
    if name == "custom_op":
        return [{"x": rng.normal(size=(5, 16)).astype(np.float32)}]
    raise KeyError(name)


def run_model(model_path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a model on ORT CPU, casting feeds to whatever input types the model declares."""
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    typed_feeds = {
        meta.name: feeds[meta.name].astype(ORT_TYPE_TO_NUMPY.get(meta.type, feeds[meta.name].dtype))
        for meta in session.get_inputs()
    }
    names = [meta.name for meta in session.get_outputs()]
    return dict(zip(names, session.run(names, typed_feeds)))


def relative_error(reference: np.ndarray, candidate: np.ndarray) -> float:
    """max|a - b| scaled by the largest reference magnitude (not elementwise, which blows up near 0)."""
    reference = reference.astype(np.float64)
    candidate = candidate.astype(np.float64)
    return float(np.max(np.abs(reference - candidate)) / max(float(np.max(np.abs(reference))), 1e-6))


def assert_outputs_close(fp32_model: Path, converted_model: Path, name: str, tolerance: float) -> None:
    """Run both models on the same inputs; check same outputs, no new NaN/Inf, small relative error."""
    for feeds in make_feeds(name):
        expected = run_model(fp32_model, feeds)
        actual = run_model(converted_model, feeds)
        assert actual.keys() == expected.keys()
        for output_name, reference in expected.items():
            candidate = actual[output_name]
            assert candidate.shape == reference.shape, output_name
            reference_finite = np.isfinite(reference)
            assert np.isfinite(candidate[reference_finite]).all(), f"{output_name}: NaN/Inf not present in fp32"
            error = relative_error(reference[reference_finite], candidate[reference_finite])
            assert error <= tolerance, f"{output_name}: relative error {error:.3g} > {tolerance}"


def tensor_elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every top-level tensor that can be learnt without running the model."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {
        info.name: info.type.tensor_type.elem_type
        for info in chain(graph.input, graph.output, graph.value_info)
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type
    }
    types.update({tensor.name: tensor.data_type for tensor in graph.initializer})
    # Cast and Constant outputs are known even where inference gave up downstream.
    for node in graph.node:
        attributes = {attribute.name: attribute for attribute in node.attribute}
        if node.op_type == "Cast" and "to" in attributes:
            types[node.output[0]] = attributes["to"].i
        elif node.op_type == "Constant" and "value" in attributes:
            types[node.output[0]] = attributes["value"].t.data_type
    return types


def load_report(conversion: Conversion) -> dict:
    """Parse the JSON report of a successful conversion."""
    conversion.require_success()
    assert conversion.report.is_file(), "--report was given but no report was written"
    return json.loads(conversion.report.read_text())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_test_model_is_valid_and_deterministic(model_dir: Path, name: str) -> None:
    """The fp32 inputs themselves: fully checked, runnable on ORT CPU, finite, byte-stable."""
    model_path = model_dir / f"{name}.onnx"
    assert BUILDERS[name]().SerializeToString() == model_path.read_bytes()
    model = onnx.load(str(model_path))
    onnx.checker.check_model(model, full_check=True)
    node_names = [node.name for node in model.graph.node]
    assert all(node_names) and len(set(node_names)) == len(node_names)
    for feeds in make_feeds(name):
        for output in run_model(model_path, feeds).values():
            assert np.isfinite(output).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_fp16_conversion_passes_checker(converted, name: str) -> None:
    output = converted(name).require_success()
    onnx.checker.check_model(output, full_check=True)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_fp16_outputs_match_fp32(converted, name: str) -> None:
    conversion = converted(name)
    conversion.require_success()
    assert_outputs_close(conversion.source, conversion.output, name, RELATIVE_TOLERANCE["fp16"])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_report_schema(converted, name: str) -> None:
    report = load_report(converted(name))
    assert REPORT_SUMMARY_KEYS <= report["summary"].keys()
    assert report["summary"]["low_precision_nodes"] > 0
    assert isinstance(report["nodes"], list) and report["nodes"]
    for entry in report["nodes"]:
        assert REPORT_NODE_KEYS <= entry.keys(), entry


@pytest.mark.parametrize("name", BF16_MODELS)
def test_bf16_conversion(converted, name: str) -> None:
    conversion = converted(name, "bf16")
    output = conversion.require_success()
    onnx.checker.check_model(output, full_check=True)
    assert REPORT_SUMMARY_KEYS <= load_report(conversion)["summary"].keys()
    # onnxruntime's CPU provider has no bf16 kernel for MatMul, Add, Conv, Gemm, Softmax, Erf...,
    # so the numbers are checked on the emulated model that `--validate` runs: fp32 compute with
    # every bf16 tensor rounded to bf16 where it is produced.
    emulated_path = conversion.output.with_name(conversion.output.stem + "_emulated.onnx")
    onnx.save_model(emulate_low_precision(output, policy=EVERY_NODE).model, str(emulated_path))
    assert_outputs_close(conversion.source, emulated_path, name, RELATIVE_TOLERANCE["bf16"])


@pytest.mark.parametrize(("name", "target"), [*((n, "fp16") for n in MODEL_NAMES),
                                             *((n, "bf16") for n in BF16_MODELS)])
def test_check_passes_the_converted_model_against_its_fp32_source(converted, name: str, target: str) -> None:
    """`check --reference` agrees with the conversion: no problem, every output compared (bf16
    emulated on the CPU); and without a reference too."""
    from amp_rewriter.formats.onnx.check import check_model

    conversion = converted(name, target)
    conversion.require_success()
    result = check_model(conversion.output, reference=conversion.source)
    assert result.ok, result.problems
    assert result.target == target and result.outputs
    assert check_model(conversion.output).ok


def test_transformer_matmuls_run_in_fp16(converted) -> None:
    output = converted("transformer_block").require_success()
    types = tensor_elem_types(output)
    matmul_output_types = {node.name: types.get(node.output[0]) for node in output.graph.node if node.op_type == "MatMul"}
    assert TensorProto.FLOAT16 in matmul_output_types.values(), f"MatMul output types: {matmul_output_types}"


def test_custom_op_node_is_kept_in_fp32(converted) -> None:
    original = BUILDERS["custom_op"]()
    output = converted("custom_op").require_success()

    def custom_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
        return [node for node in model.graph.node if node.domain == CUSTOM_DOMAIN and node.op_type == CUSTOM_OP]

    (original_node,) = custom_nodes(original)
    kept_nodes = custom_nodes(output)
    assert len(kept_nodes) == 1, f"expected the {CUSTOM_OP} node once, found {len(kept_nodes)}"
    (kept_node,) = kept_nodes
    # Its inputs may be renamed (a Cast back to fp32 in front of it); everything else must be as built.
    assert kept_node.name == CUSTOM_NODE_NAME
    assert list(kept_node.attribute) == list(original_node.attribute)
    assert len(kept_node.input) == len(original_node.input)
    assert [f.SerializeToString() for f in output.functions] == [f.SerializeToString() for f in original.functions]
    assert (CUSTOM_DOMAIN, 1) in {(opset.domain, opset.version) for opset in output.opset_import}

    types = tensor_elem_types(output)
    for tensor_name in chain(kept_node.input, kept_node.output):
        assert types.get(tensor_name) == TensorProto.FLOAT, (
            f"{CUSTOM_OP} tensor {tensor_name!r} has element type "
            f"{TensorProto.DataType.Name(types[tensor_name]) if tensor_name in types else 'unknown'}, expected FLOAT"
        )


def test_validate_cnn(model_dir: Path, tmp_path: Path, amp_cli: CliRunner) -> None:
    result = amp_cli("convert", model_dir / "cnn.onnx", tmp_path / "cnn.fp16.onnx", "--validate")
    assert result.returncode == 0, describe_run(result)


def test_conversion_is_deterministic(converted, tmp_path: Path, amp_cli: CliRunner) -> None:
    first = converted("cnn")
    first.require_success()
    second_output = tmp_path / "cnn.again.onnx"
    result = amp_cli("convert", first.source, second_output, "--report", tmp_path / "report.json")
    assert result.returncode == 0, describe_run(result)
    assert second_output.read_bytes() == first.output.read_bytes(), "two conversions of the same model differ"


def test_bundled_example_is_current_and_small() -> None:
    assert TINY_EXAMPLE_PATH.is_file(), "regenerate with testkit.models.cnn.write_tiny_example()"
    example = TINY_EXAMPLE_PATH.read_bytes()
    assert len(example) < 300 * 1024
    assert example == build_tiny_model().SerializeToString(), "stale: run testkit.models.cnn.write_tiny_example()"
