"""Models with external data convert a chunk at a time (issue 11, item 1), and long steps show a
progress bar on a terminal (item 4).

The chunk size is lowered (`ir.tensors.CHUNK_BYTES`) so these small models take the same
streaming path as a model of several gigabytes: every weight is read, range checked, converted
and written in many slices.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pty
import resource
import select
import signal
import struct
import subprocess
import sys
import termios
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import amp_rewriter
from amp_rewriter import cli
from amp_rewriter.formats.onnx import emit
from amp_rewriter.formats.onnx.emit import _fp16_chunk, _ort_fp16_cast, save_onnx
from amp_rewriter.formats.onnx.validate import validate_conversion
from amp_rewriter.ir import tensors
from amp_rewriter.ir.tensors import _check_block, _check_range, convert_array
from testkit.models import BUILDERS

REPO = Path(__file__).resolve().parent.parent


def save_external(model: onnx.ModelProto, path: Path, threshold: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=threshold)
    return path


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 96 bytes: every weight of the test models streams in many slices."""
    monkeypatch.setattr(tensors, "CHUNK_BYTES", 96)


def block_with_big_values(folder: Path) -> Path:
    """The transformer block with one weight holding values beyond fp16's range and below its
    smallest subnormal, all tensors external."""
    model = BUILDERS["transformer_block"]()
    weight = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    values = numpy_helper.to_array(weight).copy()
    values.reshape(-1)[:3] = [1e6, -7e4, 1e-9]
    weight.CopyFrom(numpy_helper.from_array(values, weight.name))
    return save_external(model, folder / "block.onnx")


@pytest.mark.parametrize("extra", [{}, {"target": "bf16"}, {"clamp": True}])
def test_streaming_output_is_the_in_memory_output(tmp_path: Path, small_chunks: None,
                                                  extra: dict) -> None:
    source = block_with_big_values(tmp_path / "in")
    before = digests(source.parent)
    streamed = tmp_path / "streamed" / "out.onnx"
    streamed.parent.mkdir()
    _, streamed_report = amp_rewriter.convert_file(source, streamed, **extra)
    # The API's model holds every converted weight in memory; saved whole, it must be the same.
    model, memory_report = amp_rewriter.convert(source, **extra)
    in_memory = tmp_path / "memory" / "out.onnx"
    in_memory.parent.mkdir()
    save_onnx(model, in_memory, source_dir=source.parent, external=True)
    assert digests(streamed.parent) == digests(in_memory.parent)
    assert streamed_report.to_dict()["constants"] == memory_report.to_dict()["constants"]
    assert digests(source.parent) == before  # the input's files are untouched


def test_two_streaming_runs_give_the_same_bytes(tmp_path: Path, small_chunks: None) -> None:
    source = block_with_big_values(tmp_path / "in")
    outputs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        amp_rewriter.convert_file(source, tmp_path / name / "out.onnx")
        outputs.append(digests(tmp_path / name))
    assert outputs[0] == outputs[1]
    assert set(outputs[0]) == {"out.onnx", "out.onnx.data"}


def test_range_check_on_bits_counts_what_the_conversion_does() -> None:
    rng = np.random.default_rng(1)
    for dtype in ("float16", "bfloat16"):
        overflow_from, zero_up_to = tensors._rounding_limits(dtype)
        edges = np.array([overflow_from, overflow_from - 1, zero_up_to, zero_up_to + 1, 0, 1,
                          0x7F800000, 0x7FC00000, 0x7F800001], np.uint32)
        for _ in range(20):
            bits = np.concatenate([rng.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32),
                                   edges, edges | np.uint32(0x80000000)])
            values = np.concatenate([bits.view(np.float32),
                                     rng.standard_normal(500).astype(np.float32) * 1e-7])
            with np.errstate(all="ignore"):
                expected = _check_range(values, dtype)
            got = _check_block(values, dtype)
            assert (got.overflowed, got.flushed_to_zero, got.nonzero) == (
                expected.overflowed, expected.flushed_to_zero, expected.nonzero)


def test_range_check_of_a_few_values_counts_what_the_conversion_does() -> None:
    """Small constants are checked one value at a time in Python: the same counts as the
    check on bit patterns, at the edges of each dtype's range too."""
    rng = np.random.default_rng(2)
    for dtype in ("float16", "bfloat16"):
        overflow_from, zero_up_to = tensors._rounding_limits(dtype)
        edges = np.array([overflow_from, overflow_from - 1, zero_up_to, zero_up_to + 1, 0, 1,
                          0x7F800000, 0x7FC00000, 0x3F800000, 0x477FE000, 0x477FF000],
                         np.uint32)
        pool = np.concatenate([edges, edges | np.uint32(0x80000000)]).view(np.float32)
        for size in range(1, tensors._FEW_VALUES + 1):
            for _ in range(200):
                values = np.where(rng.random(size) < 0.5, rng.choice(pool, size),
                                  rng.standard_normal(size).astype(np.float32)
                                  * np.float32(10.0) ** rng.integers(-30, 30, size))
                values = values.astype(np.float32)
                with np.errstate(all="ignore"):
                    got = _check_range(values, dtype)
                expected = _check_block(values, dtype)
                assert (got.overflowed, got.flushed_to_zero, got.nonzero) == (
                    expected.overflowed, expected.flushed_to_zero, expected.nonzero), values


