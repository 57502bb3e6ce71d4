#!/usr/bin/env python
"""Conversion cases on disk for scripts/same_output.py: record one, find them all, replay one.

A case is one call of a public amp_rewriter entry point with fixed inputs and options, kept as a
folder with a `case.json` and the input model file(s). scripts/same_output.py replays every case
under its cache folder once per code version and compares the output bytes; any tool (the test
suite, say) can add cases with `record_case`.

Case format (`FORMAT` 1), one folder per case, anywhere below the cases root (a folder whose name
starts with "." is skipped); the case's name is its folder's path relative to the root:

    <root>/<part>/<name...>/case.json
    {
      "format": 1,
      "kind": "onnx" | "onnx_file" | "tf_graphdef" | "tf_saved_model" | "tf_meta" | "tf_training",
      "model": "model.onnx",          # the input, relative to the case folder (a file or a folder)
      "options": {"target": "fp16", "backend": "ort-cuda", "keep_io_types": true, ...},
      "outputs": ["y", "z:1"],        # tf_graphdef / tf_meta: the fetches (null: the default)
      "env": {"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD": "Relu"},   # optional
      "input": "path" | "proto",      # onnx only: pass the path (default) or an onnx.ModelProto
      "output": "model.onnx",         # file kinds only: the output's file name (default: the
                                      # input's)
      "note": "free text"             # optional
    }

`options` are the keyword arguments of the entry point; `config` in them names a TOML file in the
case folder. How each kind is replayed (`replay_case`), and which bytes are compared:

    onnx            amp_rewriter.convert(model, **options)            -> the ModelProto, serialized
                                                                         deterministically
    onnx_file       amp_rewriter.convert_file(model, out, **options)     -> every file written (the
                                                                            .onnx and its .data)
    tf_graphdef     amp_rewriter.tf.convert_graphdef(graph_def, outputs, **options) -> the GraphDef
    tf_saved_model  amp_rewriter.tf.convert_saved_model(model, out, **options) -> every file
                                                                            written;
                                                                            fingerprint.pb with its
                                                                            random uuid cleared
    tf_meta         amp_rewriter.tf.convert_tf_file(model, out, outputs, **options) -> the file
                    (a .meta, or a .pb/.pbtxt GraphDef file)
    tf_training     amp_rewriter.tf.rewrite_training_graph(model, **options) -> .meta_graph_def
                    (serialized deterministically) and the result's tensor/op names; options
                    include loss, train_op, target, backend, loss_scale, ...

A case that raises gives the exception's class name and first line (paths of the case and output
folders replaced by <case> and <out>) instead. Every result also carries the decisions of the
report: node name -> precision (per type group when a node has several), reasons left out.

This module imports neither amp_rewriter nor TensorFlow at module level (record_case imports onnx
or TensorFlow only to serialize a proto or a tf.Graph), so a test suite can import it before the
code under test, and scripts/same_output.py can run this file by path under each code version:

    from testkit import same_output_cases
    same_output_cases.record_case("bench_out/same_output/cases/tests", "onnx", model_proto,
                                  {"target": "fp16", "backend": "ort-cuda"},
                                  name="test_e2e/cnn_fp16")

`python testkit/same_output_cases.py replay ROOT RESULTS.jsonl [--expect-root DIR] [--only ...]`
is what scripts/same_output.py runs in a subprocess per code version.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

FORMAT = 1
CASE_FILE = "case.json"
KINDS = ("onnx", "onnx_file", "tf_graphdef", "tf_saved_model", "tf_meta", "tf_training")
#: Environment variable: when set, the test suite records its conversions into the folder it
#: names (testkit.record_cases).
RECORD_ENV = "AMP_REWRITER_RECORD_CASES"
#: Grappler's list variables; cleared in the replay process unless a case sets them.
GRAPPLER_ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"

_COMMON_OPTIONS = {"target", "backend", "keep_io_types", "clamp", "allow", "infer", "deny", "clear",
                   "keep_nodes", "config", "check"}
#: Keyword arguments each kind's entry point takes (checked by record_case to catch typos).
OPTIONS = {
    "onnx": _COMMON_OPTIONS,
    "onnx_file": _COMMON_OPTIONS,
    "tf_graphdef": _COMMON_OPTIONS,
    "tf_saved_model": _COMMON_OPTIONS,
    "tf_meta": _COMMON_OPTIONS,
    "tf_training": {"target", "backend", "clamp", "allow", "infer", "deny", "clear", "keep_nodes",
                    "config", "loss", "train_op", "loss_scale", "initial_scale",
                    "growth_interval", "growth_factor", "backoff_factor", "min_scale",
                    "hysteresis"},
}
_DEFAULT_MODEL_FILE = {"onnx": "model.onnx", "onnx_file": "model.onnx", "tf_graphdef": "graph.pb",
                       "tf_saved_model": "saved_model", "tf_meta": "model.meta",
                       "tf_training": "model.meta"}
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._+=,@/-]")
#: tempfile's random names (`.amp-rewriter-k2j4x_9a`, `tmpk2j4x_9a`) in error messages.
_RANDOM_NAME = re.compile(r"((?:^|[/'\"\s])(?:[.\w-]*-|tmp))[a-z0-9_]{8}(?=[/'\"\s]|$)")


# ------------------------------------------------------------------------------------------------
# Recording
# ------------------------------------------------------------------------------------------------
def record_case(directory: str | os.PathLike, kind: str, model: Any,
                options: dict[str, Any] | None = None, *, name: str | None = None,
                outputs: Iterable[str] | None = None, env: dict[str, str] | None = None,
                input: str = "path", output: str | None = None, note: str | None = None,
                link: bool = False) -> Path:
    """Write one case under `directory` (a cases root, or a folder below one) and return its folder.

    kind: one of KINDS.
    model: what the entry point takes, as an object or a file:
        onnx, onnx_file   an onnx.ModelProto (without external data), serialized bytes, or the
                          path of an .onnx file (external data files it names are copied along);
        tf_graphdef       a GraphDef, its bytes, or a .pb / .pbtxt file;
        tf_saved_model    a SavedModel directory (copied);
        tf_meta           a MetaGraphDef, or a .meta / .pb / .pbtxt file;
        tf_training       a tf.Graph (exported with its collections), a MetaGraphDef, a GraphDef,
                          or a .meta / .pb / .pbtxt file.
    options: the entry point's keyword arguments (target, backend, keep_io_types, clamp, allow,
        infer, deny, clear, keep_nodes, check; for tf_training loss, train_op, loss_scale, ...).
        `config` is the path of a TOML file, copied into the case. `outputs` may be given here too.
    name: the case folder below `directory` ("/" nests); default `<kind>-<hash of the content>`.
    outputs: fetches for tf_graphdef / tf_meta (None: the entry point's default).
    env: environment variables set while the case runs (Grappler's list variables, say).
    input: onnx only: "path" (convert gets the file name) or "proto" (an onnx.ModelProto).
    output: file kinds: the output file's name (default: the input's), e.g. "out.pbtxt".
    link: hard-link input files instead of copying them (inputs are never modified); ONNX
        external data files are always copied (onnx refuses a data file with several links).

    Recording the same content again is a no-op; a different case under an existing name
    replaces it. Raises ValueError for an unknown kind or option, TypeError for a model it cannot
    store.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown case kind {kind!r} (expected one of {', '.join(KINDS)})")
    options = dict(options or {})
    if "outputs" in options:
        if outputs is not None:
            raise ValueError("outputs given twice (argument and options)")
        outputs = options.pop("outputs")
    unknown = sorted(set(options) - OPTIONS[kind])
    if unknown:
        raise ValueError(f"{kind}: unknown option(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(OPTIONS[kind]))})")
    if outputs is not None and kind not in ("tf_graphdef", "tf_meta"):
        raise ValueError(f"{kind}: outputs are for tf_graphdef and tf_meta cases")
    if input not in ("path", "proto") or (input == "proto" and kind != "onnx"):
        raise ValueError("input must be 'path', or 'proto' for onnx cases")
    if isinstance(outputs, str):
        outputs = [outputs]

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".recording-"))
    os.chmod(staging, 0o755)
    try:
        model_name = _store_model(kind, model, staging, link)
        config = options.get("config")
        if config is not None:
            config_path = Path(config)
            if not config_path.is_file():
                raise ValueError(f"config {config!s}: no such file")
            stored = config_path.name
            if stored in (model_name, CASE_FILE) or stored.startswith("."):
                stored = "config.toml"
            shutil.copyfile(config_path, staging / stored)
            options["config"] = stored
        spec: dict[str, Any] = {"format": FORMAT, "kind": kind, "model": model_name,
                                "options": _jsonable(options)}
        if outputs is not None:
            spec["outputs"] = [str(o) for o in outputs]
        if env:
            spec["env"] = {str(k): str(v) for k, v in sorted(env.items())}
        if input != "path":
            spec["input"] = input
        if output is not None:
            if "/" in output or output in ("", ".", ".."):
                raise ValueError(f"output must be a plain file name, got {output!r}")
            spec["output"] = output
        if note:
            spec["note"] = note
        (staging / CASE_FILE).write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
        if name is None:
            name = f"{kind}-{tree_digest(staging)[:16]}"
        target = root / _clean_name(name)
        if target.is_dir() and (target / CASE_FILE).is_file() \
                and tree_digest(target) == tree_digest(staging):
            return target  # already recorded
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / CASE_FILE).is_file():  # not just another process recording it
                raise
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _clean_name(name: str) -> str:
    parts = [_NAME_CHARS.sub("_", p) for p in str(name).strip("/").split("/") if p]
    if not parts or any(p.startswith(".") for p in parts):
        raise ValueError(f"bad case name {name!r}")
    return "/".join(parts)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"option value {value!r} is not JSON-serializable")


