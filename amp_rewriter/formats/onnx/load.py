"""ONNX ModelProto -> IR.

Type groups come from the op schema's type constraints at the model's opset: onnx's schemas, else
onnxruntime's (its contrib ops, see `ort_registry`). If/Loop/Scan get groups that tie their outer
slots to their bodies' inputs and outputs. Dtypes come from our own inference over the schemas;
shape inference and existing value_info only fill what that cannot decide, so no correctness
depends on them.
"""

from __future__ import annotations

import ast
import contextlib
import math
import mmap
import os
import stat
import sys
import warnings
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import onnx
from onnx import numpy_helper

from ...errors import AmpError
from ...fileio import non_regular_kind, open_input, pread_exact, read_input_bytes
from ...ir import FLOAT32, Graph, LazyTensor, Model, Node, TypeGroup, Value, tensors
from ...ir.tensors import ChunkReader
from . import ort_registry
from .rules import ATTRIBUTE_TYPED_OUTPUTS, CONTROL_FLOW_OPS, FIXED_TYPE_PARAMS, TIED_TYPE_PARAMS

#: 2 GiB: the protobuf limit on one serialized message.
PROTOBUF_LIMIT = 2**31 - 1

_ELEM_TYPE_NAMES = {
    "FLOAT": "float32", "DOUBLE": "float64", "FLOAT16": "float16", "BFLOAT16": "bfloat16",
}


@cache  # a handful of codes, read for every tensor and value of the model
def dtype_name(elem_type: int) -> str | None:
    """Our dtype name for an ONNX TensorProto elem_type code (None for UNDEFINED)."""
    if not elem_type:
        return None
    try:
        name = onnx.TensorProto.DataType.Name(elem_type)
    except ValueError:
        raise AmpError(f"the model uses an unknown ONNX data type ({elem_type})") from None
    return _ELEM_TYPE_NAMES.get(name, name.lower())


def elem_type_code(dtype: str) -> int:
    """The ONNX elem_type code for one of our dtype names."""
    for onnx_name, ours in _ELEM_TYPE_NAMES.items():
        if ours == dtype:
            return getattr(onnx.TensorProto, onnx_name)
    return getattr(onnx.TensorProto, dtype.upper())


def _type_str_dtype(type_str: str) -> str | None:
    """'tensor(float16)' -> 'float16'; sequence/optional/map types -> None."""
    if not type_str.startswith("tensor(") or not type_str.endswith(")"):
        return None
    inner = type_str[len("tensor("):-1]
    return {"float": "float32", "double": "float64"}.get(inner, inner)


class _Formal:
    """How a schema's formal inputs/outputs map onto a node's slots.

    Takes onnx's `OpSchema` or onnxruntime's schema object (contrib ops): the two spell their
    formal parameters' fields differently (`type_str` / `typeStr`, `is_homogeneous` /
    `isHomogeneous`) but mean the same.
    """

    __slots__ = ("inputs", "outputs", "constraints", "has_containers", "since_version",
                 "input_counts", "output_counts")

    def __init__(self, schema: Any):
        self.inputs = [_formal_param(p) for p in schema.inputs]
        self.outputs = [_formal_param(p) for p in schema.outputs]
        self.since_version = int(schema.since_version)
        #: (fewest, most) inputs and outputs a node of this schema may have.
        self.input_counts = (int(schema.min_input), int(schema.max_input))
        self.output_counts = (int(schema.min_output), int(schema.max_output))
        self.constraints: dict[str, frozenset[str]] = {}
        for constraint in schema.type_constraints:
            allowed = {_type_str_dtype(t) for t in constraint.allowed_type_strs}
            self.constraints[constraint.type_param_str] = frozenset(
                t for t in allowed if t is not None)
        #: Ops that always read or write a sequence/optional/map are left as they are (ops such
        #: as Identity whose constraint merely admits containers are not: a container value has
        #: no tensor dtype, so it never joins a group decision anyway).
        containers = ("seq(", "optional(", "map(")
        self.has_containers = schema.name.startswith(("Sequence", "Optional")) or any(
            all(t.startswith(containers) for t in c.allowed_type_strs)
            for c in schema.type_constraints) or any(
            type_str.startswith(containers) for type_str, _, _ in self.inputs + self.outputs)

    def slot_params(self, formals: list[tuple[str, bool, bool]], count: int
                    ) -> list[tuple[str, bool]]:
        """(type_str, homogeneous) for each of `count` actual slots."""
        result: list[tuple[str, bool]] = []
        for index in range(count):
            if index < len(formals):
                type_str, _variadic, homogeneous = formals[index]
            elif formals and formals[-1][1]:
                type_str, _variadic, homogeneous = formals[-1]
            else:
                type_str, homogeneous = "", True
            result.append((type_str, homogeneous))
        return result


def _refuse_slot_counts(node: Node, formal: _Formal) -> NoReturn:
    """The error for a node with fewer or more inputs or outputs than its schema allows."""
    for what, count, (fewest, most) in (("input", len(node.inputs), formal.input_counts),
                                        ("output", len(node.outputs), formal.output_counts)):
        if not fewest <= count <= most:
            takes = f"{fewest}" if fewest == most else f"{fewest} to {most}"
            raise AmpError(f"node {node.name!r} ({node.op_type}) has {count} {what}s, its "
                           f"schema takes {takes}")
    raise AssertionError("the slot counts fit")


