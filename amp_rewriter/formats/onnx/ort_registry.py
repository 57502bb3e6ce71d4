"""What onnxruntime itself knows about ops, read from its Python bindings.

- Its op schemas (`get_all_operator_schema`): every op it registers, contrib domains included
  (com.microsoft, com.microsoft.nchwc, ...) and the default-domain ops onnx does not define
  (SimplifiedLayerNormalization). The loader falls back to them for ops onnx has no schema for,
  so their type constraints become type groups.
- Its CPU provider's kernels (`get_all_opkernel_def`): which dtypes each op has a CPU kernel for,
  so validation knows which low-precision ops the CPU can really run and which it must emulate.

Both tables are read once and cached. onnxruntime is imported only when one is first needed; when
it is not installed the tables are empty (contrib ops then stay fp32 barriers, as unknown ops do).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from typing import Any

from ...errors import AmpError
from ...quiet import native_stderr_silenced

#: onnxruntime's provider name for its CPU kernels.
CPU_PROVIDER = "CPUExecutionProvider"

#: The domains onnxruntime registers ops in beside onnx's (for messages).
ORT_DOMAINS = ("com.microsoft", "com.microsoft.nchwc", "com.ms.internal.nhwc")


#: The log severity of our onnxruntime sessions: 4, fatal only. A kernel that fails logs its
#: coloured "[E:onnxruntime ...] ExecuteKernel" line before the exception that says so, which
#: is ours to print, in one line.
_LOG_FATAL_ONLY = 4


@cache
def onnxruntime() -> Any | None:
    """onnxruntime, imported once and quietly, or None when it is not installed: what its C++
    side writes while it starts goes to /dev/null (where HOME is not writable, a warning on every
    run that it cannot persist a telemetry device id). Its default logger is left as it is (a
    program using the API keeps its own settings); our sessions log through
    `session_options`. Every use of onnxruntime here goes through this function."""
    try:
        with native_stderr_silenced():
            import onnxruntime as ort
    except ImportError:
        return None
    return ort


def required() -> Any:
    """`onnxruntime()` where a run cannot do without it: AmpError when it is not installed."""
    ort = onnxruntime()
    if ort is None:
        raise AmpError("running ONNX models needs onnxruntime (pip install 'amp-rewriter[cpu]' "
                       "or '[gpu]')")
    return ort


def session_options() -> Any:
    """onnxruntime SessionOptions whose session logs nothing below fatal: a model that fails to
    load or run raises, and the caller says so in one line."""
    options = required().SessionOptions()
    options.log_severity_level = _LOG_FATAL_ONLY
    return options


def _bindings() -> Any | None:
    """onnxruntime's C++ bindings module, or None when onnxruntime is not installed."""
    if onnxruntime() is None:
        return None
    from onnxruntime.capi import onnxruntime_pybind11_state as bindings

    return bindings


def available() -> bool:
    """Whether onnxruntime (CPU or GPU wheel) can be imported."""
    return _bindings() is not None


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


@cache
def _schema_table() -> Mapping[tuple[str, str], tuple[Any, ...]]:
    """(domain, op) -> onnxruntime's schemas for it, oldest first."""
    bindings = _bindings()
    if bindings is None:
        return {}
    table: dict[tuple[str, str], list[Any]] = {}
    for schema in bindings.get_all_operator_schema():
        table.setdefault((schema.domain, schema.name), []).append(schema)
    return {key: tuple(sorted(schemas, key=lambda s: s.since_version))
            for key, schemas in table.items()}


def schema(op_type: str, domain: str, opset: int) -> Any | None:
    """onnxruntime's schema for `op_type` in `domain` at that domain's `opset` (the newest one
    registered at or below it), or None."""
    chosen = None
    for candidate in _schema_table().get((_domain(domain), op_type), ()):
        if candidate.since_version <= opset:
            chosen = candidate
    return chosen


def has_op(op_type: str, domain: str = "") -> bool:
    """Whether onnxruntime registers a schema for the op at any version."""
    return (_domain(domain), op_type) in _schema_table()


@cache
def _cpu_kernel_table() -> Mapping[tuple[str, str], tuple[tuple[int, int, dict], ...]]:
    """(domain, op) -> (first version, last version, type constraints) of every CPU kernel."""
    bindings = _bindings()
    if bindings is None:
        return {}
    table: dict[tuple[str, str], list[tuple[int, int, dict]]] = {}
    for kernel in bindings.get_all_opkernel_def():
        if kernel.provider != CPU_PROVIDER:
            continue
        first, last = kernel.version_range
        constraints = {param: frozenset(_type_str_dtype(t) for t in types)
                       for param, types in kernel.type_constraints.items()}
        table.setdefault((_domain(kernel.domain), kernel.op_name), []).append(
            (first, last, constraints))
    return {key: tuple(kernels) for key, kernels in table.items()}


def _type_str_dtype(type_str: str) -> str:
    """'tensor(float16)' -> 'float16' (our dtype names: float -> float32, double -> float64)."""
    inner = type_str[len("tensor("):-1] if type_str.startswith("tensor(") else type_str
    return {"float": "float32", "double": "float64"}.get(inner, inner)


def cpu_kernel_for(op_type: str, domain: str, since_version: int,
                   dtypes: Iterable[tuple[str, str]]) -> bool | None:
    """Whether the CPU provider registers a kernel for the op (the schema version that starts at
    `since_version`) with these (type parameter, dtype) pairs, e.g. [("T", "float16")].

    None when onnxruntime is not installed. A parameter the kernel does not constrain matches
    anything; a parameter of ours the kernel constrains must be in its list.
    """
    if _bindings() is None:
        return None
    wanted = list(dtypes)
    for first, last, constraints in _cpu_kernel_table().get((_domain(domain), op_type), ()):
        if not first <= since_version <= last:
            continue
        if all(dtype in constraints[param] for param, dtype in wanted if param in constraints):
            return True
    return False


def version() -> str | None:
    """The installed onnxruntime's version string, or None."""
    ort = onnxruntime()
    return None if ort is None else str(ort.__version__)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence onnxruntime's Python tools (the transformer optimizer, symbolic shape inference):
    they log each step, print progress and, through the packages they import, warn; the CLI's
    output stays ours."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)