def _put_file(source: Path, target: Path, link: bool) -> None:
    if link:
        try:
            os.link(source, target)
            return
        except OSError:
            pass
    shutil.copyfile(source, target)


def _store_model(kind: str, model: Any, staging: Path, link: bool) -> str:
    """Write the input into the staging folder; returns its name there."""
    type_name = type(model).__name__
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if kind == "tf_saved_model":
            if not path.is_dir():
                raise ValueError(f"{path}: not a SavedModel directory")
            shutil.copytree(path, staging / "saved_model",
                            copy_function=lambda src, dst: _put_file(Path(src), Path(dst), link))
            return "saved_model"
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
        if kind in ("onnx", "onnx_file"):
            _put_file(path, staging / "model.onnx", link)
            for location in _external_locations(path):
                (staging / location).parent.mkdir(parents=True, exist_ok=True)
                # Copied even with link: onnx refuses external data files with several links.
                _put_file(path.parent / location, staging / location, False)
            return "model.onnx"
        suffix = path.suffix if path.suffix in (".pb", ".pbtxt", ".meta") else ".pb"
        if kind == "tf_graphdef" and suffix == ".meta":
            raise ValueError(f"{path}: a tf_graphdef case takes a .pb or .pbtxt GraphDef")
        stored = ("graph" if kind == "tf_graphdef" else "model") + suffix
        _put_file(path, staging / stored, link)
        return stored
    if kind == "tf_saved_model":
        raise TypeError("a tf_saved_model case takes the path of a SavedModel directory")
    if isinstance(model, (bytes, bytearray)):
        stored = _DEFAULT_MODEL_FILE[kind]
        (staging / stored).write_bytes(bytes(model))
        return stored
    if type_name == "Graph" and kind == "tf_training":
        import tensorflow as tf

        with model.as_default():
            meta = tf.compat.v1.train.export_meta_graph(graph=model)
        (staging / "model.meta").write_bytes(meta.SerializeToString(deterministic=True))
        return "model.meta"
    expected = {"onnx": ("ModelProto",), "onnx_file": ("ModelProto",),
                "tf_graphdef": ("GraphDef",), "tf_meta": ("MetaGraphDef",),
                "tf_training": ("MetaGraphDef", "GraphDef")}[kind]
    if type_name not in expected or not hasattr(model, "SerializeToString"):
        raise TypeError(f"a {kind} case takes a {' or '.join(expected)} or a path, "
                        f"not {type_name}")
    if kind in ("onnx", "onnx_file") and _has_external_data(model):
        raise TypeError("the ModelProto refers to external data: record its file path instead")
    stored = "graph.pb" if type_name == "GraphDef" else _DEFAULT_MODEL_FILE[kind]
    if kind == "tf_training" and type_name == "GraphDef":
        stored = "model.pb"
    (staging / stored).write_bytes(model.SerializeToString(deterministic=True))
    return stored