@pytest.mark.parametrize("block", [7, 1 << 18])
def test_range_check_split_between_threads_counts_as_one_pass(monkeypatch: pytest.MonkeyPatch,
                                                              block: int) -> None:
    """Chunks are split between threads on block boundaries: the counts of an uneven split
    (chunks of odd lengths, blocks that do not divide them) are those of the whole array."""
    monkeypatch.setattr(tensors, "_BLOCK", block)
    rng = np.random.default_rng(3)
    values = (rng.standard_normal(1_000_003) * 3e3).astype(np.float32)
    values[::101] = 1e-9
    values[::997] = np.inf
    chunks = np.split(values, [5, 400_000, 400_001, 999_000])
    with np.errstate(all="ignore"):
        expected = _check_range(values, "float16")
    assert tensors.check_range_chunks(chunks, "float16") == expected


def test_fast_fp16_cast_gives_numpys_bits() -> None:
    cast = _ort_fp16_cast()
    assert cast is not None  # onnxruntime is part of the test set-up
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0x7F800001, 0x7FBFFFFF, 0x7FC00001, 0xFFC12345, 0x477FF000, 0x33000000,
                        0x33000001, 0x80000000, 0x7F800000], np.uint32)
    values = np.concatenate([bits.view(np.float32), special.view(np.float32),
                             rng.standard_normal(5000).astype(np.float32) * 1e-5])
    for clamp in (False, True):
        expected = convert_array(values, "float16", clamp)
        assert np.array_equal(_fp16_chunk(values, clamp, cast).view(np.uint16),
                              expected.view(np.uint16))


