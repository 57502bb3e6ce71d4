"""Shared helpers for the test-model builders in this package.

Every builder draws its weights from a seeded numpy generator and never records
anything time- or host-dependent, so the serialized bytes are identical across runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper, numpy_helper

#: The ai.onnx opset every test model targets.
OPSET = 17
#: IR version 8 is the one that goes with opset 17 and is the first to allow model-local functions.
IR_VERSION = 8
PRODUCER_NAME = "amp-rewriter-test-models"


def seeded_rng(seed: int) -> np.random.Generator:
    """Return a numpy generator with a fixed seed, so weights are reproducible."""
    return np.random.default_rng(seed)


def float_initializer(name: str, values: npt.ArrayLike) -> onnx.TensorProto:
    """Make an fp32 initializer from an array (cast to float32 so the dtype is never float64)."""
    return numpy_helper.from_array(np.asarray(values, dtype=np.float32), name=name)


def int64_initializer(name: str, values: list[int] | np.ndarray) -> onnx.TensorProto:
    """Make an int64 initializer (shapes, axes, trip counts)."""
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name=name)


def normal_weights(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Draw float32 weights from N(0, std^2)."""
    return rng.normal(0.0, std, size=shape).astype(np.float32)


def finish_model(
    graph: onnx.GraphProto,
    extra_opsets: dict[str, int] | None = None,
    functions: list[onnx.FunctionProto] | None = None,
) -> onnx.ModelProto:
    """Wrap a graph into a model with the standard opset/IR version and check it.

    The full check (with strict shape inference) runs here so that a broken builder
    fails at build time rather than inside a converter test.
    """
    opset_imports = [helper.make_opsetid("", OPSET)]
    for domain, version in sorted((extra_opsets or {}).items()):
        opset_imports.append(helper.make_opsetid(domain, version))
    model = helper.make_model(
        graph,
        opset_imports=opset_imports,
        functions=functions or [],
        producer_name=PRODUCER_NAME,
        producer_version="1",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def output_dir_argument(args: list[str], usage: str) -> Path | None:
    """Return the one OUT_DIR argument of a ``python -m testkit.models...`` command, created.

    With any other number of arguments, print ``usage`` to stderr and return None (exit 2).
    """
    if len(args) != 1:
        print(f"usage: {usage}", file=sys.stderr)
        return None
    out_dir = Path(args[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def write_model_cli(
    build_model: Callable[[], onnx.ModelProto], argv: list[str] | None = None
) -> int:
    """Entry point shared by `python -m testkit.models.<name> OUT.onnx`: build the model and save
    it."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            f"usage: python -m testkit.models.<name> OUT.onnx (got {len(args)} arguments)",
            file=sys.stderr,
        )
        return 2
    out_path = Path(args[0])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(build_model().SerializeToString())
    return 0
