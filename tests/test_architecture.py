"""The layout's rules, checked: which modules may import onnx or tensorflow, that only the IR
edits use lists and node order, and that the docs name paths and passes that exist."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "amp_rewriter"
FORMAT_LIBRARIES = ("onnx", "onnxruntime", "tensorflow", "google.protobuf", "tf_keras", "keras")


def modules_under(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def imported_names(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def imports_a_format_library(path: Path) -> list[str]:
    return sorted(n for n in imported_names(path)
                  if any(n == lib or n.startswith(lib + ".") for lib in FORMAT_LIBRARIES))


@pytest.mark.parametrize("path", [p for d in ("ir", "passes", "op_lists", "accuracy", "training")
                                  for p in modules_under(PACKAGE / d)] + [
    PACKAGE / name for name in ("__init__.py", "api.py", "cli.py", "options.py", "report.py",
                                "validation.py", "errors.py", "fileio.py", "flags.py")] + [
    PACKAGE / "formats" / "__init__.py", PACKAGE / "formats" / "base.py"],
    ids=lambda p: str(p.relative_to(PACKAGE)))
def test_format_neutral_modules_import_no_format_library(path):
    assert imports_a_format_library(path) == []


@pytest.mark.parametrize("path", modules_under(PACKAGE / "formats" / "onnx"),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_onnx_modules_import_no_tensorflow(path):
    assert not [n for n in imported_names(path) if n.startswith(("tensorflow", "amp_rewriter.formats.tf"))]
    assert "..tf" not in path.read_text()


@pytest.mark.parametrize("path", modules_under(PACKAGE / "formats" / "tf"),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_tf_modules_import_no_onnx(path):
    assert not [n for n in imported_names(path) if n.split(".")[0] in ("onnx", "onnxruntime")]
    assert "..onnx" not in path.read_text()


def loaded_modules(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running `code`."""
    probe = f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def top_levels(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_importing_ir_passes_training_and_the_package_loads_no_format_library():
    loaded = loaded_modules("import amp_rewriter, amp_rewriter.ir, amp_rewriter.passes, "
                            "amp_rewriter.training, amp_rewriter.cli")
    assert not top_levels(loaded) & {"onnx", "onnxruntime", "tensorflow"}


def test_the_onnx_path_loads_no_tensorflow(tmp_path):
    model = REPO / "examples" / "tiny_cnn.onnx"
    loaded = loaded_modules(
        "import amp_rewriter.formats.onnx\n"
        "from amp_rewriter.cli import main\n"
        f"assert main(['convert', {str(model)!r}, {str(tmp_path / 'out.onnx')!r}, '--quiet',"
        f" '--validate']) == 0")
    assert "onnx" in top_levels(loaded)
    assert "tensorflow" not in top_levels(loaded)
    assert not {m for m in loaded if m.startswith("amp_rewriter.formats.tf")}


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow")
def test_the_tensorflow_path_loads_no_onnx():
    loaded = loaded_modules("import amp_rewriter.tf, amp_rewriter.formats.tf")
    assert "tensorflow" in top_levels(loaded)
    assert not top_levels(loaded) & {"onnx", "onnxruntime"}
    assert not {m for m in loaded if m.startswith("amp_rewriter.formats.onnx")}


# -- only the IR edits use lists and node order -----------------------------------------------

#: Attributes that hold IR edges: changing them by hand would leave the other end stale.
EDGE_ATTRIBUTES = {"uses", "graph_output_uses", "control_inputs", "control_users",
                   "control_outputs"}
MUTATORS = {"append", "remove", "extend", "insert", "clear", "pop", "sort", "reverse"}


def edge_mutations(path: Path) -> list[str]:
    """Lines of `path` that change IR edges or node order without going through the IR."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            base = target.value if isinstance(target, ast.Subscript) else target
            subscript = isinstance(target, ast.Subscript)
            if isinstance(base, ast.Attribute) and (
                    base.attr in EDGE_ATTRIBUTES
                    or (base.attr == "nodes" and not subscript and not _is_self(base.value))
                    or (base.attr in ("inputs", "outputs") and subscript)):
                found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Attribute):
            owner = node.func.value
            if owner.attr in EDGE_ATTRIBUTES or (owner.attr == "nodes"
                                                 and not _is_self(owner.value)):
                found.append(f"{path.name}:{node.lineno}")
    return found


def _is_self(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id == "self"


def test_nothing_outside_the_ir_edits_use_lists_or_node_order():
    outside = [p for p in modules_under(PACKAGE) if "ir" not in p.relative_to(PACKAGE).parts[:1]]
    assert [hit for path in outside for hit in edge_mutations(path)] == []


def test_the_scan_finds_hand_edits():
    sample = ("value.uses.append((node, 0))\nnode.inputs[0] = other\ngraph.nodes = []\n"
              "value.graph_output_uses.remove(x)\n")
    path = Path(__file__).parent / "_edge_scan_sample.py"
    path.write_text(sample)
    try:
        assert len(edge_mutations(path)) == 4
    finally:
        path.unlink()


# -- the docs match the code ----------------------------------------------------------------------

def test_docs_name_paths_that_exist_and_every_pass():
    from amp_rewriter.passes import PIPELINES, REGISTRY

    architecture = (REPO / "docs" / "architecture.md").read_text()
    readme = (REPO / "README.md").read_text()
    for text in (architecture, readme):
        for path in re.findall(r"\bamp_rewriter/[\w/.]+", text):
            assert (REPO / path.rstrip(".")).exists(), path
    for name in REGISTRY:
        assert f"`{name}`" in architecture, name
    for pipeline in PIPELINES:
        assert f"`{pipeline}`" in architecture, pipeline


def test_the_readme_diagram_lists_the_passes_of_each_pipeline():
    """README's "How it decides" diagram: one drawing per pipeline, named by its input file,
    listing that pipeline's passes in order, no more and no fewer."""
    from amp_rewriter.passes import PIPELINES, REGISTRY

    readme = (REPO / "README.md").read_text()
    section = readme.split("## How it decides", 1)[1]
    block = section.split("```", 2)[1]
    drawings = {"model.onnx": "onnx", "graph.pb": "tf"}
    found: dict[str, list[str]] = {}
    for drawing in block.strip().split("\n\n"):
        source = drawing.split()[0]
        assert source in drawings, f"a drawing for an unknown input {source!r}"
        found[drawings[source]] = [word for word in re.findall(r"[a-z0-9_]+", drawing)
                                   if word in REGISTRY]
    assert found == {name: PIPELINES[name] for name in drawings.values()}


def test_formats_are_declared_by_their_list_files(tmp_path, monkeypatch):
    """A format is its package and its op_lists/<name>.toml: the registry reads each list
    file's [format] table (library, suffixes, the files that make a directory one model), and a
    misspelt key there is an error naming the file and the key."""
    from amp_rewriter import formats, op_lists
    from amp_rewriter.errors import AmpError

    declared = formats.declarations()
    assert declared["onnx"].suffixes == (".onnx",) and declared["tf"].library == "tensorflow"
    assert declared["tf"].package == "amp_rewriter.formats.tf"
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "saved_model.pb").write_bytes(b"")
    assert formats.model_format(saved) == "tf" and formats.model_format(tmp_path) is None
    assert formats.model_path(saved / "saved_model.pb") == saved
    assert [formats.model_format(tmp_path / n) for n in ("m.onnx", "g.meta", "r.json")] \
        == ["onnx", "tf", None]

    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "mine.toml").write_text(
        'title = "Mine"\n[format]\nlibrary = "mine"\nsufixes = [".mine"]\n')
    monkeypatch.setattr(op_lists, "_DATA_DIR", tmp_path / "lists")
    monkeypatch.setattr(op_lists, "_LIST_CACHE", {})
    with pytest.raises(AmpError, match=r"mine\.toml \[format\]: unknown key\(s\) 'sufixes'"):
        op_lists.format_declarations()