def _onnx_tensors(model: Any) -> Iterable[Any]:
    from onnx import external_data_helper

    return external_data_helper._get_all_tensors(model)


def _has_external_data(model: Any) -> bool:
    from onnx import TensorProto

    return any(t.data_location == TensorProto.EXTERNAL for t in _onnx_tensors(model))


def _external_locations(path: Path) -> list[str]:
    """The external data files an .onnx file names (relative to its folder)."""
    import onnx
    from onnx import TensorProto

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001  (a broken file is a valid input for an error case)
        return []
    locations = []
    for tensor in _onnx_tensors(model):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), None)
        if location is None:
            continue
        if Path(location).is_absolute() or ".." in Path(location).parts:
            raise ValueError(f"{path}: external data {location!r} is outside the model's folder")
        if location not in locations:
            locations.append(location)
    return locations


# ------------------------------------------------------------------------------------------------
# Finding cases
# ------------------------------------------------------------------------------------------------
def find_cases(root: str | os.PathLike, only: Iterable[str] | None = None,
               skip: Iterable[str] | None = None) -> list[tuple[str, Path]]:
    """(name, folder) of every case below `root`, sorted by name.

    only / skip: top-level folder names (parts) to keep / leave out.
    """
    root = Path(root)
    only_set = set(only) if only else None
    skip_set = set(skip or ())
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        if CASE_FILE in filenames:
            folder = Path(dirpath)
            name = folder.relative_to(root).as_posix()
            part = name.split("/")[0]
            if (only_set is None or part in only_set) and part not in skip_set:
                found.append((name, folder))
            dirnames[:] = []  # a case folder holds no further cases
    return sorted(found)


