"""The cases of scripts/fuzz.py: seed models, the recipes hypothesis draws, and how a recipe
becomes files in a case folder and a command line.

A recipe is a small JSON-able dict (`family`, `seed`, `op`, parameters, `options`), so a failing
case can be printed, saved and replayed (`fuzz.py --replay CASE.json`). `recipes()` is the
hypothesis strategy of every family; `materialize(recipe, case_dir, seeds)` writes the case's
files (corrupted copies of the seeds, FIFOs, device nodes, symlinks, ...) and returns its argv
with what the run may not touch (`inputs`) and what a successful run may write (`outputs`).

Seeds are built once per run by `build_seeds` in a child process (it runs TensorFlow, which the
forking parent must not).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper

# -- seeds ---------------------------------------------------------------------------------------

ONNX_SEEDS = ("cnn", "transformer_block", "control_flow", "custom_op", "ext")
TF_GRAPH_SEEDS = ("conv_matmul", "while_loop_v1", "identity_n_add_n", "ref_variable")
TF_FILE_SEEDS = (*(f"{name}.pb" for name in TF_GRAPH_SEEDS), "conv_matmul.pbtxt", "meta.meta")
SAVED_MODEL_SEEDS = ("sm_tf1", "sm_nested", "sm_keras")
#: A string long enough to make a backtracking regex engine run for ages on `(a|aa)*b`.
LONG_NAME = "a" * 64


def build_seeds(seed_dir: Path) -> None:
    """Write the seed models (valid fp32 ONNX models, TF GraphDefs, a MetaGraph, SavedModels)
    and seeds.json (each TF seed's fetches)."""
    import tensorflow as tf
    from google.protobuf import text_format

    from amp_rewriter.formats.onnx.validate import random_inputs
    from testkit.models import BUILDERS, many_weights, tf_graphs, tf_saved_models

    onnx_dir = seed_dir / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    for name, build in BUILDERS.items():
        model = build()
        (onnx_dir / f"{name}.onnx").write_bytes(model.SerializeToString())
        np.savez(onnx_dir / f"{name}.npz", allow_pickle=False, **random_inputs(model))
    # cnn with every initializer in model.onnx.data beside it
    ext = onnx_dir / "ext"
    ext.mkdir(exist_ok=True)
    model = BUILDERS["cnn"]()
    onnx.save_model(model, str(ext / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=0)
    np.savez(onnx_dir / "ext.npz", allow_pickle=False, **random_inputs(model))
    # a cnn whose first node has a long name, for --keep-node patterns that backtrack
    model = BUILDERS["cnn"]()
    model.graph.node[0].name = LONG_NAME
    (onnx_dir / "long_name.onnx").write_bytes(model.SerializeToString())
    # many small weights: inline, and with one external data file per tensor
    many = many_weights.build_model(MANY_TENSORS, MANY_SIDE)
    (onnx_dir / "many.onnx").write_bytes(many.SerializeToString())
    (onnx_dir / "many_ext").mkdir(exist_ok=True)
    onnx.save_model(many, str(onnx_dir / "many_ext" / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=False, size_threshold=0)
    np.savez(onnx_dir / "many.npz", x=np.ones((MANY_SIDE, MANY_SIDE), np.float32))

    tf_dir = seed_dir / "tf"
    tf_dir.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"fetches": {}}
    for name in TF_GRAPH_SEEDS:
        graph_def, outputs = tf_graphs.BUILDERS[name]()
        (tf_dir / f"{name}.pb").write_bytes(graph_def.SerializeToString(deterministic=True))
        info["fetches"][f"{name}.pb"] = outputs
        if name == "conv_matmul":
            (tf_dir / f"{name}.pbtxt").write_text(text_format.MessageToString(graph_def))
            info["fetches"][f"{name}.pbtxt"] = outputs
    (tf_dir / "meta.meta").write_bytes(
        tf_graphs.meta_graph_with_saver().SerializeToString(deterministic=True))
    info["fetches"]["meta.meta"] = ["y"]
    np.savez(tf_dir / "conv_matmul.npz", allow_pickle=False,
             **{"x": np.zeros([max(int(d.size), 2) for d in
                               _placeholder_shape(tf_dir / "conv_matmul.pb")], np.float32)})
    exporters = {"sm_tf1": tf_saved_models.export_tf1_simple_save,
                 "sm_nested": tf_saved_models.export_nested_module,
                 "sm_keras": tf_saved_models.export_keras_cnn}
    for name, export in exporters.items():
        export(seed_dir / "saved" / name)
    (seed_dir / "seeds.json").write_text(json.dumps(info, indent=1))
    del tf


#: The many-weights seed: this many [MANY_SIDE, MANY_SIDE] float32 weights, each 2 KiB in
#: fp16, so each goes to its own file with --external-data per-tensor.
MANY_TENSORS = 300
MANY_SIDE = 32


def _placeholder_shape(path: Path):
    from tensorflow.core.framework import graph_pb2

    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(path.read_bytes())
    node = next(nd for nd in graph_def.node if nd.op == "Placeholder")
    return node.attr["shape"].shape.dim


# -- recipes (hypothesis strategies) -----------------------------------------------------------

_position = st.integers(0, 1 << 20)
_bytes_op = st.one_of(
    st.tuples(st.just("truncate"), _position),
    st.tuples(st.just("flip"), st.lists(st.tuples(_position, st.integers(0, 7)), min_size=1,
                                        max_size=8)),
    st.tuples(st.just("overwrite"), _position, st.binary(min_size=1, max_size=12).map(bytes.hex)),
    st.tuples(st.just("insert"), _position, st.binary(min_size=1, max_size=12).map(bytes.hex)),
    st.tuples(st.just("delete"), _position, st.integers(1, 64)),
    st.tuples(st.just("duplicate"), _position, st.integers(1, 64)),
    st.tuples(st.just("zero"), _position, st.integers(1, 256)),
    st.tuples(st.just("varint"), _position, st.sampled_from(["ff" * 9 + "01", "ff" * 4 + "0f",
                                                             "80" * 10, "7f"])),
)

ONNX_OPTIONS = (
    ["--target", "bf16"], ["--backend", "ort-cpu"], ["--validate"], ["--report", "report.json"],
    ["--keep-node", "conv.*"], ["--keep-node", "(a|aa)*b"], ["--clamp"], ["--no-keep-io-types"],
    ["--quiet"], ["--deny", "Softmax"], ["--allow", "Einsum"], ["--clear", "Relu"],
    ["--rtol", "0.5"], ["--validate", "--rtol", "0"],
)
TF_OPTIONS = (
    ["--target", "bf16"], ["--backend", "tf-cpu"], ["--validate"], ["--report", "report.json"],
    ["--keep-node", ".*mm.*"], ["--keep-node", "(a|aa)*b"], ["--clamp"], ["--no-keep-io-types"],
    ["--quiet"], ["--deny", "MatMul"], ["--allow", "Relu"],
)
_onnx_options = st.lists(st.sampled_from(ONNX_OPTIONS), max_size=3, unique_by=tuple)
_tf_options = st.lists(st.sampled_from(TF_OPTIONS), max_size=3, unique_by=tuple)

ONNX_PROTO_OPS = (
    "dims_huge", "dims_negative", "raw_truncate", "raw_extend", "splat_huge", "data_type",
    "dangling_input", "self_loop", "reverse_nodes", "duplicate_output", "output_unproduced",
    "no_outputs", "opset_version", "opset_domain", "ir_version", "cast_to", "attr_type",
    "op_type", "drop_attrs", "nested_if", "invalid_utf8_name", "recursive_function",
    "value_info_type", "duplicate_initializer", "input_shape_huge", "graph_attr", "graphs_attr",
    "empty_graph", "typed_data_count", "segment", "constant_node_huge", "loop_body_arity",
    "initializer_as_input", "string_initializer", "attr_ints_huge",
)
ONNX_EXTERNAL_OPS = (
    "escape_parent", "absolute", "symlink_outside", "symlink_dev_zero", "fifo", "directory",
    "missing", "offset_past_end", "length_past_end", "offset_text", "length_negative",
    "nul_in_location", "drive_letter", "empty_location", "unknown_key", "data_truncated",
    "data_extended", "symlink_loop", "backslash", "dims_huge",
)
TF_PROTO_OPS = (
    "recursion_direct", "recursion_mutual", "recursion_call_attr", "recursion_while_body",
    "recursion_nested_attr", "const_huge_compact", "const_huge_empty", "const_content_short",
    "const_too_many_values", "const_negative_dim", "const_unknown_rank", "const_dtype_mismatch",
    "const_unknown_dtype", "addn_huge", "addn_negative", "addn_mismatch", "split_huge",
    "identity_n_list", "dangling_input", "port_huge", "control_missing", "self_cycle",
    "two_cycle", "duplicate_name", "attr_T_int", "attr_T_unknown", "attr_T_missing",
    "unknown_op", "unknown_op_port_huge", "function_polymorphic", "function_ret_missing",
    "function_dangling", "placeholder_huge_shape", "invalid_utf8_name", "empty_name",
    "output_shapes_huge", "const_value_missing", "string_const_huge", "const_huge_matmul",
)
SAVED_MODEL_OPS = (
    "pb_bytes", "variables_symlink_dev_zero", "variables_symlink_outside", "variables_fifo",
    "index_missing", "index_bytes", "data_bytes", "data_truncated", "fingerprint_bytes",
    "asset_fifo", "dir_symlink_loop", "char_device", "socket", "recursion", "pbtxt_garbage",
    "no_meta_graphs", "empty_pb", "pb_is_fifo", "symlink_inside_ok", "const_huge",
)
CLI_MISUSES = (
    "no_args", "unknown_command", "convert_no_output", "typo_flag", "target_missing_value",
    "target_bad", "backend_bad", "backend_other_format", "outputs_onnx", "training_onnx",
    "loss_without_training", "allow_deny_conflict", "unknown_op_override", "rtol_bad",
    "inputs_without_validate", "inputs_hostile", "config_hostile", "keep_node_hostile",
    "help", "extra_positional", "training_flags_tf", "outputs_bad_tf", "check_rtol",
    "explain_options_on_report",
)
PATH_CASES = (
    "output_same", "output_dot", "output_dotdot", "output_absolute", "output_symlink_to_input",
    "output_hardlink_to_input", "output_trailing_slash", "output_is_data_file",
    "output_is_saved_model", "output_inside_saved_model", "output_symlink_outside",
    "output_missing_folder", "output_is_dir", "output_is_fifo", "output_is_device",
    "output_exists_failure", "input_fifo", "input_device", "input_dev_zero", "input_socket",
    "input_dir_no_model", "input_symlink_loop", "input_empty", "input_bad_utf8_name",
    "report_is_input", "report_is_output", "report_is_data_file", "report_is_fifo",
    "report_is_dir", "report_in_saved_model", "report_missing_folder",
)
EXPLAIN_CHECK_CASES = (
    "explain_garbage_report", "explain_schema_report", "explain_deep_json", "explain_fifo",
    "explain_missing_node", "explain_valid_report", "explain_model", "check_garbage",
    "check_fifo", "check_reference_garbage", "check_reference_fifo", "check_valid",
    "check_reference", "check_tf", "check_saved_model", "explain_tf_model",
    "explain_saved_model", "explain_report_bad_utf8", "check_reference_tf",
)

#: Issue 35: every path a run writes against everything it reads and writes, in each layout.
COLLISION_CASES = (
    "report_is_data", "report_link_to_data", "report_dotdot_data", "report_absolute_data",
    "auto_report_is_data", "report_is_output", "report_trailing_slash", "report_is_inputs",
    "report_is_config", "json_is_model", "json_is_data", "json_is_config", "json_is_inputs",
    "json_link_to_data", "json_trailing_slash", "json_fifo", "json_missing_folder",
    "json_is_dir", "json_valid", "report_into_output_saved_model", "output_data_is_input_data",
    "check_report_is_data", "check_report_is_reference_data", "check_report_valid",
    "auto_report_is_metric",
)
#: Issue 35: calibration inputs of --auto and diagnose.
CALIBRATION_CASES = (
    "fifo_npz", "fifo_json", "dev_zero_json", "dev_zero_npz", "bomb_npz", "bomb_wrong_shape",
    "object_npz", "deep_json", "empty_zip_json", "object_json", "truncated_npy_json",
    "garbage_base64_json", "folder_with_fifo", "folder_with_dir_npz", "empty_folder",
    "nan_values", "wrong_dtype", "missing_input", "extra_input", "member_not_npy",
    "json_not_list", "json_is_dir", "valid_npz", "valid_folder", "valid_json", "valid_old_json",
    "valid_compressed", "many_batches",
)
#: Issue 35: a user --metric that misbehaves (and three that do not).
METRIC_CASES = (
    "exits", "exits_zero", "raises", "nan", "inf", "negative_inf", "huge_int", "string",
    "none", "array3", "bool", "writes_reference", "keyerror", "recursion", "import_exits",
    "import_raises", "syntax_error", "not_callable", "missing_function", "file_is_fifo",
    "file_is_dev_zero", "valid", "valid_numpy_scalar", "valid_by_module_name",
)
#: Issue 35: layouts with hundreds of data files, over earlier outputs, colliding.
MANY_TENSOR_CASES = (
    "per_tensor", "single", "inline", "default", "per_tensor_over_single",
    "single_over_per_tensor", "per_tensor_report_collision", "per_tensor_input_to_single",
    "per_tensor_input_to_per_tensor", "per_tensor_input_same_folder",
    "per_tensor_output_is_input_data", "per_tensor_validate", "per_tensor_threshold",
    "per_tensor_diagnose", "per_tensor_check",
)

_param = st.integers(0, 1 << 16)


def family_strategies() -> dict[str, st.SearchStrategy[dict]]:
    """Each family's recipe strategy; `materialize` turns a recipe into a case."""
    onnx_seed = st.sampled_from(ONNX_SEEDS)
    return {
        "onnx_bytes": st.fixed_dictionaries({
            "family": st.just("onnx_bytes"), "seed": onnx_seed,
            "target_file": st.sampled_from(["model", "data"]),
            "ops": st.lists(_bytes_op, min_size=1, max_size=3), "options": _onnx_options}),
        "onnx_proto": st.fixed_dictionaries({
            "family": st.just("onnx_proto"), "seed": onnx_seed,
            "op": st.sampled_from(ONNX_PROTO_OPS), "k": _param, "n": _param,
            "options": _onnx_options}),
        "onnx_external": st.fixed_dictionaries({
            "family": st.just("onnx_external"), "op": st.sampled_from(ONNX_EXTERNAL_OPS),
            "k": _param, "options": _onnx_options}),
        "tf_bytes": st.fixed_dictionaries({
            "family": st.just("tf_bytes"), "seed": st.sampled_from(TF_FILE_SEEDS),
            "ops": st.lists(_bytes_op, min_size=1, max_size=3), "options": _tf_options,
            "fetch": st.booleans()}),
        "tf_proto": st.fixed_dictionaries({
            "family": st.just("tf_proto"),
            "seed": st.sampled_from(TF_FILE_SEEDS[:4] + ("meta.meta",)),
            "op": st.sampled_from(TF_PROTO_OPS), "k": _param, "n": _param,
            "options": _tf_options, "fetch": st.booleans()}),
        "saved_model": st.fixed_dictionaries({
            "family": st.just("saved_model"), "seed": st.sampled_from(SAVED_MODEL_SEEDS),
            "op": st.sampled_from(SAVED_MODEL_OPS), "k": _param,
            "ops": st.lists(_bytes_op, min_size=1, max_size=2),
            "options": st.lists(st.sampled_from([["--target", "bf16"], ["--validate"],
                                                 ["--report", "report.json"], ["--quiet"]]),
                                max_size=2, unique_by=tuple)}),
        "cli_misuse": st.fixed_dictionaries({
            "family": st.just("cli_misuse"), "op": st.sampled_from(CLI_MISUSES), "k": _param,
            "tf": st.booleans()}),
        "paths": st.fixed_dictionaries({
            "family": st.just("paths"), "op": st.sampled_from(PATH_CASES), "k": _param,
            "kind": st.sampled_from(["onnx", "ext", "tf", "saved_model"])}),
        "explain_check": st.fixed_dictionaries({
            "family": st.just("explain_check"), "op": st.sampled_from(EXPLAIN_CHECK_CASES),
            "k": _param}),
        "collisions": st.fixed_dictionaries({
            "family": st.just("collisions"), "op": st.sampled_from(COLLISION_CASES), "k": _param,
            "layout": st.sampled_from(LAYOUT_CHOICES)}),
        "calibration": st.fixed_dictionaries({
            "family": st.just("calibration"), "op": st.sampled_from(CALIBRATION_CASES),
            "k": _param, "command": st.sampled_from(["diagnose", "diagnose_json", "auto"])}),
        "metric": st.fixed_dictionaries({
            "family": st.just("metric"), "op": st.sampled_from(METRIC_CASES), "k": _param,
            "report": st.booleans()}),
        "many_tensors": st.fixed_dictionaries({
            "family": st.just("many_tensors"), "op": st.sampled_from(MANY_TENSOR_CASES),
            "k": _param}),
        "valid": st.fixed_dictionaries({
            "family": st.just("valid"),
            "seed": st.sampled_from(ONNX_SEEDS + TF_FILE_SEEDS + SAVED_MODEL_SEEDS),
            "options": st.lists(st.sampled_from(ONNX_OPTIONS[:2] + TF_OPTIONS[1:2] + (
                ["--validate"], ["--report", "report.json"], ["--clamp"], ["--quiet"])),
                max_size=3, unique_by=tuple)}),
    }


def recipes() -> st.SearchStrategy[dict]:
    """Every family's recipes, the family drawn first so that each gets its share."""
    strategies = family_strategies()
    return st.sampled_from(sorted(strategies)).flatmap(strategies.__getitem__)


# -- case files --------------------------------------------------------------------------------

@dataclass
class CaseFiles:
    """What a recipe became: the command line (run in the case folder) and the paths (relative to
    it) the run must leave alone or may write."""

    argv: list[str]
    #: Paths whose content is the run's input (compared before/after, whatever the outcome).
    inputs: list[str] = field(default_factory=list)
    #: Paths a successful run may create or replace (a folder: everything under it).
    outputs: list[str] = field(default_factory=list)


@dataclass
class Seeds:
    """The seed folder and what seeds.json says."""

    root: Path
    fetches: dict[str, list[str]]

    @classmethod
    def load(cls, root: Path) -> Seeds:
        info = json.loads((root / "seeds.json").read_text())
        return cls(root, info["fetches"])

    def onnx(self, name: str) -> Path:
        return self.root / "onnx" / f"{name}.onnx"

    def tf(self, name: str) -> Path:
        return self.root / "tf" / name

    def saved_model(self, name: str) -> Path:
        return self.root / "saved" / name


def mutate_bytes(data: bytes, ops: list) -> bytes:
    """Apply byte-level corruptions (positions wrap around the data's length)."""
    buf = bytearray(data)
    for op in ops:
        kind = op[0]
        if not buf:
            buf = bytearray(b"\x00")
        pos = op[1] % len(buf) if kind != "flip" else 0
        if kind == "truncate":
            del buf[pos:]
        elif kind == "flip":
            for where, bit in op[1]:
                buf[where % len(buf)] ^= 1 << bit
        elif kind == "overwrite":
            chunk = bytes.fromhex(op[2])
            buf[pos:pos + len(chunk)] = chunk
        elif kind == "insert" or kind == "varint":
            buf[pos:pos] = bytes.fromhex(op[2])
        elif kind == "delete":
            del buf[pos:pos + op[2]]
        elif kind == "duplicate":
            buf[pos:pos] = buf[pos:pos + op[2]]
        elif kind == "zero":
            end = min(len(buf), pos + op[2])
            buf[pos:end] = bytes(end - pos)
    return bytes(buf)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _char_device(path: Path) -> None:
    """A character device node like /dev/null (its own node in the case folder, so a run that
    replaced it would replace nothing of the system's); a FIFO where mknod is not allowed."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError):
        os.mkfifo(path)


def _socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
    except OSError:  # path too long for a socket address
        os.mkfifo(path)
    finally:
        sock.close()


def _with_options(argv: list[str], options: list[list[str]]) -> tuple[list[str], list[str]]:
    """argv plus the option snippets; the report path joins the outputs."""
    outputs = []
    for snippet in options:
        argv = argv + list(snippet)
        if snippet[0] == "--report":
            outputs.append(snippet[1])
    return argv, outputs


def _copy_seed_onnx(seeds: Seeds, name: str, case: Path) -> tuple[str, list[str]]:
    """Copy an ONNX seed into the case folder: (model path, input paths)."""
    if name == "ext":
        shutil.copytree(seeds.root / "onnx" / "ext", case / "model")
        return "model/model.onnx", ["model"]
    shutil.copy(seeds.onnx(name), case / "model.onnx")
    return "model.onnx", ["model.onnx"]


def materialize(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    """Write the recipe's files into `case` (an empty folder) and return its command."""
    family = recipe["family"]
    return _FAMILIES[family](recipe, case, seeds)


# -- ONNX --------------------------------------------------------------------------------------

def _onnx_bytes(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    model, inputs = _copy_seed_onnx(seeds, recipe["seed"], case)
    target = case / model
    if recipe["seed"] == "ext" and recipe["target_file"] == "data":
        target = case / "model" / "model.onnx.data"
    target.write_bytes(mutate_bytes(target.read_bytes(), recipe["ops"]))
    argv, reports = _with_options(["convert", model, "out.onnx"], recipe["options"])
    return CaseFiles(argv, inputs, ["out.onnx", "out.onnx.data", *reports])


def _load_seed_model(seeds: Seeds, name: str) -> onnx.ModelProto:
    if name == "ext":
        return onnx.load(str(seeds.root / "onnx" / "ext" / "model.onnx"), load_external_data=False)
    return onnx.load(str(seeds.onnx(name)))


def _mutate_onnx(model: onnx.ModelProto, op: str, k: int, n: int) -> bytes | None:
    """Apply a structural corruption; returns raw bytes when it patched the serialized form."""
    graph = model.graph
    nodes = graph.node
    inits = [t for t in graph.initializer]
    node = nodes[k % len(nodes)] if len(nodes) else None
    init = inits[k % len(inits)] if inits else None
    if op == "dims_huge" and init is not None:
        init.ClearField("dims")
        init.dims.extend([40000, 30000 + n % 7])
    elif op == "dims_negative" and init is not None:
        init.dims[0 if init.dims else 0:1] = [-(n % 5 + 1)]
    elif op == "raw_truncate" and init is not None:
        init.raw_data = init.raw_data[: len(init.raw_data) // 2]
    elif op == "raw_extend" and init is not None:
        init.raw_data = init.raw_data + bytes(n % 64 + 1)
    elif op == "splat_huge" and init is not None:
        init.ClearField("raw_data")
        init.ClearField("dims")
        init.data_type = TensorProto.FLOAT
        init.float_data.append(1.0)
        init.dims.extend([40000, 30000])
    elif op == "data_type" and init is not None:
        init.data_type = [999, 0, TensorProto.STRING, TensorProto.INT64, TensorProto.DOUBLE,
                          TensorProto.FLOAT16, 28, 10000][n % 8]
    elif op == "dangling_input" and node is not None and node.input:
        node.input[0] = "does_not_exist"
    elif op == "self_loop" and node is not None and node.input and node.output:
        node.input[0] = node.output[0]
    elif op == "reverse_nodes":
        reversed_nodes = list(reversed(nodes))
        graph.ClearField("node")
        graph.node.extend(reversed_nodes)
    elif op == "duplicate_output" and len(nodes) > 1:
        nodes[k % len(nodes)].output[0] = nodes[(k + 1) % len(nodes)].output[0]
    elif op == "output_unproduced" and graph.output:
        graph.output[0].name = "produced_by_nobody"
    elif op == "no_outputs":
        graph.ClearField("output")
    elif op == "opset_version":
        model.opset_import[0].version = [0, 1, 6, 999, -5, 1 << 40][n % 6]
    elif op == "opset_domain":
        model.opset_import.add(domain=["com.microsoft", "\u00e9", "ai.onnx", ""][n % 4],
                               version=[1, -1, 99999][n % 3])
    elif op == "ir_version":
        model.ir_version = [0, 1, 3, 100, -1, 1 << 40][n % 6]
    elif op == "cast_to":
        cast = helper.make_node("Cast", [graph.input[0].name], ["cast_out"], name="bad_cast",
                                to=[999, 0, TensorProto.STRING, -1][n % 4])
        graph.node.insert(0, cast)
        graph.output.add().name = "cast_out"
    elif op == "attr_type" and node is not None and node.attribute:
        attr = node.attribute[n % len(node.attribute)]
        if n % 5 == 4:
            # An out-of-range type: protobuf >= 5 refuses to set one, and a parser keeps it as an
            # unknown field (onnx's enums are closed), so what a reader sees is no type at all.
            attr.ClearField("type")
            attr.MergeFromString(b"\xa0\x01\x63")  # field 20 (type), varint 99
        else:
            attr.type = [onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING,
                         onnx.AttributeProto.GRAPH, onnx.AttributeProto.TENSOR][n % 5]
    elif op == "op_type" and node is not None:
        node.op_type = ["", "NoSuchOp", "Conv", "\u00e9\u00e8", "If", "Loop", "Scan"][n % 7]
    elif op == "drop_attrs" and node is not None:
        node.ClearField("attribute")
    elif op == "nested_if":
        return _nested_if(depth=[3, 10, 20, 30, 40, 400][n % 6])
    elif op == "invalid_utf8_name" and node is not None:
        node.name = "\x01PLACEHOLDER\x01"
        data = model.SerializeToString()
        invalid_utf8 = b"\xff\xfe\xc3(\xa0\xa1\xe2\x28\xa1\xf0\x28\x8c\xbc"
        return data.replace(b"\x01PLACEHOLDER\x01", invalid_utf8)
    elif op == "recursive_function":
        body = helper.make_node("Recurse", ["x"], ["y"], domain="local")
        function = helper.make_function("local", "Recurse", ["x"], ["y"], [body],
                                        [helper.make_opsetid("", 17)])
        model.functions.append(function)
        model.opset_import.append(helper.make_opsetid("local", 1))
        call = helper.make_node("Recurse", [graph.input[0].name], ["recursed"], domain="local",
                                name="call_recurse")
        graph.node.insert(0, call)
        graph.output.add().name = "recursed"
    elif op == "value_info_type":
        info = graph.value_info.add()
        info.name = nodes[0].output[0] if len(nodes) else "v"
        info.type.tensor_type.elem_type = [999, 0, -3][n % 3]
        info.type.tensor_type.shape.dim.add().dim_value = -(n % 4)
    elif op == "duplicate_initializer" and init is not None:
        graph.initializer.append(init)
    elif op == "input_shape_huge" and graph.input:
        shape = graph.input[0].type.tensor_type.shape  # a huge batch: the model stays valid
        if shape.dim:
            shape.dim[0].Clear()
            shape.dim[0].dim_value = [1 << 30, 1 << 40, 10**6][n % 3]
    elif op == "graph_attr" and node is not None:
        node.attribute.append(helper.make_attribute("body", helper.make_graph([], "g", [], [])))
    elif op == "graphs_attr" and node is not None:
        node.attribute.append(helper.make_attribute("branches",
                                                    [helper.make_graph([], "g", [], [])]))
    elif op == "empty_graph":
        graph.ClearField("node")
    elif op == "typed_data_count" and init is not None:
        init.ClearField("raw_data")
        init.data_type = TensorProto.FLOAT
        init.float_data.extend([1.0] * (n % 3))
    elif op == "segment" and init is not None:
        init.segment.begin = 0
        init.segment.end = n % 10
    elif op == "constant_node_huge":
        tensor = TensorProto(name="big", data_type=TensorProto.FLOAT, dims=[40000, 30000],
                             float_data=[1.0])
        graph.node.insert(0, helper.make_node("Constant", [], ["big_const"], value=tensor,
                                              name="big_constant"))
        graph.output.add().name = "big_const"
    elif op == "loop_body_arity":
        for nd in nodes:
            for attr in nd.attribute:
                if attr.type == onnx.AttributeProto.GRAPH and attr.g.input:
                    del attr.g.input[-1]
                    break
    elif op == "initializer_as_input" and init is not None:
        graph.input.add().name = init.name
        model.ir_version = 3
    elif op == "string_initializer" and init is not None:
        init.ClearField("raw_data")
        init.data_type = TensorProto.STRING
        init.string_data.extend([b"x"] * (n % 5))
    elif op == "attr_ints_huge" and node is not None:
        node.attribute.append(helper.make_attribute("pads", [1 << 62] * (n % 64 + 1)))
    return None


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _nested_if(depth: int) -> bytes:
    """A model whose If nodes nest `depth` deep, serialized by hand: protobuf's Python API
    refuses to build messages past its own depth limit, but a file can hold anything."""
    out_info = helper.make_tensor_value_info
    leaf = helper.make_graph([helper.make_node("Relu", ["x"], ["r0"])], "leaf", [],
                             [out_info("r0", TensorProto.FLOAT, [2])]).SerializeToString()
    inner = leaf
    for level in range(1, depth + 1):  # the else branch stays a leaf: linear in depth
        out = f"r{level}"
        node = helper.make_node("If", ["c"], [out]).SerializeToString()
        for name, graph in (("then_branch", inner), ("else_branch", leaf)):
            # AttributeProto: name = 1, g = 6, type = 20 (GRAPH = 5)
            attribute = _field(1, name.encode()) + _field(6, graph) + _varint(20 << 3) + b"\x05"
            node += _field(5, attribute)
        graph_head = helper.make_graph([], f"level{level}", [],
                                       [out_info(out, TensorProto.FLOAT, [2])])
        inner = graph_head.SerializeToString() + _field(1, node)
    top = helper.make_graph([], "nested", [out_info("x", TensorProto.FLOAT, [2]),
                                           out_info("c", TensorProto.BOOL, [])],
                            [out_info(f"r{depth}", TensorProto.FLOAT, [2])])
    model = helper.make_model(top, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    # The outermost If (the last level's node field) joins the top graph through a second
    # ModelProto.graph field (7), which a parser merges into the first.
    outermost = inner[len(graph_head.SerializeToString()):]
    return model.SerializeToString() + _field(7, outermost)


def _onnx_proto(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    model = _load_seed_model(seeds, recipe["seed"])
    patched = _mutate_onnx(model, recipe["op"], recipe["k"], recipe["n"])
    data = patched if patched is not None else model.SerializeToString()
    if recipe["seed"] == "ext":
        shutil.copytree(seeds.root / "onnx" / "ext", case / "model")
        (case / "model" / "model.onnx").write_bytes(data)
        path, inputs = "model/model.onnx", ["model"]
    else:
        (case / "model.onnx").write_bytes(data)
        path, inputs = "model.onnx", ["model.onnx"]
    argv, reports = _with_options(["convert", path, "out.onnx"], recipe["options"])
    return CaseFiles(argv, inputs, ["out.onnx", "out.onnx.data", *reports])


def _onnx_external(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    """The external-data cnn with its data file or location made hostile."""
    shutil.copytree(seeds.root / "onnx" / "ext", case / "model")
    outside = case / "outside"
    outside.mkdir()
    data = (case / "model" / "model.onnx.data").read_bytes()
    (outside / "secret.bin").write_bytes(data)
    model = onnx.load(str(case / "model" / "model.onnx"), load_external_data=False)
    tensors = [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    tensor = tensors[recipe["k"] % len(tensors)]
    entries = {e.key: e for e in tensor.external_data}
    op = recipe["op"]
    data_file = case / "model" / "model.onnx.data"

    def relocate(location: str) -> None:
        entries["location"].value = location

    if op == "escape_parent":
        relocate("../outside/secret.bin")
    elif op == "absolute":
        relocate(str(outside / "secret.bin"))
    elif op == "symlink_outside":
        (case / "model" / "link.data").symlink_to(outside / "secret.bin")
        relocate("link.data")
    elif op == "symlink_dev_zero":
        (case / "model" / "zero.data").symlink_to("/dev/zero")
        relocate("zero.data")
    elif op == "fifo":
        _fifo(case / "model" / "pipe.data")
        relocate("pipe.data")
    elif op == "directory":
        (case / "model" / "folder.data").mkdir()
        relocate("folder.data")
    elif op == "missing":
        relocate("missing.data")
    elif op == "offset_past_end":
        entries["offset"].value = str(len(data) + 1000)
    elif op == "length_past_end":
        entries["length"].value = str(len(data) * 2 + 7)
    elif op == "offset_text":
        entries["offset"].value = "12abc"
    elif op == "length_negative":
        entries["length"].value = "-16"
    elif op == "nul_in_location":
        relocate("model.onnx.data\x00.txt")
    elif op == "drive_letter":
        relocate("C:\\model.onnx.data")
    elif op == "empty_location":
        relocate("")
    elif op == "unknown_key":
        tensor.external_data.add(key="checksum", value="abc")
    elif op == "data_truncated":
        data_file.write_bytes(data[: len(data) // 3])
    elif op == "data_extended":
        data_file.write_bytes(data + bytes(100))
        for t in tensors:
            for e in t.external_data:
                if e.key == "length":
                    t.external_data.remove(e)
                    break
    elif op == "symlink_loop":
        (case / "model" / "loop_a").symlink_to("loop_b")
        (case / "model" / "loop_b").symlink_to("loop_a")
        relocate("loop_a")
    elif op == "backslash":
        relocate("..\\outside\\secret.bin")
    elif op == "dims_huge":
        tensor.ClearField("dims")
        tensor.dims.extend([1 << 20, 1 << 20])
    (case / "model" / "model.onnx").write_bytes(model.SerializeToString())
    argv, reports = _with_options(["convert", "model/model.onnx", "out.onnx"], recipe["options"])
    return CaseFiles(argv, ["model", "outside"], ["out.onnx", "out.onnx.data", *reports])


# -- TensorFlow --------------------------------------------------------------------------------

def _tf_argv(seeds: Seeds, seed: str, path: str, output: str, recipe: dict) -> tuple[list, list]:
    argv = ["convert", path, output]
    if recipe.get("fetch") and not seed.endswith(".meta"):
        argv += ["--outputs", ",".join(seeds.fetches.get(seed, ["y"]))]
    return _with_options(argv, recipe["options"])


def _tf_bytes(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    seed = recipe["seed"]
    data = seeds.tf(seed).read_bytes()
    if seed.endswith(".pbtxt"):
        data = _mutate_text(data, recipe["ops"])
    else:
        data = mutate_bytes(data, recipe["ops"])
    suffix = Path(seed).suffix
    (case / f"model{suffix}").write_bytes(data)
    argv, reports = _tf_argv(seeds, seed, f"model{suffix}", f"out{suffix}", recipe)
    return CaseFiles(argv, [f"model{suffix}"], [f"out{suffix}", *reports])


def _mutate_text(data: bytes, ops: list) -> bytes:
    """Text-format corruptions: byte ops, plus deep nesting and huge numbers now and then."""
    text = mutate_bytes(data, ops)
    first = ops[0]
    if first[0] == "zero" and first[2] % 4 == 0:
        depth = 50 + first[2] * 20
        return text + b"\nnode {" + b" attr { key: 'a' value { list { " * depth
    if first[0] == "delete" and first[2] % 3 == 0:
        return text.replace(b"size: ", b"size: 999999999999", 1)
    return text


def _parse_tf(seed: str, data: bytes):
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2

    if seed.endswith(".meta"):
        meta = meta_graph_pb2.MetaGraphDef()
        meta.ParseFromString(data)
        return meta, meta.graph_def
    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(data)
    return graph_def, graph_def


def _add_function(library, name: str, call: str | None, *, attr_call: str | None = None,
                  while_body: str | None = None):
    """A float -> float function `name` whose body calls `call` as an op, or through a `f`
    attribute (PartitionedCall), or as a While body."""
    from tensorflow.core.framework import types_pb2

    fdef = library.function.add()
    fdef.signature.name = name
    fdef.signature.input_arg.add(name="x", type=types_pb2.DT_FLOAT)
    fdef.signature.output_arg.add(name="y", type=types_pb2.DT_FLOAT)
    node = fdef.node_def.add(name="inner")
    if call is not None:
        node.op = call
        node.input.append("x")
        fdef.ret["y"] = "inner:y:0"
    elif attr_call is not None:
        node.op = "PartitionedCall"
        node.input.append("x")
        node.attr["Tin"].list.type.append(types_pb2.DT_FLOAT)
        node.attr["Tout"].list.type.append(types_pb2.DT_FLOAT)
        node.attr["f"].func.name = attr_call
        fdef.ret["y"] = "inner:output:0"
    elif while_body is not None:
        node.op = "While"
        node.input.append("x")
        node.attr["T"].list.type.append(types_pb2.DT_FLOAT)
        node.attr["cond"].func.name = while_body
        node.attr["body"].func.name = while_body
        fdef.ret["y"] = "inner:output:0"
    return fdef


def _call_node(graph_def, function: str, source: str, name: str = "call_fn"):
    node = graph_def.node.add(name=name, op=function)
    node.input.append(source)
    return node


def _first_float_source(graph_def) -> str:
    for nd in graph_def.node:
        if nd.op == "Placeholder":
            return nd.name
    return graph_def.node[0].name


def _mutate_tf(graph_def, op: str, k: int, n: int) -> bytes | None:
    """Structural corruptions of a GraphDef (a MetaGraph's graph_def is changed in place)."""
    from tensorflow.core.framework import types_pb2

    nodes = graph_def.node
    node = nodes[k % len(nodes)]
    source = _first_float_source(graph_def)
    library = graph_def.library
    if op == "recursion_direct":
        _add_function(library, "rec", "rec")
        _call_node(graph_def, "rec", source)
    elif op == "recursion_mutual":
        _add_function(library, "ping", "pong")
        _add_function(library, "pong", "ping")
        _call_node(graph_def, "ping", source)
    elif op == "recursion_call_attr":
        _add_function(library, "selfcall", None, attr_call="selfcall")
        call = graph_def.node.add(name="call_fn", op="PartitionedCall")
        call.input.append(source)
        call.attr["Tin"].list.type.append(types_pb2.DT_FLOAT)
        call.attr["Tout"].list.type.append(types_pb2.DT_FLOAT)
        call.attr["f"].func.name = "selfcall"
    elif op == "recursion_while_body":
        _add_function(library, "loop_fn", None, while_body="loop_fn")
        _call_node(graph_def, "loop_fn", source)
    elif op == "recursion_nested_attr":
        fdef = _add_function(library, "outer", None, attr_call="helper")
        fdef.node_def[0].attr["f"].func.attr["inner"].func.name = "outer"
        _add_function(library, "helper", "Identity")
        _call_node(graph_def, "outer", source)
    elif op == "const_huge_matmul":
        # a valid graph: x [?, 40000] @ a 40000x30000 fill stored as one value
        big_x = graph_def.node.add(name="big_x", op="Placeholder")
        big_x.attr["dtype"].type = types_pb2.DT_FLOAT
        big_x.attr["shape"].shape.unknown_rank = True
        fill = graph_def.node.add(name="big_fill", op="Const")
        fill.attr["dtype"].type = types_pb2.DT_FLOAT
        fill.attr["value"].tensor.dtype = types_pb2.DT_FLOAT
        fill.attr["value"].tensor.float_val.append([0.5, 1e-9, 1e6][n % 3])
        for size in (40000, 30000):
            fill.attr["value"].tensor.tensor_shape.dim.add().size = size
        matmul = graph_def.node.add(name="big_mm", op="MatMul")
        matmul.input.extend(["big_x", "big_fill"])
        matmul.attr["T"].type = types_pb2.DT_FLOAT
        relu = graph_def.node.add(name="big_out", op="Relu")
        relu.input.append("big_mm")
        relu.attr["T"].type = types_pb2.DT_FLOAT
    elif op.startswith("const_") or op == "string_const_huge":
        _mutate_const(graph_def, op, k, n)
    elif op == "addn_huge":
        add = graph_def.node.add(name="addn", op="AddN")
        add.input.append(source)
        add.attr["N"].i = [10**9, 1 << 40, 1 << 62][n % 3]
        add.attr["T"].type = types_pb2.DT_FLOAT
    elif op == "addn_negative":
        add = graph_def.node.add(name="addn", op="AddN")
        add.input.append(source)
        add.attr["N"].i = -(n % 1000 + 1)
        add.attr["T"].type = types_pb2.DT_FLOAT
    elif op == "addn_mismatch":
        add = graph_def.node.add(name="addn", op="AddN")
        add.input.extend([source] * (n % 4 + 1))
        add.attr["N"].i = n % 4 + 3
        add.attr["T"].type = types_pb2.DT_FLOAT
    elif op == "split_huge":
        axis = graph_def.node.add(name="split_axis", op="Const")
        axis.attr["dtype"].type = types_pb2.DT_INT32
        axis.attr["value"].tensor.dtype = types_pb2.DT_INT32
        axis.attr["value"].tensor.int_val.append(0)
        split = graph_def.node.add(name="split", op="Split")
        split.input.extend(["split_axis", source])
        split.attr["num_split"].i = [10**9, 70000, 1 << 40][n % 3]
        split.attr["T"].type = types_pb2.DT_FLOAT
    elif op == "identity_n_list":
        ident = graph_def.node.add(name="idn", op="IdentityN")
        ident.input.append(source)
        ident.attr["T"].list.type.extend([types_pb2.DT_FLOAT] * (n % 100000 + 2))
    elif op == "dangling_input":
        node.input.append("no_such_node")
    elif op == "port_huge":
        node.input.append(f"{source}:{[10**9, 1 << 40, 10**30][n % 3]}")
    elif op == "control_missing":
        node.input.append("^no_such_node")
    elif op == "self_cycle":
        node.input.append(node.name)
    elif op == "two_cycle" and len(nodes) > 1:
        other = nodes[(k + 1) % len(nodes)]
        node.input.append(other.name)
        other.input.append(node.name)
    elif op == "duplicate_name" and len(nodes) > 1:
        nodes[(k + 1) % len(nodes)].name = node.name
    elif op == "attr_T_int":
        for nd in nodes:
            if "T" in nd.attr:
                nd.attr["T"].i = 7
                break
    elif op == "attr_T_unknown":
        for nd in nodes:
            if "T" in nd.attr:
                nd.attr["T"].type = [999, 0, 120, 201][n % 4]
                break
    elif op == "attr_T_missing":
        for nd in nodes:
            if "T" in nd.attr:
                del nd.attr["T"]
                break
    elif op == "unknown_op":
        node.op = ["NoSuchOp", "", "Const", "Placeholder"][n % 4]
    elif op == "unknown_op_port_huge":
        custom = graph_def.node.add(name="custom", op="MyCustomOp")
        custom.input.append(source)
        reader = graph_def.node.add(name="reader", op="Identity")
        reader.input.append(f"custom:{[10**9, 70000, 3][n % 3]}")
        reader.attr["T"].type = types_pb2.DT_FLOAT
    elif op == "function_polymorphic":
        fdef = _add_function(library, "poly", "Identity")
        fdef.signature.input_arg[0].type = 0
        fdef.signature.input_arg[0].type_attr = "T"
        _call_node(graph_def, "poly", source)
    elif op == "function_ret_missing":
        fdef = _add_function(library, "badret", "Identity")
        fdef.node_def[0].attr["T"].type = types_pb2.DT_FLOAT
        fdef.ret["y"] = "nowhere:output:0"
        _call_node(graph_def, "badret", source)
    elif op == "function_dangling":
        fdef = _add_function(library, "dangle", "Identity")
        fdef.node_def[0].attr["T"].type = types_pb2.DT_FLOAT
        fdef.node_def[0].input[0] = "ghost:output:0"
        _call_node(graph_def, "dangle", source)
    elif op == "placeholder_huge_shape":
        for nd in nodes:
            if nd.op == "Placeholder" and nd.attr["shape"].shape.dim:
                nd.attr["shape"].shape.dim[0].size = [1 << 30, 1 << 40, 10**6][n % 3]
                break
    elif op == "invalid_utf8_name":
        node.name = "\x01PLACEHOLDER\x01"
        return b"\x01PLACEHOLDER\x01"
    elif op == "empty_name":
        node.name = ""
    elif op == "output_shapes_huge":
        custom = graph_def.node.add(name="custom", op="MyCustomOp")
        custom.input.append(source)
        for _ in range(n % 2000 + 1):
            custom.attr["_output_shapes"].list.shape.add()
    return None


def _mutate_const(graph_def, op: str, k: int, n: int) -> None:
    from tensorflow.core.framework import types_pb2

    consts = [nd for nd in graph_def.node if nd.op == "Const"
              and nd.attr["dtype"].type == types_pb2.DT_FLOAT]
    if not consts or op == "string_const_huge":
        const = graph_def.node.add(name="new_const", op="Const")
        dtype = types_pb2.DT_STRING if op == "string_const_huge" else types_pb2.DT_FLOAT
        const.attr["dtype"].type = dtype
        const.attr["value"].tensor.dtype = dtype
        if op == "string_const_huge":
            const.attr["value"].tensor.string_val.append(b"x")
            for size in (40000, 30000):
                const.attr["value"].tensor.tensor_shape.dim.add().size = size
            return
        const.attr["value"].tensor.float_val.append(1.0)
        consts = [const]
    const = consts[k % len(consts)]
    tensor = const.attr["value"].tensor
    shape = tensor.tensor_shape
    if op in ("const_huge_compact", "const_huge_empty"):
        content = np.frombuffer(tensor.tensor_content, np.float32) if tensor.tensor_content \
            else np.asarray(tensor.float_val, np.float32)
        tensor.ClearField("tensor_content")
        tensor.ClearField("float_val")
        if op == "const_huge_compact":
            tensor.float_val.extend(content[: n % 4 + 1].tolist() or [1.0])
        shape.ClearField("dim")
        for size in (40000, 30000):
            shape.dim.add().size = size
    elif op == "const_content_short":
        values = np.ones(4, np.float32)
        tensor.ClearField("float_val")
        tensor.tensor_content = values.tobytes()[: 4 * (n % 4) + 1]
    elif op == "const_too_many_values":
        tensor.ClearField("tensor_content")
        shape.ClearField("dim")
        shape.dim.add().size = 2
        tensor.float_val.extend([1.0] * (n % 10 + 3))
    elif op == "const_negative_dim":
        shape.dim.add().size = -(n % 3 + 1)
    elif op == "const_unknown_rank":
        shape.unknown_rank = True
    elif op == "const_dtype_mismatch":
        const.attr["dtype"].type = [types_pb2.DT_INT32, types_pb2.DT_HALF, 999][n % 3]
    elif op == "const_unknown_dtype":
        tensor.dtype = [999, 0, 23, 120][n % 4]
    elif op == "const_value_missing":
        del const.attr["value"]


def _tf_proto(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    seed = recipe["seed"]
    root, graph_def = _parse_tf(seed, seeds.tf(seed).read_bytes())
    marker = _mutate_tf(graph_def, recipe["op"], recipe["k"], recipe["n"])
    data = root.SerializeToString()
    if marker is not None:  # a name made invalid UTF-8 in the serialized bytes
        data = data.replace(marker, b"\xff\xfe\xc3(\xa0\xa1\xe2\x28\xa1\xf0\x28\x8c\xbc")
    suffix = Path(seed).suffix
    (case / f"model{suffix}").write_bytes(data)
    argv, reports = _tf_argv(seeds, seed, f"model{suffix}", f"out{suffix}", recipe)
    return CaseFiles(argv, [f"model{suffix}"], [f"out{suffix}", *reports])


def _saved_model(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    """A copy of a seed SavedModel with one hostile change."""
    from tensorflow.core.protobuf import saved_model_pb2

    sm = case / "sm"
    shutil.copytree(seeds.saved_model(recipe["seed"]), sm)
    outside = case / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"secret " * 40)
    variables = sorted((sm / "variables").glob("variables.data-*"))
    op = recipe["op"]
    if op == "pb_bytes":
        pb = sm / "saved_model.pb"
        pb.write_bytes(mutate_bytes(pb.read_bytes(), recipe["ops"]))
    elif op in ("variables_symlink_dev_zero", "variables_symlink_outside", "variables_fifo",
                "data_bytes", "data_truncated") and variables:
        target = variables[recipe["k"] % len(variables)]
        if op == "data_bytes":
            target.write_bytes(mutate_bytes(target.read_bytes(), recipe["ops"]))
        elif op == "data_truncated":
            target.write_bytes(target.read_bytes()[: recipe["k"] % max(1, target.stat().st_size)])
        else:
            target.unlink()
            if op == "variables_symlink_dev_zero":
                target.symlink_to("/dev/zero")
            elif op == "variables_symlink_outside":
                target.symlink_to(outside / "secret.bin")
            else:
                _fifo(target)
    elif op == "index_missing":
        (sm / "variables" / "variables.index").unlink(missing_ok=True)
    elif op == "index_bytes" and (sm / "variables" / "variables.index").exists():
        index = sm / "variables" / "variables.index"
        index.write_bytes(mutate_bytes(index.read_bytes(), recipe["ops"]))
    elif op == "fingerprint_bytes" and (sm / "fingerprint.pb").exists():
        fingerprint = sm / "fingerprint.pb"
        fingerprint.write_bytes(mutate_bytes(fingerprint.read_bytes(), recipe["ops"]))
    elif op == "asset_fifo":
        (sm / "assets").mkdir(exist_ok=True)
        assets = sorted((sm / "assets").iterdir())
        target = assets[0] if assets else sm / "assets" / "vocab.txt"
        target.unlink(missing_ok=True)
        _fifo(target)
    elif op == "dir_symlink_loop":
        (sm / "variables" / "loop").symlink_to("..")
    elif op == "char_device":
        _char_device(sm / "variables" / "device")
    elif op == "socket":
        _socket(sm / "sock")
    elif op in ("recursion", "no_meta_graphs", "const_huge"):
        saved = saved_model_pb2.SavedModel()
        saved.ParseFromString((sm / "saved_model.pb").read_bytes())
        if op == "no_meta_graphs":
            saved.ClearField("meta_graphs")
        elif op == "recursion":
            library = saved.meta_graphs[0].graph_def.library
            _add_function(library, "rec", "rec")
            if library.function:
                caller = library.function[0]
                call = caller.node_def.add(name="call_rec", op="rec")
                call.input.append(caller.signature.input_arg[0].name
                                  if caller.signature.input_arg else "missing")
        else:
            graph_def = saved.meta_graphs[0].graph_def
            _mutate_const(graph_def, "const_huge_compact", recipe["k"], 0)
        (sm / "saved_model.pb").write_bytes(saved.SerializeToString())
    elif op == "pbtxt_garbage":
        (sm / "saved_model.pb").unlink()
        (sm / "saved_model.pbtxt").write_bytes(
            mutate_bytes(b"saved_model_schema_version: 1\nmeta_graphs { meta_info_def { "
                         b"tags: 'serve' } graph_def { node { name: 'x' op: 'Placeholder' } } }",
                         recipe["ops"]))
    elif op == "empty_pb":
        (sm / "saved_model.pb").write_bytes(b"")
    elif op == "pb_is_fifo":
        (sm / "saved_model.pb").unlink()
        _fifo(sm / "saved_model.pb")
    elif op == "symlink_inside_ok" and variables:
        target = variables[0]
        moved = sm / "variables" / "real.data"
        target.rename(moved)
        target.symlink_to("real.data")
    argv, reports = _with_options(["convert", "sm", "out_sm"], recipe["options"])
    return CaseFiles(argv, ["sm", "outside"], ["out_sm", *reports])


# -- command lines -----------------------------------------------------------------------------

def _valid_input(case: Path, seeds: Seeds, tf: bool) -> tuple[str, list[str], str]:
    """A valid model in the case folder: (path, inputs, output path)."""
    if tf:
        shutil.copy(seeds.tf("conv_matmul.pb"), case / "model.pb")
        return "model.pb", ["model.pb"], "out.pb"
    shutil.copy(seeds.onnx("cnn"), case / "model.onnx")
    return "model.onnx", ["model.onnx"], "out.onnx"


def _hostile_npz(case: Path, seeds: Seeds, k: int, tf: bool) -> str:
    variant = k % 9
    path = case / "inputs.npz"
    good = seeds.root / ("tf/conv_matmul.npz" if tf else "onnx/cnn.npz")
    if variant == 0:
        path.write_bytes(b"not a zip file")
    elif variant == 1:
        np.savez(path, wrong_name=np.zeros(3, np.float32))
    elif variant == 2:
        with np.load(good) as data:
            np.savez(path, allow_pickle=False,
                     **{name: np.zeros(3, np.int64) for name in data.files})
    elif variant == 3:
        with np.load(good) as data:
            np.savez(path, allow_pickle=False,
                     **{name: np.zeros((2, 2, 2), np.float32) for name in data.files})
    elif variant == 4:
        _fifo(path)
    elif variant == 5:
        path.mkdir()
    elif variant == 6:
        np.savez(path, obj=np.array([{"a": 1}], dtype=object))
    elif variant == 7:
        data = good.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        with np.load(good) as data:
            np.savez(path, allow_pickle=False,
                     **{name: np.full(data[name].shape, np.nan, np.float32) for name in data.files})
    return "inputs.npz"


def _hostile_config(case: Path, k: int) -> str:
    variant = k % 8
    path = case / "lists.toml"
    if variant == 0:
        path.write_text("deny = [\n")
    elif variant == 1:
        path.write_text("deny = 'Softmax'\n")
    elif variant == 2:
        path.write_text("frobnicate = ['x']\n")
    elif variant == 3:
        _fifo(path)
    elif variant == 4:
        path.mkdir()
    elif variant == 5:
        path.write_bytes(b"\xff\xfe deny = []")
    elif variant == 6:
        path.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    else:
        path.write_text("allow = ['Relu']\ndeny = ['Relu']\nkeep_nodes = ['(?=x)']\n")
    return "lists.toml"


_HOSTILE_PATTERNS = ("(a|aa)*b", "(a*)*b", "(a+)+$b", "((a|a)*)*c", "(?=a)a", "(a)\\1",
                     "[", "a{100000}", "(?P<n>a)(?P=n)", "\\", ".*" * 500, "a{1000}{1000}")


def _cli_misuse(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    op, k, tf = recipe["op"], recipe["k"], recipe["tf"]
    model, inputs, out = _valid_input(case, seeds, tf)
    outputs = [out, out + ".data"]
    convert = ["convert", model, out]
    argv: list[str]
    if op == "no_args":
        argv = []
    elif op == "unknown_command":
        argv = [["frobnicate", model], ["Convert", model, out], ["--target", "fp16"]][k % 3]
    elif op == "convert_no_output":
        argv = ["convert", model]
    elif op == "typo_flag":
        argv = convert + [["--taget", "fp16"], ["--keepnode", "x"], ["--validat"],
                          ["-t", "fp16"], ["--report="]][k % 5]
    elif op == "target_missing_value":
        argv = convert + ["--target"]
    elif op == "target_bad":
        argv = convert + ["--target", ["fp8", "", "FP16", "fp16 ", "float16"][k % 5]]
    elif op == "backend_bad":
        argv = convert + ["--backend", ["foo", "", "ORT-CUDA", "tf-gpu;rm"][k % 4]]
    elif op == "backend_other_format":
        argv = convert + ["--backend", "ort-cuda" if tf else "tf-cpu"]
    elif op == "outputs_onnx":
        argv = convert + ["--outputs", ["y", "", ",", "a:b:c"][k % 4]]
    elif op == "training_onnx":
        argv = convert + ["--training"]
    elif op == "loss_without_training":
        argv = convert + [["--loss", "x"], ["--growth-interval", "5"], ["--loss-scale", "7"]][k % 3]
    elif op == "allow_deny_conflict":
        argv = convert + ["--allow", "Relu", "--deny", "Relu"]
    elif op == "unknown_op_override":
        argv = convert + [["--allow", "Reluu"], ["--deny", ""], ["--clear", "\u00e9"]][k % 3]
    elif op == "rtol_bad":
        argv = convert + ["--validate", "--rtol",
                          ["nan", "inf", "-1", "abc", "1e400", "-0", "NaN", "0x10"][k % 8]]
    elif op == "inputs_without_validate":
        argv = convert + ["--inputs", _hostile_npz(case, seeds, 1, tf)]
    elif op == "inputs_hostile":
        argv = convert + ["--validate", "--inputs", _hostile_npz(case, seeds, k, tf)]
        inputs.append("inputs.npz")
    elif op == "config_hostile":
        argv = convert + ["--config", _hostile_config(case, k)]
        inputs.append("lists.toml")
    elif op == "keep_node_hostile":
        if not tf:
            shutil.copy(seeds.root / "onnx" / "long_name.onnx", case / "model.onnx")
        argv = convert + ["--keep-node", _HOSTILE_PATTERNS[k % len(_HOSTILE_PATTERNS)]]
    elif op == "help":
        argv = [["--help"], ["convert", "--help"], ["check", "-h"]][k % 3]
    elif op == "extra_positional":
        argv = convert + ["extra.onnx"]
    elif op == "training_flags_tf":
        argv = convert + ["--training", *[["--loss", "nope"], ["--train-op", "nope"],
                                          ["--loss-scale", "abc"], ["--hysteresis", "-3"],
                                          ["--growth-factor", "nan"]][k % 5]]
    elif op == "outputs_bad_tf":
        argv = convert + ["--outputs", ["nope", "y:99", "y:-1", ":", "^y", "y:1e9"][k % 6]]
    elif op == "check_rtol":
        argv = ["check", model, "--rtol", ["nan", "-1", "abc"][k % 3]]
        outputs = []
    else:  # explain_options_on_report
        (case / "report.json").write_text("{}")
        argv = ["explain", "report.json", "x", "--target", "bf16"]
        inputs.append("report.json")
        outputs = []
    return CaseFiles(argv, inputs, outputs)


def _path_input(case: Path, seeds: Seeds, kind: str) -> tuple[str, list[str], str]:
    """A valid input of `kind` in the case folder: (path, inputs, a normal output path)."""
    if kind == "ext":
        shutil.copytree(seeds.root / "onnx" / "ext", case / "model")
        return "model/model.onnx", ["model"], "out.onnx"
    if kind == "saved_model":
        shutil.copytree(seeds.saved_model("sm_nested"), case / "sm")
        return "sm", ["sm"], "out_sm"
    model, inputs, out = _valid_input(case, seeds, kind == "tf")
    return model, inputs, out


def _paths(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    op, kind = recipe["op"], recipe["kind"]
    model, inputs, out = _path_input(case, seeds, kind)
    outputs = [out, out + ".data"]
    outside = case / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("must survive\n")
    inputs = inputs + ["outside"]
    argv = ["convert", model, out]
    if op == "output_same":
        argv = ["convert", model, model]
    elif op == "output_dot":
        argv = ["convert", model, f"./{model}"]
    elif op == "output_dotdot":
        (case / "sub").mkdir()
        argv = ["convert", model, f"sub/../{model}"]
    elif op == "output_absolute":
        argv = ["convert", model, str(case / model)]
    elif op == "output_symlink_to_input":
        (case / "alias").symlink_to(model)
        argv = ["convert", model, "alias"]
        inputs.append("alias")
    elif op == "output_hardlink_to_input" and kind in ("onnx", "tf"):
        os.link(case / model, case / "hardlink")
        argv = ["convert", model, "hardlink"]
        inputs.append("hardlink")
    elif op == "output_trailing_slash":
        argv = ["convert", model, out + "/"]
        if kind != "saved_model":  # a folder name for a file: nothing may be written
            outputs = []
    elif op == "output_is_data_file" and kind == "ext":
        argv = ["convert", model, "model/model.onnx.data"]
    elif op == "output_is_saved_model" and kind == "saved_model":
        argv = ["convert", model, "./sm/"]
    elif op == "output_inside_saved_model" and kind == "saved_model":
        argv = ["convert", model, "sm/variables/variables.index"]
    elif op == "output_symlink_outside":
        (case / "link_out").symlink_to(outside / "victim.txt")
        argv = ["convert", model, "link_out"]
        outputs = ["link_out", "link_out.data"]
    elif op == "output_missing_folder":
        argv = ["convert", model, "no/such/folder/out"]
    elif op == "output_is_dir":
        (case / "outdir").mkdir()
        (case / "outdir" / "keep.txt").write_text("keep\n")
        argv = ["convert", model, "outdir"]
        inputs.append("outdir")
    elif op == "output_is_fifo":
        _fifo(case / "out_fifo")
        argv = ["convert", model, "out_fifo"]
        inputs.append("out_fifo")
    elif op == "output_is_device":
        _char_device(case / "out_dev")
        argv = ["convert", model, "out_dev"]
        inputs.append("out_dev")
    elif op == "output_exists_failure":
        existing = case / out
        if kind == "saved_model":
            shutil.copytree(seeds.saved_model("sm_tf1"), existing)
        else:
            existing.write_bytes(b"an earlier good output\n")
        argv = ["convert", model, out, "--validate", "--inputs", "missing.npz"]
        inputs.append(out)
    elif op == "input_fifo":
        _fifo(case / "pipe.onnx")
        argv = ["convert", "pipe.onnx", out]
        inputs.append("pipe.onnx")
    elif op == "input_device":
        _char_device(case / "dev.onnx")
        argv = ["convert", "dev.onnx", out]
        inputs.append("dev.onnx")
    elif op == "input_dev_zero":
        argv = ["convert", "/dev/zero", out] if recipe["k"] % 2 else ["check", "/dev/zero"]
    elif op == "input_socket":
        _socket(case / "s.onnx")
        argv = ["convert", "s.onnx", out]
        inputs.append("s.onnx")
    elif op == "input_dir_no_model":
        (case / "empty_dir").mkdir()
        argv = ["convert", "empty_dir", out]
    elif op == "input_symlink_loop":
        (case / "l1.onnx").symlink_to("l2.onnx")
        (case / "l2.onnx").symlink_to("l1.onnx")
        argv = ["convert", "l1.onnx", out]
        inputs += ["l1.onnx", "l2.onnx"]
    elif op == "input_empty":
        (case / "empty.pb").write_bytes(b"")
        (case / "empty.onnx").write_bytes(b"")
        argv = ["convert", "empty.pb" if recipe["k"] % 2 else "empty.onnx", out]
        inputs += ["empty.pb", "empty.onnx"]
    elif op == "input_bad_utf8_name":
        name = os.fsdecode(b"m\xff\xfe.onnx")
        shutil.copy(seeds.onnx("cnn"), case / name)
        argv = ["convert", name, out]
        inputs.append(name)
    elif op.startswith("report_"):
        report = {
            "report_is_input": model, "report_is_output": out,
            "report_is_data_file": "model/model.onnx.data" if kind == "ext" else model,
            "report_is_fifo": "report_fifo", "report_is_dir": "report_dir",
            "report_in_saved_model": "sm/saved_model.pb" if kind == "saved_model" else model,
            "report_missing_folder": "nowhere/report.json"}[op]
        if op == "report_is_fifo":
            _fifo(case / "report_fifo")
            inputs.append("report_fifo")
        elif op == "report_is_dir":
            (case / "report_dir").mkdir()
            inputs.append("report_dir")
        argv = ["convert", model, out, "--report", report]
    return CaseFiles(argv, inputs, outputs)


def _explain_check(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    op, k = recipe["op"], recipe["k"]
    shutil.copy(seeds.onnx("cnn"), case / "model.onnx")
    inputs = ["model.onnx"]
    outputs: list[str] = []
    node = ["conv1", "relu1", "nope", "", "\u00e9"][k % 5]
    if op == "explain_garbage_report":
        (case / "report.json").write_bytes(mutate_bytes(b'{"target": "fp16", "nodes": []}',
                                                        [("flip", [(k, k % 8)])]))
        argv = ["explain", "report.json", node]
        inputs.append("report.json")
    elif op == "explain_schema_report":
        (case / "report.json").write_text(json.dumps([
            {"target": 1, "backend": None, "summary": [], "nodes": {}},
            {"target": "fp16", "backend": "x", "summary": {}, "nodes": [1, "a", None]},
            {"target": "fp16", "backend": "x", "summary": {}, "nodes": [{"name": node}]},
            [], "text", None][k % 6]))
        argv = ["explain", "report.json", node]
        inputs.append("report.json")
    elif op == "explain_deep_json":
        (case / "report.json").write_text("[" * 100000 + "]" * 100000)
        argv = ["explain", "report.json", node]
        inputs.append("report.json")
    elif op == "explain_fifo":
        _fifo(case / "report.json")
        argv = ["explain", "report.json", node]
        inputs.append("report.json")
    elif op == "explain_missing_node":
        argv = ["explain", "model.onnx", "no_such_node_" + "x" * (k % 50)]
    elif op == "explain_valid_report":
        argv = ["convert", "model.onnx", "out.onnx", "--report", "report.json"]
        outputs = ["out.onnx", "report.json"]
    elif op == "explain_model":
        argv = ["explain", "model.onnx", node, *[[], ["--target", "bf16"], ["--keep-node", "("],
                                                 ["--outputs", "y"]][k % 4]]
    elif op == "check_garbage":
        (case / "model.onnx").write_bytes(mutate_bytes((case / "model.onnx").read_bytes(),
                                                       [("truncate", k)]))
        argv = ["check", "model.onnx"]
    elif op == "check_fifo":
        _fifo(case / "pipe.onnx")
        argv = ["check", "pipe.onnx"]
        inputs.append("pipe.onnx")
    elif op == "check_reference_garbage":
        (case / "ref.onnx").write_bytes(b"garbage" * (k % 10))
        argv = ["check", "model.onnx", "--reference", "ref.onnx"]
        inputs.append("ref.onnx")
    elif op == "check_reference_fifo":
        _fifo(case / "ref.onnx")
        argv = ["check", "model.onnx", "--reference", "ref.onnx"]
        inputs.append("ref.onnx")
    elif op == "check_valid":
        argv = ["check", "model.onnx", *[[], ["--target", "bf16"], ["--backend", "ort-cpu"],
                                         ["--report", "findings.json"]][k % 4]]
        outputs = ["findings.json"]
    elif op == "check_reference":
        argv = ["check", "model.onnx", "--reference", "model.onnx"]
    elif op == "check_tf":
        shutil.copy(seeds.tf(["conv_matmul.pb", "meta.meta", "conv_matmul.pbtxt"][k % 3]),
                    case / ["m.pb", "m.meta", "m.pbtxt"][k % 3])
        argv = ["check", ["m.pb", "m.meta", "m.pbtxt"][k % 3]]
        inputs.append(argv[1])
    elif op == "check_saved_model":
        shutil.copytree(seeds.saved_model("sm_nested"), case / "sm")
        argv = ["check", "sm"]
        inputs.append("sm")
    elif op == "explain_tf_model":
        shutil.copy(seeds.tf("conv_matmul.pb"), case / "m.pb")
        argv = ["explain", "m.pb", ["y", "mm", "nope"][k % 3]]
        inputs.append("m.pb")
    elif op == "explain_saved_model":
        shutil.copytree(seeds.saved_model(SAVED_MODEL_SEEDS[k % 3]), case / "sm")
        argv = ["explain", "sm", ["MatMul", "nope", "dense/MatMul"][k % 3]]
        inputs.append("sm")
    elif op == "explain_report_bad_utf8":
        (case / "report.json").write_bytes(b'{"target": "fp16", "nodes": [{"name": "\xff"}]}')
        argv = ["explain", "report.json", node]
        inputs.append("report.json")
    else:  # check_reference_tf
        shutil.copy(seeds.tf("conv_matmul.pb"), case / "m.pb")
        argv = ["check", "m.pb", "--reference", "m.pb"]
        inputs.append("m.pb")
    return CaseFiles(argv, inputs, outputs)


def _valid(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    seed = recipe["seed"]
    options = [o for o in recipe["options"]]
    if seed in ONNX_SEEDS:
        model, inputs = _copy_seed_onnx(seeds, seed, case)
        out = "out.onnx"
        options = [o for o in options if o[0] != "--backend" or o[1].startswith("ort")]
    elif seed in SAVED_MODEL_SEEDS:
        shutil.copytree(seeds.saved_model(seed), case / "sm")
        model, inputs, out = "sm", ["sm"], "out_sm"
        options = [o for o in options if o[0] != "--backend" or o[1].startswith("tf")]
    else:
        suffix = Path(seed).suffix
        shutil.copy(seeds.tf(seed), case / f"model{suffix}")
        model, inputs, out = f"model{suffix}", [f"model{suffix}"], f"out{suffix}"
        options = [o for o in options if o[0] != "--backend" or o[1].startswith("tf")]
    argv, reports = _with_options(["convert", model, out], options)
    return CaseFiles(argv, inputs, [out, out + ".data", *reports])


# -- issue 35: the whole CLI surface ---------------------------------------------------------

#: --external-data choices of the collision cases ("" for the default).
LAYOUT_CHOICES = ("", "single", "per-tensor", "inline")
#: What a successful ONNX conversion to out.onnx may write: the model and its data files.
ONNX_OUTPUTS = ["out.onnx", "out.onnx.*"]


def _layout_args(layout: str) -> list[str]:
    return ["--external-data", layout] if layout else []


def _data_name(layout: str, k: int, count: int) -> str:
    """A data file the layout writes beside out.onnx (inline writes none: then the name is
    free, and the run should succeed)."""
    return f"out.onnx.{k % count}.data" if layout == "per-tensor" else "out.onnx.data"


def _calibration_inputs(case: Path, seeds: Seeds) -> str:
    shutil.copy(seeds.root / "onnx" / "cnn.npz", case / "calib.npz")
    return "calib.npz"


def _cnn_with_external_weights(case: Path, seeds: Seeds) -> tuple[str, list[str]]:
    """The cnn with its weights (1 KiB or more) in model/model.onnx.data; its small tensors
    (Resize's scales) stay in the model, where onnxruntime can read them when it loads it."""
    (case / "model").mkdir()
    onnx.save_model(_load_seed_model(seeds, "cnn"), str(case / "model" / "model.onnx"),
                    save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    return "model/model.onnx", ["model"]


def _collisions(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    op, k, layout = recipe["op"], recipe["k"], recipe["layout"]
    model, inputs = _cnn_with_external_weights(case, seeds)
    # The cnn's weights of 1 KiB or more in fp16 (conv2, conv3) go external: two data files
    # per-tensor (a smaller threshold would put Resize's scales there, which onnx's checker
    # cannot read back, and every conversion would be refused before its report is written).
    data = _data_name(layout, k, 2)
    convert = ["convert", model, "out.onnx", *_layout_args(layout)]
    outputs = list(ONNX_OUTPUTS)
    (case / "lists.toml").write_text('deny = ["Softmax"]\n')
    inputs.append("lists.toml")
    calib = _calibration_inputs(case, seeds)
    inputs.append(calib)
    diagnose = ["diagnose", model, "--inputs", calib]
    if op == "report_is_data":
        argv = convert + ["--report", data]
    elif op == "report_link_to_data":
        (case / "report.json").symlink_to(data)
        argv = convert + ["--report", "report.json"]
        outputs.append("report.json")
    elif op == "report_dotdot_data":
        (case / "sub").mkdir()
        argv = convert + ["--report", f"sub/../{data}"]
    elif op == "report_absolute_data":
        argv = convert + ["--report", str(case / data)]
    elif op == "auto_report_is_data":
        argv = convert + ["--auto", "--max-error", "1", "--inputs", calib, "--report", data]
    elif op == "report_is_output":
        argv = convert + ["--report", ["out.onnx", "./out.onnx", str(case / "out.onnx")][k % 3]]
    elif op == "report_trailing_slash":
        argv = convert + ["--report", ["report.json/", "report.json/.", "x/.."][k % 3]]
    elif op == "report_is_inputs":
        argv = convert + ["--validate", "--inputs", calib, "--report", calib]
    elif op == "report_is_config":
        argv = convert + ["--config", "lists.toml", "--report", "lists.toml"]
    elif op.startswith("json_"):
        target = {"json_is_model": model, "json_is_data": "model/model.onnx.data",
                  "json_is_config": "lists.toml", "json_is_inputs": calib,
                  "json_link_to_data": "diag_link.json", "json_trailing_slash": "diag.json/",
                  "json_fifo": "diag_fifo", "json_missing_folder": "nowhere/diag.json",
                  "json_is_dir": "diag_dir", "json_valid": "diag.json"}[op]
        if op == "json_link_to_data":
            (case / "diag_link.json").symlink_to("model/model.onnx.data")
            inputs.append("diag_link.json")
        elif op == "json_fifo":
            _fifo(case / "diag_fifo")
            inputs.append("diag_fifo")
        elif op == "json_is_dir":
            (case / "diag_dir").mkdir()
            inputs.append("diag_dir")
        argv = diagnose + ["--config", "lists.toml", "--json", target]
        outputs = ["diag.json"]
    elif op == "report_into_output_saved_model":
        shutil.copytree(seeds.saved_model("sm_nested"), case / "sm")
        shutil.copytree(seeds.saved_model("sm_nested"), case / "out_sm")
        inputs.append("sm")
        argv = ["convert", "sm", "out_sm", "--report",
                ["out_sm/report.json", "out_sm", "out_sm/variables/variables.index"][k % 3]]
        outputs = ["out_sm"]
    elif op == "output_data_is_input_data":
        # the input's external data is named as the output's would be
        (case / "model" / "model.onnx.data").rename(case / "model" / "out.onnx.data")
        loaded = onnx.load(str(case / "model" / "model.onnx"), load_external_data=False)
        for tensor in loaded.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = "out.onnx.data"
        (case / "model" / "model.onnx").write_bytes(loaded.SerializeToString())
        argv = ["convert", model, "model/out.onnx", *_layout_args(layout)]
        outputs = ["model/out.onnx", "model/out.onnx.*"]
    elif op in ("check_report_is_data", "check_report_is_reference_data",
                "check_report_valid"):
        shutil.copy(seeds.onnx("cnn"), case / "checked.onnx")
        inputs.append("checked.onnx")
        report = {"check_report_is_data": "model/model.onnx.data",
                  "check_report_is_reference_data": "model/model.onnx.data",
                  "check_report_valid": "findings.json"}[op]
        argv = ["check", "checked.onnx", "--reference", model, "--report", report]
        if op == "check_report_is_data":
            argv = ["check", model, "--report", report]
        outputs = ["findings.json"]
    else:  # auto_report_is_metric
        (case / "metric.py").write_text(_METRIC_SOURCES["valid"])
        inputs.append("metric.py")
        argv = convert + ["--auto", "--max-error", "1", "--inputs", calib, "--metric",
                          "metric.py:metric", "--report", "metric.py"]
    if "--report" in argv and argv[argv.index("--report") + 1] not in outputs:
        outputs.append(argv[argv.index("--report") + 1])
    return CaseFiles(argv, inputs, outputs)


def _polygraphy_json(path: Path, arrays: dict[str, np.ndarray], encode: str = "npy") -> None:
    """Polygraphy's input format: a list of feeds {name: {"array": base64, ...}}."""
    import base64
    import io

    feed = {}
    for name, array in arrays.items():
        buffer = io.BytesIO()
        if encode == "npz":
            np.savez(buffer, array)
        else:
            np.save(buffer, array, allow_pickle=array.dtype.hasobject)
        feed[name] = {"array": base64.b64encode(buffer.getvalue()).decode(),
                      "polygraphy_class": "ndarray"}
    path.write_text(json.dumps([feed]))


def _zip_with_declared(path: Path, name: str, shape: tuple[int, ...], real_bytes: int) -> None:
    """An .npz whose one member's header declares `shape` (float32) and holds `real_bytes` of
    zeros, deflated: a small file that would inflate to what it declares."""
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive, \
            archive.open(f"{name}.npy", "w", force_zip64=True) as member:
        member.write(header.getvalue())
        chunk = bytes(1 << 20)
        left = real_bytes
        while left > 0:
            member.write(chunk[:min(left, len(chunk))])
            left -= min(left, len(chunk))


def _calibration(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    op, k = recipe["op"], recipe["k"]
    shutil.copy(seeds.onnx("cnn"), case / "model.onnx")
    inputs = ["model.onnx"]
    with np.load(seeds.root / "onnx" / "cnn.npz") as data:
        good = {name: data[name] for name in data.files}
    name, array = next(iter(good.items()))
    given = "calib.npz"
    if op == "fifo_npz":
        _fifo(case / given)
    elif op == "fifo_json":
        given = "calib.json"
        _fifo(case / given)
    elif op == "dev_zero_json":
        given = "calib.json"
        (case / given).symlink_to("/dev/zero")
    elif op == "dev_zero_npz":
        (case / given).symlink_to("/dev/zero")
    elif op == "bomb_npz":
        _zip_with_declared(case / given, name, (1 << 28,), 64 << 20)
    elif op == "bomb_wrong_shape":
        _zip_with_declared(case / given, name, (1, 1 << 20), 4 << 20)
    elif op == "object_npz":
        np.savez(case / given, allow_pickle=True,  # the hostile object array
                 **{name: np.array([{"a": 1}, None], dtype=object)})
    elif op == "deep_json":
        given = "calib.json"
        (case / given).write_text("[" * (1000 + k % 200000) + "]" * (1000 + k % 200000))
    elif op == "empty_zip_json":
        import base64
        import io
        import zipfile

        given = "calib.json"
        empty = io.BytesIO()
        zipfile.ZipFile(empty, "w").close()
        (case / given).write_text(json.dumps([{name: {
            "array": base64.b64encode(empty.getvalue()).decode(),
            "polygraphy_class": "ndarray"}}]))
    elif op == "object_json":
        given = "calib.json"
        _polygraphy_json(case / given, {name: np.array([1, "a"], dtype=object)},
                         ["npy", "npz"][k % 2])
    elif op == "truncated_npy_json":
        import base64
        import io

        given = "calib.json"
        buffer = io.BytesIO()
        np.save(buffer, array)
        cut = buffer.getvalue()[: max(1, len(buffer.getvalue()) - 1 - k % 5000)]
        (case / given).write_text(json.dumps([{name: {"array": base64.b64encode(cut).decode()}}]))
    elif op == "garbage_base64_json":
        given = "calib.json"
        (case / given).write_text(json.dumps([{name: {"array": ["!!!", "\u00e9\u4e2d", "",
                                                                "QUJD"][k % 4]}}]))
    elif op in ("folder_with_fifo", "folder_with_dir_npz", "empty_folder", "many_batches",
                "valid_folder"):
        given = "calib"
        (case / given).mkdir()
        if op != "empty_folder":
            for index in range(20 if op == "many_batches" else 2):
                np.savez(case / given / f"b{index:02d}.npz", **good)
        if op == "folder_with_fifo":
            _fifo(case / given / "zz.npz")
        elif op == "folder_with_dir_npz":
            (case / given / "dir.npz").mkdir()
    elif op == "nan_values":
        np.savez(case / given, allow_pickle=False,
                 **{name: np.full(array.shape, np.nan, array.dtype)})
    elif op == "wrong_dtype":
        np.savez(case / given, allow_pickle=False, **{name: array.astype(np.float64)})
    elif op == "missing_input":
        np.savez(case / given, other=array)
    elif op == "extra_input":
        np.savez(case / given, **good, extra=np.zeros(3, np.float32))
    elif op == "member_not_npy":
        import zipfile

        with zipfile.ZipFile(case / given, "w") as archive:
            archive.writestr("notes.txt", "not an array")
    elif op == "json_not_list":
        given = "calib.json"
        (case / given).write_text(["5", '"text"', "{}", "[1, 2]", "null"][k % 5])
    elif op == "json_is_dir":
        given = "calib.json"
        (case / given).mkdir()
    elif op == "valid_json":
        given = "calib.json"
        _polygraphy_json(case / given, good)
    elif op == "valid_old_json":
        given = "calib.json"
        _polygraphy_json(case / given, good, "npz")
    elif op == "valid_compressed":
        np.savez_compressed(case / given, **good)
    else:  # valid_npz
        np.savez(case / given, **good)
    inputs.append(given)
    command = recipe["command"]
    outputs: list[str] = []
    if command == "auto":
        argv = ["convert", "model.onnx", "out.onnx", "--auto", "--max-error", "1", "--inputs",
                given, "--report", "report.json"]
        outputs = [*ONNX_OUTPUTS, "report.json"]
    else:
        argv = ["diagnose", "model.onnx", "--inputs", given]
        if command == "diagnose_json":
            argv += ["--json", "diag.json"]
            outputs = ["diag.json"]
    return CaseFiles(argv, inputs, outputs)


_METRIC_BODIES = {
    "exits": "sys.exit(7)", "exits_zero": "sys.exit(0)", "raises": "raise ValueError('no')",
    "nan": "return float('nan')", "inf": "return float('inf')",
    "negative_inf": "return -np.inf", "huge_int": "return 10**400", "string": "return '0.1'",
    "none": "return None", "array3": "return np.zeros(3)", "bool": "return True",
    "writes_reference": "next(iter(reference.values()))[...] = 0\n    return 0.0",
    "keyerror": "return float(outputs['no_such_output'].max())",
    "recursion": "return metric(reference, outputs)",
    "valid": "return float(max(np.max(np.abs(outputs[k] - r)) for k, r in reference.items()))",
    "valid_numpy_scalar": "return np.float32(0.0)",
}
_METRIC_SOURCES = {name: f"import sys\nimport numpy as np\n\n\ndef metric(reference, outputs):\n"
                         f"    {body}\n" for name, body in _METRIC_BODIES.items()}
_METRIC_SOURCES.update({
    "import_exits": "import sys\nsys.exit(3)\n",
    "import_raises": "raise ImportError('broken on purpose')\n",
    "syntax_error": "def metric(reference, outputs)\n    return 0\n",
    "not_callable": "metric = 0.5\n",
    "missing_function": "def other(reference, outputs):\n    return 0.0\n",
    "valid_by_module_name": _METRIC_SOURCES["valid"],
})


def _metric(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    op = recipe["op"]
    shutil.copy(seeds.onnx("cnn"), case / "model.onnx")
    calib = _calibration_inputs(case, seeds)
    inputs = ["model.onnx", calib, "metric_fuzz.py"]
    if op == "file_is_fifo":
        _fifo(case / "metric_fuzz.py")
    elif op == "file_is_dev_zero":
        (case / "metric_fuzz.py").symlink_to("/dev/zero")
    else:
        (case / "metric_fuzz.py").write_text(_METRIC_SOURCES[op])
    spec = "metric_fuzz:metric" if op == "valid_by_module_name" else "metric_fuzz.py:metric"
    argv = ["convert", "model.onnx", "out.onnx", "--auto", "--max-error", "1", "--inputs", calib,
            "--metric", spec]
    outputs = list(ONNX_OUTPUTS)
    if recipe["report"]:
        argv += ["--report", "report.json"]
        outputs.append("report.json")
    return CaseFiles(argv, inputs, outputs)


def _many_tensors(recipe: dict, case: Path, seeds: Seeds) -> CaseFiles:
    op, k = recipe["op"], recipe["k"]
    inputs: list[str] = []
    if op.startswith("per_tensor_input"):
        shutil.copytree(seeds.root / "onnx" / "many_ext", case / "many")
        model = "many/model.onnx"
        inputs.append("many")
    elif op == "per_tensor_output_is_input_data":
        shutil.copytree(seeds.root / "onnx" / "many_ext", case / "many")
        model = "many/model.onnx"
        inputs.append("many")
    else:
        shutil.copy(seeds.onnx("many"), case / "many.onnx")
        model = "many.onnx"
        inputs.append(model)
    layout = {"per_tensor": "per-tensor", "single": "single", "inline": "inline",
              "default": "", "per_tensor_over_single": "per-tensor",
              "single_over_per_tensor": "single", "per_tensor_report_collision": "per-tensor",
              "per_tensor_input_to_single": "single", "per_tensor_input_to_per_tensor":
              "per-tensor", "per_tensor_input_same_folder": "per-tensor",
              "per_tensor_output_is_input_data": "per-tensor", "per_tensor_validate":
              "per-tensor", "per_tensor_threshold": "per-tensor"}.get(op, "per-tensor")
    layout_args = ["--external-data", layout] if layout else []
    out = "out.onnx"
    outputs = list(ONNX_OUTPUTS)
    extra: list[str] = []
    if op in ("per_tensor_over_single", "single_over_per_tensor"):
        (case / "out.onnx").write_bytes(b"an earlier output")
        earlier = ["out.onnx.data"] if op == "per_tensor_over_single" else [
            f"out.onnx.{i}.data" for i in range(0, MANY_TENSORS, 7)]
        for name in earlier:
            (case / name).write_bytes(b"earlier data")
    elif op == "per_tensor_report_collision":
        extra = ["--report", f"out.onnx.{k % MANY_TENSORS}.data"]
    elif op == "per_tensor_input_same_folder":
        out = "many/out.onnx"
        outputs = ["many/out.onnx", "many/out.onnx.*"]
    elif op == "per_tensor_output_is_input_data":
        out = f"many/w{k % MANY_TENSORS}"
        outputs = []
    elif op == "per_tensor_validate":
        shutil.copy(seeds.root / "onnx" / "many.npz", case / "many.npz")
        inputs.append("many.npz")
        extra = ["--validate", "--inputs", "many.npz"]
    elif op == "per_tensor_threshold":
        extra = ["--external-data-threshold", str([0, 2048, 2100, 1 << 40][k % 4])]
    if op == "per_tensor_diagnose":
        argv = ["diagnose", model, "--json", "diag.json", "--top", str(1 + k % 5)]
        outputs = ["diag.json"]
    elif op == "per_tensor_check":
        shutil.copytree(seeds.root / "onnx" / "many_ext", case / "many")
        inputs.append("many")
        argv = ["check", "many/model.onnx", "--reference", model, "--report", "findings.json"]
        outputs = ["findings.json"]
    else:
        argv = ["convert", model, out, *layout_args, *extra, "--quiet"]
    if "--report" in extra:
        outputs.append(extra[extra.index("--report") + 1])
    return CaseFiles(argv, inputs, outputs)


_FAMILIES = {
    "onnx_bytes": _onnx_bytes, "onnx_proto": _onnx_proto, "onnx_external": _onnx_external,
    "tf_bytes": _tf_bytes, "tf_proto": _tf_proto, "saved_model": _saved_model,
    "cli_misuse": _cli_misuse, "paths": _paths, "explain_check": _explain_check, "valid": _valid,
    "collisions": _collisions, "calibration": _calibration, "metric": _metric,
    "many_tensors": _many_tensors,
}

FAMILIES = tuple(_FAMILIES)