# -- testkit, scripts and tests ------------------------------------------------------------------

SCRIPTS = sorted((REPO / "scripts").glob("*.py"))


def _imported_private_names(path: Path) -> list[str]:
    """`from amp_rewriter... / testkit... import _name` in `path`."""
    return [f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module
            and node.module.split(".")[0] in ("amp_rewriter", "testkit")
            for alias in node.names if alias.name.startswith("_")]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_script_imports_no_other_script_and_no_private_name(path):
    scripts = {p.stem for p in SCRIPTS}
    assert not top_levels(imported_names(path)) & scripts
    assert _imported_private_names(path) == []


@pytest.mark.parametrize("path", sorted((REPO / "tests").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(REPO / "tests")))
def test_a_test_edits_no_import_path_and_loads_no_file_by_path(path):
    """Tests import testkit and examples/ through pytest's `pythonpath` (pyproject.toml)."""
    assert _path_edits_and_loads(path.read_text()) == []


def _path_edits_and_loads(source: str) -> list[str]:
    """The calls in `source` that edit sys.path or load a module from a file."""
    calls = [ast.unparse(node.func) for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Call)]
    return [call for call in calls if call.endswith(("sys.path.insert", "sys.path.append",
                                                     "spec_from_file_location", "run_path"))]


def test_the_path_edit_check_sees_them():
    source = ("import sys, runpy, importlib.util\nsys.path.insert(0, 'x')\n"
              "runpy.run_path('s.py')\nimportlib.util.spec_from_file_location('m', 'm.py')\n")
    assert _path_edits_and_loads(source) == ["sys.path.insert", "runpy.run_path",
                                             "importlib.util.spec_from_file_location"]


def test_testkit_modules_run_under_another_version_import_no_amp_rewriter():
    """same_output, training_identity and the fuzzer import this testkit, then the amp_rewriter
    of the version they test: testkit must not have imported one already."""
    loaded = loaded_modules("import testkit.same_output_cases, testkit.same_output_corpus, "
                            "testkit.training_identity, testkit.fuzz, testkit.fuzz_cases, "
                            "testkit.onnx_corpus")
    assert "testkit" in top_levels(loaded)
    assert "amp_rewriter" not in top_levels(loaded)