def part_of(name: str) -> str:
    """The corpus part a case belongs to: the first folder of its name."""
    return name.split("/")[0]


# ------------------------------------------------------------------------------------------------
# Replaying
# ------------------------------------------------------------------------------------------------
def sha256(data: bytes) -> str:
    """Hex SHA-256 of `data`: how results name output bytes."""
    return hashlib.sha256(data).hexdigest()


def tree_digest(folder: Path) -> str:
    """One digest over every file below `folder` (relative paths and contents)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(sha256(path.read_bytes()).encode() + b"\n")
    return digest.hexdigest()


def decisions(report: Any) -> dict[str, str]:
    """node -> precision from a Report (or its dict); per type group when its groups differ.

    Nodes of other graphs (SavedModel functions, subgraphs) are keyed `graph::node`; a repeated
    key gets `#2`, `#3`, ... in report order. Reasons are left out on purpose.
    """
    nodes = report["nodes"] if isinstance(report, dict) else report.nodes
    result: dict[str, str] = {}
    for entry in nodes:
        key = f"{entry['graph']}::{entry['name']}" if entry.get("graph") else str(entry["name"])
        value = str(entry.get("precision"))
        groups = entry.get("groups") or []
        if len({g.get("precision") for g in groups}) > 1:
            value += "[" + ",".join(f"{g.get('group')}={g.get('precision')}" for g in groups) + "]"
        if key in result:
            index = 2
            while f"{key}#{index}" in result:
                index += 1
            key = f"{key}#{index}"
        result[key] = value
    return result


def explanations(report: Any) -> list[dict[str, Any]]:
    """Every node entry of a Report (or its dict) as the report writes it: with each decision's
    kind, reason and path, which `decisions` leaves out."""
    nodes = report["nodes"] if isinstance(report, dict) else report.nodes
    return [dict(entry) for entry in nodes]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip()


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _fingerprint_bytes(data: bytes) -> bytes:
    """fingerprint.pb without its random uuid (as is if it does not parse)."""
    try:
        from tensorflow.core.protobuf import fingerprint_pb2

        fingerprint = fingerprint_pb2.FingerprintDef()
        fingerprint.ParseFromString(data)
        if "uuid" in fingerprint.DESCRIPTOR.fields_by_name:
            fingerprint.ClearField("uuid")
        return fingerprint.SerializeToString(deterministic=True)
    except Exception:  # noqa: BLE001
        return data


def _folder_outputs(folder: Path) -> dict[str, str]:
    outputs = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        data = path.read_bytes()
        if path.name == "fingerprint.pb":
            data = _fingerprint_bytes(data)
            rel += " (uuid cleared)"
        outputs[rel] = sha256(data)
    return outputs


def replay_case(case_dir: str | os.PathLike, scratch: str | os.PathLike) -> dict[str, Any]:
    """Run one case with the amp_rewriter that `import amp_rewriter` finds; a JSON-able result.

    {"kind", "status": "ok" | "error", "outputs": {name: sha256}, "digest": sha256 over them,
     "decisions": {node: precision}, "decisions_digest", "explanations_digest",
     "error": "Class: first line", "seconds"}
    """
    import warnings

    case_dir = Path(case_dir).resolve()
    spec = json.loads((case_dir / CASE_FILE).read_text())
    kind = spec.get("kind")
    result: dict[str, Any] = {"kind": kind}
    out_dir = Path(scratch) / "out"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    started = time.perf_counter()
    try:
        if spec.get("format") != FORMAT:
            raise ValueError(f"case format {spec.get('format')!r}, expected {FORMAT}")
        options = dict(spec.get("options") or {})
        if options.get("config") is not None:
            options["config"] = str(case_dir / options["config"])
        model_path = case_dir / spec["model"]
        out_path = out_dir / spec.get("output", Path(spec["model"]).name)
        with _environment(spec.get("env") or {}), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outputs, report = _run(kind, spec, model_path, out_path, out_dir, options)
        result["status"] = "ok"
        result["outputs"] = outputs
        result["digest"] = sha256(json.dumps(outputs, sort_keys=True).encode())
        chosen = decisions(report)
        result["decisions"] = chosen
        result["decisions_digest"] = sha256(json.dumps(chosen, sort_keys=True).encode())
        result["explanations_digest"] = sha256(json.dumps(
            explanations(report), sort_keys=True, default=str).encode())
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001  (error behaviour is compared too)
        message = _first_line(exc)
        for path, placeholder in ((out_dir, "<out>"), (case_dir, "<case>"),
                                  (Path(scratch), "<scratch>")):
            message = message.replace(str(path.resolve()), placeholder).replace(str(path),
                                                                                 placeholder)
        result["status"] = "error"
        result["error"] = _RANDOM_NAME.sub(r"\1XXXXXXXX", message)
    result["seconds"] = round(time.perf_counter() - started, 3)
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


def _run(kind: str, spec: dict, model_path: Path, out_path: Path, out_dir: Path,
         options: dict) -> tuple[dict[str, str], Any]:
    outputs_arg = spec.get("outputs")
    if kind == "onnx":
        import amp_rewriter

        source: Any = str(model_path)
        if spec.get("input") == "proto":
            import onnx
            source = onnx.load(str(model_path))
        model, report = amp_rewriter.convert(source, **options)
        return {"model": sha256(model.SerializeToString(deterministic=True))}, report
    if kind == "onnx_file":
        import amp_rewriter

        _model, report = amp_rewriter.convert_file(model_path, out_path, **options)
        return _folder_outputs(out_dir), report
    if kind == "tf_graphdef":
        from tensorflow.core.framework import graph_pb2

        from amp_rewriter.tf import convert_graphdef

        graph_def = graph_pb2.GraphDef()
        if model_path.suffix == ".pbtxt":
            from google.protobuf import text_format
            text_format.Parse(model_path.read_text(), graph_def)
        else:
            graph_def.ParseFromString(model_path.read_bytes())
        converted, report = convert_graphdef(graph_def, outputs_arg, **options)
        return {"graph_def": sha256(converted.SerializeToString(deterministic=True))}, report
    if kind == "tf_saved_model":
        from amp_rewriter.tf import convert_saved_model

        report = convert_saved_model(model_path, out_path, **options)
        return _folder_outputs(out_dir), report
    if kind == "tf_meta":
        from amp_rewriter.tf import convert_tf_file

        report = convert_tf_file(model_path, out_path, outputs_arg, **options)
        return _folder_outputs(out_dir), report
    if kind == "tf_training":
        from amp_rewriter.tf import rewrite_training_graph

        rewrite = rewrite_training_graph(str(model_path), **options)
        names = {key: getattr(rewrite, key, None)
                 for key in ("loss", "train_op", "loss_scale", "good_steps",
                             "loss_scale_variable", "good_steps_variable", "bad_steps",
                             "all_finite", "init_op")}
        outputs = {"meta_graph_def": sha256(rewrite.meta_graph_def.SerializeToString(
                       deterministic=True)),
                   "names": sha256(json.dumps(names, sort_keys=True).encode())}
        return outputs, rewrite.report
    raise ValueError(f"unknown case kind {kind!r}")


def _check_origin(expect_root: Path) -> str:
    """Import amp_rewriter and make sure it (and every submodule loaded) comes from expect_root."""
    import amp_rewriter

    where = Path(amp_rewriter.__file__).resolve()
    root = expect_root.resolve()
    if root not in where.parents:
        raise SystemExit(f"replay: amp_rewriter comes from {where}, not from {root} "
                         f"(is PYTHONPATH set?)")
    return str(where)


def _stray_modules(expect_root: Path) -> list[str]:
    root = expect_root.resolve()
    stray = []
    for name, module in sorted(sys.modules.items()):
        if name == "amp_rewriter" or name.startswith("amp_rewriter."):
            file = getattr(module, "__file__", None)
            if file and root not in Path(file).resolve().parents:
                stray.append(f"{name} ({file})")
    return stray


def replay_main(argv: list[str]) -> int:
    """`replay ROOT RESULTS.jsonl ...`: replay every case under ROOT into RESULTS."""
    import argparse

    parser = argparse.ArgumentParser(prog="same_output_cases.py replay")
    parser.add_argument("root", type=Path, help="the cases root")
    parser.add_argument("results", type=Path, help="JSON lines written here")
    parser.add_argument("--expect-root", type=Path,
                        help="fail unless amp_rewriter is imported from this checkout")
    parser.add_argument("--only", default="", help="comma-separated parts (top-level folders)")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out")
    args = parser.parse_args(argv)

    for key in [k for k in os.environ if k.startswith(GRAPPLER_ENV_PREFIX)]:
        del os.environ[key]
    origin = None
    if args.expect_root is not None:
        origin = _check_origin(args.expect_root)
    else:
        import amp_rewriter
        origin = str(Path(amp_rewriter.__file__).resolve())
    cases = find_cases(args.root, [p for p in args.only.split(",") if p] or None,
                       [p for p in args.skip.split(",") if p])
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="same_output_replay-") as scratch, \
            open(args.results, "w") as results:
        header = {"header": True, "amp_rewriter": origin, "cases": len(cases),
                  "python": sys.version.split()[0], "pid": os.getpid()}
        results.write(json.dumps(header) + "\n")
        results.flush()
        for name, folder in cases:
            record = {"case": name, **replay_case(folder, scratch)}
            results.write(json.dumps(record, sort_keys=True) + "\n")
            results.flush()
        stray = _stray_modules(args.expect_root) if args.expect_root is not None else []
        results.write(json.dumps({"footer": True, "stray_modules": stray}) + "\n")
    if stray:
        print(f"replay: amp_rewriter modules from outside the checkout: {', '.join(stray)}",
              file=sys.stderr)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    """This file as a command (scripts/same_output.py runs it under each code version)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "replay":
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        print("usage: same_output_cases.py replay ROOT RESULTS.jsonl [--expect-root DIR] "
              "[--only PARTS] [--skip PARTS]", file=sys.stderr)
        return 2
    return replay_main(args[1:])


if __name__ == "__main__":
    # Run by path, Python put testkit/ itself first on sys.path: its modules (models, fuzz, ...)
    # must not shadow names the replayed version imports.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    sys.exit(main())