@cache
def _group_plan(formal: _Formal, op_type: str, inputs: int, outputs: int
                ) -> tuple[tuple[bool, int, str, str], ...]:
    """(is_input, slot, group key, type param) for every slot bound to a type constraint.

    Homogeneous params share one group per type param; heterogeneous variadic slots get one each;
    params the rules tie (`TIED_TYPE_PARAMS`) join the group of the param they are tied to.
    """
    plan = []
    tied = TIED_TYPE_PARAMS.get(op_type, {})
    for is_input, formals, count in ((True, formal.inputs, inputs),
                                     (False, formal.outputs, outputs)):
        for slot, (type_str, homogeneous) in enumerate(formal.slot_params(formals, count)):
            if type_str not in formal.constraints:
                continue  # a fixed type such as tensor(int64)
            param = tied.get(type_str, type_str) if tied.get(type_str) in formal.constraints \
                else type_str
            key = param if homogeneous else f"{param}[{'in' if is_input else 'out'}{slot}]"
            plan.append((is_input, slot, key, param))
    return tuple(plan)


def _formal_param(param: Any) -> tuple[str, bool, bool]:
    """(type_str, variadic, homogeneous) of one formal input/output, from onnx's or
    onnxruntime's schema."""
    type_str = param.type_str if hasattr(param, "type_str") else param.typeStr
    homogeneous = getattr(param, "is_homogeneous", getattr(param, "isHomogeneous", True))
    return type_str, param.option.name == "Variadic", bool(homogeneous)


@cache
def _formal(op_type: str, domain: str, opset: int) -> _Formal | None:
    """The op's schema at the domain's opset: onnx's, else onnxruntime's (contrib ops, and the
    default-domain ops only onnxruntime defines); None for ops neither knows."""
    try:
        return _Formal(onnx.defs.get_schema(op_type, opset, domain))
    except Exception:  # onnx raises SchemaError for unknown ops; any failure means "no schema"
        pass
    ort_schema = ort_registry.schema(op_type, domain, opset)
    return _Formal(ort_schema) if ort_schema is not None else None


def op_in_opset(op_type: str, opset: int) -> bool:
    """Whether the default domain has `op_type` at `opset` (for ops a pass would add)."""
    return _formal(op_type, "", opset) is not None


def schema_since_version(op_type: str, domain: str, opset: int) -> int | None:
    """The version the op's schema at `opset` dates from (kernels are registered by it)."""
    formal = _formal(op_type, domain, opset)
    return formal.since_version if formal is not None else None


def model_opsets(model: onnx.ModelProto) -> dict[str, int]:
    """domain -> opset version of a model's imports ("" for the default domain)."""
    opsets = {(imp.domain or ""): imp.version for imp in model.opset_import}
    if "ai.onnx" in opsets:
        opsets.setdefault("", opsets["ai.onnx"])
    return opsets