@pytest.mark.parametrize("layout", ["single", "per-tensor", "inline"])
def test_external_data_layouts_load_in_onnxruntime_and_agree(tmp_path: Path, small_chunks: None,
                                                             layout: str) -> None:
    source = save_external(BUILDERS["transformer_block"](), tmp_path / "in" / "block.onnx")
    out = tmp_path / layout / "out.onnx"
    out.parent.mkdir()
    amp_rewriter.convert_file(source, out, external_data=layout)
    names = sorted(p.name for p in out.parent.iterdir())
    model = onnx.load(str(out), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    if layout == "inline":
        assert names == ["out.onnx"] and not external
    elif layout == "single":
        assert names == ["out.onnx", "out.onnx.data"] and external
    else:
        assert names == ["out.onnx"] + sorted(f"out.onnx.{i}.data" for i in range(len(external)))
    onnx.checker.check_model(str(out), full_check=True)
    reference = tmp_path / "ref.onnx"
    onnx.save_model(BUILDERS["transformer_block"](), str(reference))
    from amp_rewriter.formats.onnx.validate import random_inputs
    feeds = random_inputs(onnx.load(str(reference)))
    comparisons, _ = validate_conversion(reference, out, feeds)
    errors = {c.name: c.max_abs for c in comparisons}
    # Every layout holds the same model: each runs, with the same outputs.
    single = tmp_path / "single-ref" / "out.onnx"
    single.parent.mkdir()
    amp_rewriter.convert_file(source, single)
    assert errors == {c.name: c.max_abs for c in validate_conversion(reference, single, feeds)[0]}
    assert all(c.relative < 2e-2 for c in comparisons)


def test_inline_past_the_protobuf_limit_is_refused_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    source = save_external(BUILDERS["transformer_block"](), tmp_path / "in" / "block.onnx")
    monkeypatch.setattr(emit, "PROTOBUF_LIMIT", 1000)  # a small model stands for a 2 GiB one
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code = cli.main(["convert", str(source), str(out_dir / "o.onnx"),
                                  "--external-data", "inline"])
    err = capsys.readouterr().err
    assert code == 2 and "over protobuf's 2 GiB limit" in err and len(err.strip().splitlines()) == 1
    assert list(out_dir.iterdir()) == []


def test_bad_external_data_options_are_one_line_errors(tmp_path: Path, capsys) -> None:
    source = save_external(BUILDERS["cnn"](), tmp_path / "in" / "cnn.onnx")
    for flags, message in ((["--external-data", "split"], "--external-data must be one of"),
                           (["--external-data-threshold", "-1"], "must be an integer >= 0")):
        code = cli.main(["convert", str(source), str(tmp_path / "o.onnx"), *flags])
        err = capsys.readouterr().err
        assert code == 2 and message in err, err
    assert not (tmp_path / "o.onnx").exists()


def _limit_file_size() -> None:
    """The child may write files of at most 64 KiB; a larger write fails with EFBIG."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def test_a_write_that_fails_midway_leaves_no_output(tmp_path: Path) -> None:
    model = BUILDERS["transformer_block"]()
    big = helper.make_tensor("unused_weight", TensorProto.FLOAT, [256, 256],
                             np.ones(256 * 256, np.float32).tobytes(), raw=True)
    model.graph.initializer.append(big)  # 256 KiB: its copy breaks the 64 KiB limit
    source = save_external(model, tmp_path / "in" / "block.onnx")
    before = digests(source.parent)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "out.onnx").write_bytes(b"an earlier output")
    result = subprocess.run(
        [sys.executable, "-m", "amp_rewriter", "convert", str(source), str(out_dir / "out.onnx")],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        preexec_fn=_limit_file_size, timeout=300)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "cannot write" in result.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == ["out.onnx"]
    assert (out_dir / "out.onnx").read_bytes() == b"an earlier output"
    assert digests(source.parent) == before


# -- progress bars -------------------------------------------------------------------------------

def _convert_with_stderr(source: Path, output: Path, on_terminal: bool, *flags: str,
                         sized: bool = True) -> str:
    """Run the CLI with stderr on a pseudo-terminal (`sized`: of 100 columns, else of the
    zero size a fresh one reports) or a pipe; what it wrote there."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "AMP_REWRITER_PROGRESS_DELAY": "0"}
    command = [sys.executable, "-m", "amp_rewriter", "convert", str(source), str(output), *flags]
    if not on_terminal:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stderr
    controller, terminal = pty.openpty()
    if sized:  # a terminal of 100 columns, as a user's
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=terminal)
    os.close(terminal)
    seen = b""
    while True:
        ready, _, _ = select.select([controller], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(controller, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        seen += data
    os.close(controller)
    assert process.wait(timeout=300) == 0, seen
    return seen.decode(errors="replace")


def test_progress_bars_show_on_a_terminal_only(tmp_path: Path) -> None:
    source = save_external(BUILDERS["transformer_block"](), tmp_path / "in" / "block.onnx")
    terminal = _convert_with_stderr(source, tmp_path / "a.onnx", True)
    assert "converting" in terminal and "writing" in terminal and "checking weights" in terminal
    assert "\r" in terminal  # a bar redrawn in place
    piped = _convert_with_stderr(source, tmp_path / "b.onnx", False)
    assert "converting" not in piped and "\r" not in piped
    quiet = _convert_with_stderr(source, tmp_path / "c.onnx", True, "--quiet")
    assert "converting" not in quiet and "\r" not in quiet
    # A pty nobody sized (`script` under automation) reports 0 columns: bars are drawn anyway.
    unsized = _convert_with_stderr(source, tmp_path / "d.onnx", True, sized=False)
    assert "converting" in unsized and "\r" in unsized


def test_weights_left_fp32_are_copied_by_byte_range(tmp_path: Path, small_chunks: None) -> None:
    rng = np.random.default_rng(3)
    kept = rng.standard_normal((4, 256)).astype(np.float32)
    converted = rng.standard_normal((256, 256)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "kept"], ["s"], name="pinned"),
         helper.make_node("MatMul", ["s", "converted"], ["y"], name="matmul")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 256])],
        [numpy_helper.from_array(kept, "kept"), numpy_helper.from_array(converted, "converted")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    source = save_external(model, tmp_path / "in" / "m.onnx")
    out = tmp_path / "out" / "m.onnx"
    out.parent.mkdir()
    amp_rewriter.convert_file(source, out, keep_nodes=["pinned"])
    result = {t.name: t for t in onnx.load(str(out)).graph.initializer}
    assert result["kept"].data_type == TensorProto.FLOAT
    assert np.array_equal(numpy_helper.to_array(result["kept"]), kept)
    assert np.array_equal(numpy_helper.to_array(result["converted"]), converted.astype(np.float16))


def test_a_converted_weight_does_not_keep_its_fp32_source_nor_itself_after_release() -> None:
    """`convert --auto` keeps the IR of each conversion: a converted weight read whole (not
    streamed) must not leave the fp32 values cached in its source, and the emitter's release
    must free the converted ones (a 1 GiB model held 1.5 GB this way per conversion)."""
    loads = []

    def load() -> np.ndarray:
        loads.append(1)
        return np.linspace(-2, 2, 64, dtype=np.float32).reshape(8, 8)

    source = tensors.LazyTensor("float32", (8, 8), load, reloadable=True)
    low = source.converted("float16", clamp=False)
    values = low.numpy()
    assert values.dtype == np.float16 and source._array is None
    low.release()
    assert low._array is None
    np.testing.assert_array_equal(low.numpy(), values)  # computed again from the source
    assert len(loads) == 2
    source.numpy()  # read by someone else first: the conversion leaves it cached
    source.converted("float16", clamp=False).numpy()
    assert source._array is not None