def _external_path(tensor: onnx.TensorProto, base_dir: Path) -> Path:
    """The file holding a tensor's external data: a regular file inside the model's folder
    (path traversal, links out of the folder, FIFOs and devices are refused)."""
    location = next((e.value for e in tensor.external_data if e.key == "location"), None)
    if location is None:
        raise AmpError(f"tensor {tensor.name!r} is marked external but has no location")
    if os.path.isabs(location) or location.startswith(("\\", "/")) or ":" in location \
            or "\0" in location:
        raise AmpError(f"tensor {tensor.name!r}: external data location {location!r} is not "
                       f"a relative path inside the model's folder")
    try:
        resolved = (base_dir / location).resolve()
        resolved.relative_to(base_dir.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        raise AmpError(f"tensor {tensor.name!r}: external data location {location!r} cannot be "
                       f"resolved (a symlink loop?)") from None
    except ValueError:
        raise AmpError(f"tensor {tensor.name!r}: external data location {location!r} points "
                       f"outside the model's folder") from None
    try:
        mode = resolved.stat().st_mode
    except OSError:
        raise AmpError(f"tensor {tensor.name!r}: external data file {location!r} not "
                       f"found") from None
    if not stat.S_ISREG(mode):
        kind = non_regular_kind(mode) or "a directory"
        raise AmpError(f"tensor {tensor.name!r}: external data file {location!r} is {kind}, "
                       f"not a regular file")
    return resolved


_T = onnx.TensorProto
_A = onnx.AttributeProto
_UNDEFINED, _INT, _FLOAT, _TENSOR, _TENSORS, _GRAPH, _GRAPHS, _INTS = (
    _A.UNDEFINED, _A.INT, _A.FLOAT, _A.TENSOR, _A.TENSORS, _A.GRAPH, _A.GRAPHS, _A.INTS)
#: Bits per element of each data type whose stored size we check.
_BITS: dict[int, int] = {
    _T.FLOAT: 32, _T.UINT8: 8, _T.INT8: 8, _T.UINT16: 16, _T.INT16: 16, _T.INT32: 32,
    _T.INT64: 64, _T.BOOL: 8, _T.FLOAT16: 16, _T.DOUBLE: 64, _T.UINT32: 32, _T.UINT64: 64,
    _T.COMPLEX64: 64, _T.COMPLEX128: 128, _T.BFLOAT16: 16, _T.FLOAT8E4M3FN: 8,
    _T.FLOAT8E4M3FNUZ: 8, _T.FLOAT8E5M2: 8, _T.FLOAT8E5M2FNUZ: 8, _T.UINT4: 4, _T.INT4: 4}
#: The typed field each data type's values live in, and how many entries one element takes
#: (packed 4-bit types are left to onnx).
_FIELDS: dict[int, tuple[str, int]] = {
    _T.FLOAT: ("float_data", 1), _T.COMPLEX64: ("float_data", 2), _T.DOUBLE: ("double_data", 1),
    _T.COMPLEX128: ("double_data", 2), _T.INT64: ("int64_data", 1),
    _T.UINT32: ("uint64_data", 1), _T.UINT64: ("uint64_data", 1), _T.STRING: ("string_data", 1),
    **{t: ("int32_data", 1) for t in (_T.INT32, _T.INT16, _T.INT8, _T.UINT16, _T.UINT8, _T.BOOL,
                                      _T.FLOAT16, _T.BFLOAT16, _T.FLOAT8E4M3FN,
                                      _T.FLOAT8E4M3FNUZ, _T.FLOAT8E5M2, _T.FLOAT8E5M2FNUZ)}}


def _external_int(tensor: onnx.TensorProto, key: str) -> int | None:
    value = next((e.value for e in tensor.external_data if e.key == key), None)
    if value is None:
        return None
    if not value.isdigit():
        raise AmpError(f"tensor {tensor.name!r}: external data {key} {value!r} is not a "
                       f"non-negative integer")
    return int(value)


#: Every TensorProto data type code (the enum's `values()` builds a new list per call).
_DATA_TYPE_CODES = frozenset(onnx.TensorProto.DataType.values())


def check_tensor_data(tensor: onnx.TensorProto, base_dir: Path | None) -> None:
    """Refuse a tensor whose data does not match its declared shape and type, before anything
    reads it: numpy would fail on the mismatch, and a declared shape must never decide how much
    memory is used (it is checked against the bytes the file or its external data holds)."""
    where = f"tensor {tensor.name!r}"
    dims = list(tensor.dims)
    if any(d < 0 for d in dims):
        raise AmpError(f"{where}: negative dimension in its shape {dims}")
    if tensor.HasField("segment"):
        raise AmpError(f"{where}: segmented tensors are not supported")
    if tensor.data_type not in _DATA_TYPE_CODES or not tensor.data_type:
        raise AmpError(f"{where}: unknown data type {tensor.data_type}")
    elements = math.prod(dims)
    bits = _BITS.get(tensor.data_type)
    expected_bytes = (elements * bits + 7) // 8 if bits is not None else None
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        assert base_dir is not None  # refused earlier otherwise
        path = _external_path(tensor, base_dir)
        offset = _external_int(tensor, "offset") or 0
        length = _external_int(tensor, "length")
        size = path.stat().st_size
        available = size - offset
        if offset > size:
            raise AmpError(f"{where}: external data offset {offset} is past the end of its file "
                           f"({size} bytes)")
        if length is not None and length > available:
            raise AmpError(f"{where}: external data length {length} at offset {offset} runs past "
                           f"the end of its file ({size} bytes)")
        stored = length if length is not None else available
        if expected_bytes is not None and stored != expected_bytes:
            raise AmpError(f"{where}: its shape {dims} needs {expected_bytes} bytes of external "
                           f"data, the file gives {stored}")
        return
    if tensor.raw_data:
        if expected_bytes is not None and len(tensor.raw_data) != expected_bytes:
            raise AmpError(f"{where}: raw_data holds {len(tensor.raw_data)} bytes, its shape "
                           f"{dims} needs {expected_bytes}")
        return
    field = _FIELDS.get(tensor.data_type)
    if field is None:
        return
    name, per_element = field
    count = len(getattr(tensor, name))
    if count != elements * per_element:
        raise AmpError(f"{where}: holds {count} value entries, its shape {dims} of "
                       f"{elements} elements needs {elements * per_element}")


def load_external_data(model: onnx.ModelProto, base_dir: Path) -> None:
    """Read every external tensor of `model` into the model (after the loader's own checks on
    where the data lives), so the model can be copied, rewritten and run from memory."""
    tensors = [t for t in all_tensors(model.graph)
               if t.data_location == onnx.TensorProto.EXTERNAL]
    for tensor in tensors:
        check_tensor_data(tensor, base_dir)
    for tensor in tensors:
        inline_external_data(tensor, base_dir)


@contextlib.contextmanager
def _external_file(tensor: onnx.TensorProto, base_dir: Path
                   ) -> Iterator[tuple[int, int, int, str]]:
    """(descriptor, offset, length, label) of an external tensor's bytes, opened by the checked
    reader every input file goes through: a regular file inside the model's folder (links
    inside it included; onnx's own reader refuses those, with its own error types), its range
    within the size the file has."""
    path, offset, length = external_range(tensor, base_dir)
    label = f"tensor {readable(tensor.name)!r}: external data file {path.name!r}"
    fd, size = open_input(path, label)
    try:
        if offset + length > size:
            raise AmpError(f"{label}: ends before offset {offset + length} (was it changed "
                           f"during the run?)")
        yield fd, offset, length, label
    finally:
        os.close(fd)


def read_external_bytes(tensor: onnx.TensorProto, base_dir: Path) -> bytes:
    """The bytes of an external tensor (see `_external_file`)."""
    with _external_file(tensor, base_dir) as (fd, offset, length, label):
        return pread_exact(fd, length, offset, label)


def inline_external_data(tensor: onnx.TensorProto, base_dir: Path) -> None:
    """Put an external tensor's bytes into its `raw_data`, as onnx's loader does."""
    _warn_unknown_external_keys(tensor)
    tensor.raw_data = read_external_bytes(tensor, base_dir)
    tensor.data_location = onnx.TensorProto.DEFAULT
    del tensor.external_data[:]


#: The external-data keys onnx defines; others are ignored, with a warning as onnx gives one.
_EXTERNAL_KEYS = frozenset({"location", "offset", "length", "checksum", "basepath"})


def _warn_unknown_external_keys(tensor: onnx.TensorProto) -> None:
    unknown = sorted({e.key[:40] for e in tensor.external_data if e.key not in _EXTERNAL_KEYS})
    if unknown:
        more = f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""
        warnings.warn(f"Ignoring unknown external data key(s) {unknown[:4]}{more} for tensor "
                      f"{readable(tensor.name)!r}", stacklevel=2)


def _external_array(tensor: onnx.TensorProto, base_dir: Path) -> np.ndarray:
    """An external tensor's values, read by `read_external_bytes`."""
    raw_dtype = _RAW_NUMPY_DTYPES.get(tensor.data_type)
    if raw_dtype is not None:
        _warn_unknown_external_keys(tensor)
        data = read_external_bytes(tensor, base_dir)
        return np.frombuffer(data, dtype=raw_dtype).reshape(tuple(tensor.dims))
    copy = onnx.TensorProto()
    copy.CopyFrom(tensor)  # a header: the data is not in the proto
    inline_external_data(copy, base_dir)
    return numpy_helper.to_array(copy)


def external_range(tensor: onnx.TensorProto, base_dir: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of an external tensor's bytes, checked as `check_tensor_data`
    checks them (a file inside the model's folder, the range within it)."""
    path = _external_path(tensor, base_dir)
    offset = _external_int(tensor, "offset") or 0
    length = _external_int(tensor, "length")
    if length is None:
        length = path.stat().st_size - offset
    return path, offset, length


def _chunk_reader(tensor: onnx.TensorProto, base_dir: Path) -> ChunkReader:
    """Reads an external float32 tensor a chunk (`tensors.CHUNK_BYTES`) at a time."""
    def read() -> Iterator[np.ndarray]:
        with _external_file(tensor, base_dir) as (fd, offset, length, label):
            step = max(4, tensors.CHUNK_BYTES // 4 * 4)
            for start in range(0, length, step):
                count = min(step, length - start)
                if hasattr(mmap, "MAP_SHARED"):
                    yield _mapped_floats(fd, offset + start, count)
                else:  # no POSIX mmap flags (Windows): read a copy
                    yield np.frombuffer(pread_exact(fd, count, offset + start, label), "<f4")
    return read


def _mapped_floats(fd: int, offset: int, count: int) -> np.ndarray:
    """`count` bytes of an open file from `offset` as float32 values, mapped rather than copied
    (the page cache's pages themselves); unmapped when the array is dropped, so only the chunks
    in use count in the process's memory."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(fd, offset + count - start, flags=mmap.MAP_SHARED | _POPULATE,
                       prot=mmap.PROT_READ, offset=start)
    return np.frombuffer(mapped, dtype="<f4", count=count // 4, offset=offset - start)


#: Map pages in at once (Linux): one call instead of a fault per page.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


#: Data types whose raw bytes are the values as numpy stores them (little-endian).
_RAW_NUMPY_DTYPES: dict[int, np.dtype] = {
    code: np.dtype(spec) for code, spec in (
        (_T.FLOAT, "<f4"), (_T.DOUBLE, "<f8"), (_T.FLOAT16, "<f2"), (_T.INT64, "<i8"),
        (_T.INT32, "<i4"), (_T.INT16, "<i2"), (_T.INT8, "i1"), (_T.UINT64, "<u8"),
        (_T.UINT32, "<u4"), (_T.UINT16, "<u2"), (_T.UINT8, "u1"), (_T.BOOL, "?"))}


class _TensorLoad:
    """Reads one TensorProto's values (a LazyTensor's `load`): an object with two slots rather
    than a closure, which costs three times the memory for each of a few hundred thousand
    constants."""

    __slots__ = ("tensor", "base_dir")

    def __init__(self, tensor: onnx.TensorProto, base_dir: Path | None):
        self.tensor, self.base_dir = tensor, base_dir

    def __call__(self) -> np.ndarray:
        tensor = self.tensor
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            if self.base_dir is None:
                raise AmpError(f"tensor {readable(tensor.name)!r} has external data, but the "
                               f"model was not given as a file path")
            return _external_array(tensor, self.base_dir)
        raw_dtype = _RAW_NUMPY_DTYPES.get(tensor.data_type)
        if raw_dtype is not None and tensor.HasField("raw_data"):
            # What onnx's to_array does for these, without its general dispatch (a million-node
            # model's range checks read a few hundred thousand small constants).
            return np.frombuffer(tensor.raw_data, dtype=raw_dtype).reshape(tuple(tensor.dims))
        return numpy_helper.to_array(tensor)


def lazy_tensor(tensor: onnx.TensorProto, base_dir: Path | None) -> LazyTensor:
    """Wrap a TensorProto without reading its (possibly external) data; an external float32
    tensor streams (range checks and conversion read it a chunk at a time)."""
    streams = (tensor.data_type == onnx.TensorProto.FLOAT
               and tensor.data_location == onnx.TensorProto.EXTERNAL)
    return LazyTensor(dtype_name(tensor.data_type) or "undefined", tuple(tensor.dims),
                      _TensorLoad(tensor, base_dir), handle=tensor,
                      reader=(_chunk_reader(tensor, base_dir)
                              if streams and base_dir is not None else None))


def readable(name: str | bytes) -> str:
    """A name as text: protobuf hands over a string that is not valid UTF-8 as bytes; its bad
    bytes are shown as \\xNN escapes (the model itself keeps the original bytes)."""
    return name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else name


#: Node metadata where torch's dynamo exporter records the modules a node comes from: a Python
#: list of scope names (`['', 'model', 'model.encoder', ..., 'view_1']`), and the same path as
#: `: Cls/model: Cls/.../view_1: aten.view.default`.
_NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
_NAMESPACE_KEY = "namespace"
#: Longer metadata is not parsed (a real scope list is a few hundred characters).
_MAX_SCOPE_METADATA = 1 << 16


def module_scopes(proto: onnx.NodeProto) -> tuple[str, ...]:
    """The module paths an exporter recorded for a node, outermost first, without the root ("")
    and the node's own op entry: ("model", "model.encoder", "model.encoder.layer.0", ...)."""
    props = {readable(p.key): readable(p.value) for p in proto.metadata_props}
    scopes: list[str] = []
    text = props.get(_NAME_SCOPES_KEY, "")
    if text and len(text) <= _MAX_SCOPE_METADATA:
        try:
            parsed = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            parsed = None
        if isinstance(parsed, list) and all(isinstance(item, str) for item in parsed):
            scopes = parsed[:-1]
    if not scopes:
        text = props.get(_NAMESPACE_KEY, "")
        if text and len(text) <= _MAX_SCOPE_METADATA:
            scopes = [part.split(": ", 1)[0] for part in text.split("/")][:-1]
    return tuple(scope for scope in scopes if scope)


def read_model_file(path: str | os.PathLike) -> onnx.ModelProto:
    """Parse an .onnx file without loading external data; bad files raise AmpError."""
    data = read_input_bytes(path, "expected an .onnx file or a SavedModel directory (one with "
                                  "saved_model.pb)")
    return parse_model_bytes(data, str(path))


def parse_model_bytes(data: bytes, label: str) -> onnx.ModelProto:
    """Parse serialized ModelProto bytes; anything but a sound ONNX model raises AmpError."""
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception:
        raise AmpError(f"{label}: not an ONNX model (the protobuf does not parse; truncated or "
                       f"another format?)") from None
    if model.ir_version <= 0 or not model.HasField("graph") or not model.opset_import:
        raise AmpError(f"{label}: not an ONNX model (no graph, IR version or opset import)")
    return model


def walk_graph_protos(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """A graph and every subgraph in its nodes' attributes (If/Loop/Scan bodies), at any depth."""
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            for attr in node.attribute:
                kind = attr.type
                if kind == _GRAPH:
                    stack.append(attr.g)
                elif kind == _GRAPHS:
                    stack.extend(attr.graphs)
                elif kind == _UNDEFINED:
                    stack.extend(_untyped_graphs(attr))


def all_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto in a graph and its subgraphs (initializers and attribute tensors)."""
    # walk_graph_protos's walk, with the tensors read in the same pass over the attributes
    # (each pass costs a second per million nodes); the attribute's type says which field
    # holds something, so the other fields are not asked.
    stack = [graph]
    while stack:
        g = stack.pop()
        yield from g.initializer
        for node in g.node:
            for attr in node.attribute:
                kind = attr.type
                if kind == _GRAPH:
                    stack.append(attr.g)
                elif kind == _GRAPHS:
                    stack.extend(attr.graphs)
                elif kind in _TENSOR_KINDS:
                    yield from attribute_tensors(attr)
                    if kind == _UNDEFINED:
                        stack.extend(_untyped_graphs(attr))


#: Attribute types that may hold tensors (an attribute without a type may hold anything).
_TENSOR_KINDS = frozenset({_TENSOR, _TENSORS, _UNDEFINED})


def attribute_tensors(attr: onnx.AttributeProto) -> Sequence[onnx.TensorProto]:
    """The tensors an attribute holds, by its type; one without a type (IR 1 models): whatever
    tensor fields are set."""
    kind = attr.type
    if kind == _TENSOR:
        return (attr.t,)
    if kind == _TENSORS:
        return attr.tensors
    if kind == _UNDEFINED:
        return ([attr.t] if attr.HasField("t") else []) + list(attr.tensors)
    return ()


def _untyped_graphs(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    """The graphs of an attribute without a type (IR 1 models): whatever fields are set."""
    return ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)


#: A node's type groups without the node: (name, allowed dtypes, why fixed or None, input
#: slots, output slots).
GroupShape = tuple[str, frozenset[str] | None, str | None, tuple[int, ...], tuple[int, ...]]


def _group_shapes(formal: Any, op_type: str,
                  present: tuple[tuple[bool, ...], tuple[bool, ...]]) -> list[GroupShape]:
    """The type groups of every node of one op with the same slots filled (computed once per
    such kind of node: a million-node graph has a few dozen)."""
    plan = _group_plan(formal, op_type, len(present[0]), len(present[1]))
    found: dict[str, tuple[frozenset[str] | None, str | None]] = {}
    slots: dict[tuple[str, bool], list[int]] = {}
    for is_input, slot, key, type_str in plan:
        if not present[0 if is_input else 1][slot]:
            continue
        if key not in found:
            fixed_reason = FIXED_TYPE_PARAMS.get((op_type, type_str))
            if formal.has_containers:
                fixed_reason = "sequence/optional ops keep their element dtype"
            elif op_type in ATTRIBUTE_TYPED_OUTPUTS and (not is_input or op_type == "BitCast"):
                fixed_reason = f"{op_type}'s output dtype is set by an attribute"
            found[key] = (formal.constraints[type_str], fixed_reason)
        slots.setdefault((key, is_input), []).append(slot)
    return [(key, allowed, fixed_reason, tuple(slots.get((key, True), ())),
             tuple(slots.get((key, False), ()))) for key, (allowed, fixed_reason) in found.items()]


class OnnxLoader:
    """Builds the IR for one ONNX model. Use `load_onnx`."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path | None, borrowed: bool = False):
        self.model = model
        self.base_dir = base_dir
        self.borrowed = borrowed
        self.opsets = model_opsets(model)
        self.local_functions = {(f.domain, f.name) for f in model.functions}
        self.hints: dict[str, tuple[str | None, tuple | None]] = {}
        self.group_shapes: dict[tuple, list[GroupShape]] = {}
        self.ir_model = self._new_model()
        self.order = 0
        #: Tensors are checked as the first build meets them (not on a rebuild).
        self.checking_tensors = True
        self.external_data = False
        self.subgraph_hints_collected = False

    def _new_model(self) -> Model:
        return Model(graph=Graph("main"), format="onnx", handle=self.model,
                     borrowed=self.borrowed)

    # -- dtype hints from value_info and shape inference ------------------------------------
    def _collect_hints(self, graphs: Iterator[onnx.GraphProto]) -> None:
        """Dtypes the model itself declares (value_info, inputs, outputs), as fallbacks."""
        for g in graphs:
            for infos in (g.value_info, g.input, g.output):
                for info in infos:
                    elem_type = info.type.tensor_type.elem_type
                    if elem_type and info.name not in self.hints:
                        self.hints[info.name] = (dtype_name(elem_type), None)

    def _add_inferred_hints(self) -> None:
        """Dtypes from onnx shape inference, for values our own schema rules left open."""
        try:
            inferred = onnx.shape_inference.infer_shapes(self.model, strict_mode=False)
        except Exception:  # inference is only a hint source; our own dtype rules come first
            return
        for g in walk_graph_protos(inferred.graph):
            for info in g.value_info:
                tt = info.type.tensor_type
                if info.type.HasField("tensor_type") and tt.elem_type:
                    self.hints.setdefault(info.name, (dtype_name(tt.elem_type), None))

    # -- graphs ---------------------------------------------------------------------------
    def load(self) -> Model:
        # The subgraphs' declarations are read when the first subgraph is met: finding them
        # means a walk over every node's attributes, which a model without any need not pay.
        self._collect_hints(iter([self.model.graph]))
        self._load_graph(self.model.graph, self.ir_model.graph)
        self.checking_tensors = False
        if self._has_unknown_dtypes():
            # Only now pay for shape inference, and rebuild with its answers as hints.
            self._add_inferred_hints()
            self.ir_model = self._new_model()
            self.order = 0
            self._load_graph(self.model.graph, self.ir_model.graph)
            self._dtypes_from_consumers()
        self.ir_model.external_data = self.external_data
        for graph in self.ir_model.graph.walk_graphs():
            for value in graph.values.values():
                value.trim()
        return self.ir_model

    def _check_tensor(self, tensor: onnx.TensorProto) -> None:
        """Refuse a tensor whose data cannot be read as declared (`check_tensor_data`), before
        anything reads it."""
        if not self.checking_tensors:
            return
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            if self.base_dir is None:
                raise AmpError(f"tensor {tensor.name!r} has external data, but the model was "
                               f"not given as a file path")
            self.external_data = True
        check_tensor_data(tensor, self.base_dir)

    def _collect_subgraph_hints(self) -> None:
        if not self.subgraph_hints_collected:
            self.subgraph_hints_collected = True
            main = self.model.graph
            self._collect_hints(g for g in walk_graph_protos(main) if g is not main)

    def _dtypes_from_consumers(self) -> None:
        """A value still of unknown dtype (a custom op's output without value_info) takes the
        dtype its consumers' type groups say it must have, so casts are placed around it."""
        for node in self.ir_model.graph.walk_nodes():
            for value in node.outputs:
                if value is None or value.dtype is not None:
                    continue
                for consumer, slot in value.uses:
                    group = consumer.input_group[slot]
                    dtype = group.dtype if group is not None else None
                    if dtype is not None:
                        value.dtype = value.original_dtype = dtype
                        break

    def _has_unknown_dtypes(self) -> bool:
        return any(value is not None and value.dtype is None
                   for node in self.ir_model.graph.walk_nodes() for value in node.outputs)

    def _new_value(self, graph: Graph, name: str, dtype: str | None = None,
                   shape: tuple | None = None) -> Value:
        hint_dtype, hint_shape = self.hints.get(name, (None, None))
        value = Value(name, graph, dtype or hint_dtype, shape if shape is not None else hint_shape)
        graph.add_value(value)
        self.ir_model.used_names.add(name)
        return value

    def _load_graph(self, proto: onnx.GraphProto, graph: Graph) -> None:
        graph.handle = proto
        # Below IR 4 every initializer is listed as an input too, and is a constant all the same;
        # from IR 4 on, an initializer listed as an input is a default the caller may override.
        graph.initializers_are_inputs = self.model.ir_version < 4
        for init in proto.initializer:
            self._check_tensor(init)
            value = self._new_value(graph, init.name, dtype_name(init.data_type), tuple(init.dims))
            value.const = lazy_tensor(init, self.base_dir)
            graph.initializers[init.name] = value
        for info in proto.input:
            value = graph.values.get(info.name) or self._new_value(graph, info.name)
            tt = info.type.tensor_type
            if info.type.HasField("tensor_type") and tt.elem_type:
                value.dtype = value.original_dtype = dtype_name(tt.elem_type)
            value.overridable = value.const is not None and not graph.initializers_are_inputs
            graph.add_input(value)
        for index, node_proto in enumerate(proto.node[:]):
            graph.append_node(self._load_node(node_proto, graph, index))
        for info in proto.output:
            output = graph.lookup(info.name)
            if output is None:
                raise AmpError(f"graph {proto.name or graph.name!r}: output {info.name!r} is "
                               f"never produced")
            value = output
            if value.dtype is None and info.type.tensor_type.elem_type:
                value.dtype = value.original_dtype = dtype_name(info.type.tensor_type.elem_type)
            graph.add_output(value)

    def _load_node(self, proto: onnx.NodeProto, graph: Graph, index: int) -> Node:
        # Interned: protobuf hands out a new string per read, and a million nodes share a few
        # dozen op types.
        op_type, domain = sys.intern(proto.op_type), sys.intern(proto.domain)
        name = readable(proto.name) or self.ir_model.unique_name(f"{op_type}_{index}")
        node = Node(name, op_type, domain, graph)
        node.handle = proto
        if proto.metadata_props:
            node.scopes = module_scopes(proto)
        node.order = self.order
        self.order += 1
        self.ir_model.used_names.add(name)
        # The main graph has no enclosing scope: its own table is all there is to look in.
        lookup = graph.values.get if graph.parent is None else graph.lookup
        # Sliced: a list made in C, cheaper to walk than protobuf's repeated field (~0.2 us a
        # field, a second or two at a million nodes with the outputs and attributes).
        for input_name in proto.input[:]:
            if not input_name:
                node.add_input(None)
                continue
            value = lookup(input_name)
            if value is None:
                raise AmpError(f"node {name!r} ({proto.op_type}): input {input_name!r} is not "
                               f"produced before it (graph not in topological order, or a "
                               f"missing graph input)")
            node.add_input(value)
        for position, attr in enumerate(proto.attribute[:] if proto.attribute else ()):
            kind = attr.type
            if kind == _INT:
                node.set_attr(attr.name, attr.i)
            elif kind == _FLOAT:
                node.set_attr(attr.name, attr.f)
            elif kind == _INTS and attr.name == "axes":
                # A reduction's axes (before opset 18): the RMS rescale reduces along them
                # again. Other int lists stay in the proto, not on every node.
                node.set_attr(attr.name, tuple(attr.ints))
            elif kind == _TENSOR:
                self._check_tensor(attr.t)
                node.set_attr(attr.name, lazy_tensor(attr.t, self.base_dir))
            elif kind == _TENSORS or kind == _UNDEFINED:
                for tensor in attribute_tensors(attr):
                    self._check_tensor(tensor)
            elif kind == _GRAPH:
                self._collect_subgraph_hints()
                if self.borrowed and node.handle is proto and graph.parent is None:
                    # The emitter rewrites a body inside its node: the caller's node is copied
                    # (and the bodies read from the copy) so that the caller's stays as it is.
                    node.handle = onnx.NodeProto()
                    node.handle.CopyFrom(proto)
                sub = Graph(f"{name}/{attr.name}", parent=graph, owner=node)
                self._load_graph(node.handle.attribute[position].g, sub)
                node.add_subgraph(attr.name, sub)
            elif kind == _GRAPHS:
                raise AmpError(f"node {name!r}: graph-list attributes are not supported")
        for output_name in proto.output[:]:
            if not output_name:
                node.add_output(None)
                continue
            value = self._new_value(graph, output_name)
            node.add_output(value)
            if op_type == "Constant" and "value" in node.attrs:
                value.const = node.attrs["value"]
        self._build_type_groups(node)
        self._infer_output_dtypes(node)
        node.trim()
        return node

    # -- type groups ------------------------------------------------------------------------
    def _build_type_groups(self, node: Node) -> None:
        node.input_group = [None] * len(node.inputs)
        node.output_group = [None] * len(node.outputs)
        if node.op_type in CONTROL_FLOW_OPS and node.domain in ("", "ai.onnx"):
            self._control_flow_groups(node)
            return
        formal = None
        if (node.domain, node.op_type) not in self.local_functions:
            opset = self.opsets.get(node.domain or "")
            if opset is not None:
                formal = _formal(node.op_type, node.domain or "", opset)
        if formal is None:
            node.has_schema = False
            return
        inputs, outputs = node.inputs, node.outputs
        if not (formal.input_counts[0] <= len(inputs) <= formal.input_counts[1]
                and formal.output_counts[0] <= len(outputs) <= formal.output_counts[1]):
            _refuse_slot_counts(node, formal)  # the passes index the slots a schema promises
        # Most nodes fill every slot they have: then the slot counts say which are present.
        shape_key: tuple = (node.op_type, node.domain, len(inputs), len(outputs))
        if None in inputs or None in outputs:
            shape_key = (node.op_type, node.domain, tuple([v is not None for v in inputs]),
                         tuple([v is not None for v in outputs]))
        shapes = self.group_shapes.get(shape_key)
        if shapes is None:
            present = (tuple([v is not None for v in inputs]),
                       tuple([v is not None for v in outputs]))
            shapes = self.group_shapes[shape_key] = _group_shapes(formal, node.op_type, present)
        for key, allowed, fixed_reason, input_slots, output_slots in shapes:
            group = TypeGroup(node, key, input_slots, output_slots, allowed,
                              fixed=fixed_reason is not None, reason=fixed_reason or "")
            node.type_groups.append(group)
            for slot in input_slots:
                node.input_group[slot] = group
            for slot in output_slots:
                node.output_group[slot] = group

    def _control_flow_groups(self, node: Node) -> None:
        """Tie each loop-carried / branch / scan value to one group across the body boundary."""
        self._check_bodies(node)
        cast_formal = _formal("Cast", "", self.opsets.get("", 0))
        castable = cast_formal.constraints.get("T2") if cast_formal is not None else None

        def add(name: str, inputs: list[int], outputs: list[int], defs: list[Value],
                uses: list[tuple[Graph, int]]) -> None:
            group = TypeGroup(node, name, tuple(inputs), tuple(outputs), allowed=castable,
                              inner_defs=tuple(defs), inner_uses=tuple(uses))
            node.type_groups.append(group)
            for slot in inputs:
                node.input_group[slot] = group
            for slot in outputs:
                node.output_group[slot] = group

        if node.op_type == "If":
            then_g, else_g = node.subgraphs.get("then_branch"), node.subgraphs.get("else_branch")
            branches = [g for g in (then_g, else_g) if g is not None]
            for i in range(len(node.outputs)):
                add(f"out{i}", [], [i], [], [(branch, i) for branch in branches])
        elif node.op_type == "Loop":
            body = node.subgraphs["body"]
            carried = len(node.inputs) - 2
            for i in range(carried):
                add(f"carried{i}", [2 + i], [i], [body.inputs[2 + i]], [(body, 1 + i)])
            for k in range(len(node.outputs) - carried):
                add(f"scan_out{k}", [], [carried + k], [], [(body, 1 + carried + k)])
        else:  # Scan; before opset 9 its first input is sequence_lens
            body = node.subgraphs["body"]
            first = 1 if self.opsets.get("", 0) < 9 else 0
            scan_inputs = int(node.attrs.get("num_scan_inputs", 0))
            states = len(node.inputs) - first - scan_inputs
            for i in range(states):
                add(f"state{i}", [first + i], [i], [body.inputs[i]], [(body, i)])
            for j in range(scan_inputs):
                add(f"scan_in{j}", [first + states + j], [], [body.inputs[states + j]], [])
            for k in range(len(node.outputs) - states):
                add(f"scan_out{k}", [], [states + k], [], [(body, states + k)])

    def _check_bodies(self, node: Node) -> None:
        """Refuse an If/Loop/Scan whose bodies do not have the inputs and outputs its own slots
        call for (the groups tie each slot to a body value)."""
        where = f"node {node.name!r} ({node.op_type})"

        def body(name: str, inputs: int | None, outputs: int) -> None:
            graph = node.subgraphs.get(name)
            if graph is None:
                raise AmpError(f"{where}: has no {name} graph")
            if inputs is not None and len(graph.inputs) != inputs:
                raise AmpError(f"{where}: its {name} has {len(graph.inputs)} input(s), the node "
                               f"calls for {inputs}")
            if len(graph.outputs) != outputs:
                raise AmpError(f"{where}: its {name} has {len(graph.outputs)} output(s), the "
                               f"node calls for {outputs}")

        if node.op_type == "If":
            body("then_branch", None, len(node.outputs))
            body("else_branch", None, len(node.outputs))
        elif node.op_type == "Loop":
            carried = len(node.inputs) - 2
            if carried < 0 or len(node.outputs) < carried:
                raise AmpError(f"{where}: {len(node.inputs)} input(s) and {len(node.outputs)} "
                               f"output(s) do not make a loop")
            body("body", len(node.inputs), 1 + len(node.outputs))
        else:
            first = 1 if self.opsets.get("", 0) < 9 else 0
            scan_inputs = int(node.attrs.get("num_scan_inputs", 0))
            states = len(node.inputs) - first - scan_inputs
            if scan_inputs < 0 or states < 0 or len(node.outputs) < states:
                raise AmpError(f"{where}: num_scan_inputs {scan_inputs} does not fit its "
                               f"{len(node.inputs)} input(s) and {len(node.outputs)} output(s)")
            body("body", states + scan_inputs, len(node.outputs))

    # -- dtypes -----------------------------------------------------------------------------
    def _infer_output_dtypes(self, node: Node) -> None:
        """Our own dtype rule for each output; hints only fill what the schema leaves open."""
        for slot, value in enumerate(node.outputs):
            if value is None:
                continue
            dtype = self._output_dtype(node, slot)
            if dtype is not None:
                value.dtype = dtype
            value.original_dtype = value.dtype

    def _output_dtype(self, node: Node, slot: int) -> str | None:
        op = node.op_type
        if node.domain in ("", "ai.onnx"):
            if op == "Cast" and "to" in node.attrs:
                return dtype_name(node.attrs["to"])
            if op == "CastLike" and len(node.inputs) > 1 and node.inputs[1] is not None:
                return node.inputs[1].dtype
            if op in ("Constant", "ConstantOfShape"):
                tensor = node.attrs.get("value")
                if tensor is not None:
                    return tensor.dtype
                return FLOAT32 if op == "ConstantOfShape" else None
            if op in ("RandomNormal", "RandomUniform", "EyeLike", "RandomNormalLike",
                      "RandomUniformLike", "Bernoulli", "Multinomial") and "dtype" in node.attrs:
                return dtype_name(node.attrs["dtype"])
        value = node.outputs[slot]
        assert value is not None
        group = node.output_group[slot] if slot < len(node.output_group) else None
        if group is None:
            formal = (_formal(op, node.domain or "", self.opsets.get(node.domain or "", 0))
                      if node.has_schema and op not in CONTROL_FLOW_OPS else None)
            if formal is not None:
                params = formal.slot_params(formal.outputs, len(node.outputs))
                return _type_str_dtype(params[slot][0]) or value.dtype
            return value.dtype
        for in_slot in group.input_slots:
            source = node.inputs[in_slot]
            if source is not None and source.dtype is not None:
                return source.dtype
        for body, index in group.inner_uses:
            if index < len(body.outputs) and body.outputs[index].dtype:
                return body.outputs[index].dtype
        if group.allowed is not None and len(group.allowed) == 1:
            return next(iter(group.allowed))
        return value.dtype


def load_onnx(model: onnx.ModelProto, base_dir: str | os.PathLike | None = None, *,
              borrowed: bool = False) -> Model:
    """Build the IR for `model`. `base_dir` is the folder external data is relative to.
    `borrowed`: the model is the caller's, which emission must leave as it is (see
    `Model.borrowed`); otherwise emission may patch it in place."""
    return OnnxLoader(model, Path(base_dir) if base_dir is not None else None, borrowed).load()
