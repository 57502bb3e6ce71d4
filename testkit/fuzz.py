"""The fuzzer of the amp-rewriter CLI (its command line: scripts/fuzz.py): recipes drawn by
hypothesis (testkit.fuzz_cases) become case folders; each case runs as the CLI in a forked child
(or a spawned `python -m amp_rewriter`) under memory, file-size and time limits, and `check`
turns its exit status, output, files and memory into problems: a crash, a hang, a traceback or
an "unexpected" error, more than one error line, an exit other than 0/1/2, a changed input, a
file left behind on failure, a destroyed file, a write outside the output, an output that does
not load or does not hold its input's weights, memory the input did not pay for.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from testkit import fuzz_cases

#: The checkout this testkit belongs to: whose amp_rewriter a spawned case runs by default.
CHECKOUT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
#: Files in $TMPDIR that are not a run's temporaries: `import onnxruntime` keeps its telemetry
#: session id in $TMPDIR/.ses (made once, kept on purpose; microsoft/onnxruntime#32476). Only a
#: `--spawn` case sees it, since a forked case inherits an onnxruntime the server imported.
NOT_OURS = frozenset({".ses"})
MIB = 1 << 20
#: Memory a case may use above a trivial run, and per byte of its input: the bound the issue
#: asks for ("by the input's real size, not its declared one").
MEMORY_FLOOR = 768 * MIB
MEMORY_PER_INPUT_BYTE = 64
#: Largest file a case may write (RLIMIT_FSIZE): a copy that follows /dev/zero stops here.
FILE_SIZE_CAP = 256 * MIB
PROG = "amp-rewriter"


# -- generating recipes ------------------------------------------------------------------------

def _collector(strategy, count: int, seed: int, sink: list[dict]):
    """A hypothesis test that appends every recipe it is given to `sink`."""
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(strategy)
    def collect(recipe: dict) -> None:
        sink.append(recipe)
    return collect


def generate(count: int, seed: int, families: list[str] | None = None) -> list[dict]:
    """`count` distinct recipes drawn by hypothesis from `seed` (same seed, same recipes),
    shared evenly between the families (hypothesis alone favours some branches)."""
    strategies = fuzz_cases.family_strategies()
    names = sorted(families or strategies)
    recipes: list[dict] = []
    for position, family in enumerate(names):
        quota = count // len(names) + (position < count % len(names))
        if quota == 0:  # fewer cases than families: the first families get one each
            continue
        found: dict[str, dict] = {}
        for attempt in range(20):
            drawn: list[dict] = []
            _collector(strategies[family], quota, seed * 1000 + attempt * 37 + position,
                       drawn)()
            for recipe in drawn:
                key = json.dumps(recipe, sort_keys=True)
                if key not in found and len(found) < quota:
                    found[key] = recipe
            if len(found) >= quota:
                break
        recipes.extend(found.values())
    # interleave the families, so a partial run or a parallel batch mixes them
    return sorted(recipes, key=lambda r: (hash_key(r), r["family"]))


def hash_key(recipe: dict) -> str:
    """A stable pseudo-random order key of a recipe."""
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


# -- snapshots ---------------------------------------------------------------------------------

def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> what is there (file hash, link target, kind), never opening anything
    but regular files (a FIFO or a device must not be read)."""
    result: dict[str, str] = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            info = path.lstat()
            mode = info.st_mode
            if stat.S_ISLNK(mode):
                result[rel] = f"link:{os.readlink(path)}"
            elif stat.S_ISDIR(mode):
                result[rel] = "dir"
            elif stat.S_ISREG(mode):
                digest = hashlib.sha256()
                with open(path, "rb") as handle:
                    for chunk in iter(lambda: handle.read(1 << 20), b""):
                        digest.update(chunk)
                result[rel] = f"file:{digest.hexdigest()}"
            else:
                result[rel] = f"special:{stat.S_IFMT(mode):o}:{info.st_rdev}"
    return result


def input_bytes(root: Path, inputs: list[str]) -> int:
    """Bytes the case's inputs really hold (regular files only, links not followed)."""
    total = 0
    for rel in inputs:
        path = root / rel
        if path.is_symlink() or not path.exists():
            continue
        if path.is_dir():
            total += sum(p.lstat().st_size for p in path.rglob("*")
                         if not p.is_symlink() and p.is_file())
        elif path.is_file():
            total += path.stat().st_size
    return total


# -- running -----------------------------------------------------------------------------------

@dataclass
class Case:
    """A recipe made into files: where, the command and what it may touch."""

    index: int
    recipe: dict
    folder: Path
    meta: Path
    argv: list[str]
    inputs: list[str]
    outputs: list[str]
    before: dict[str, str] = field(default_factory=dict)
    input_size: int = 0
    error: str = ""


@dataclass
class Outcome:
    """What a case did and what was wrong with it."""

    index: int
    family: str
    op: str
    argv: list[str]
    exit_code: int | None
    signal: int | None
    timed_out: bool
    seconds: float
    max_rss: int
    stderr: str
    stdout_tail: str
    problems: list[str] = field(default_factory=list)
    recipe: dict = field(default_factory=dict)


def _child(case: Case, mem_cap: int) -> None:
    """In the forked child: limits, folder, files, then the CLI; never returns."""
    code = 99
    try:
        os.setpgid(0, 0)
        resource.setrlimit(resource.RLIMIT_AS, (mem_cap, mem_cap))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_CAP, FILE_SIZE_CAP))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        tmp = case.meta / "tmp"
        os.environ["TMPDIR"] = str(tmp)
        tempfile.tempdir = str(tmp)
        os.chdir(case.folder)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(case.meta / "stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(case.meta / "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        from amp_rewriter import cli

        sys.argv = [PROG, *case.argv]
        try:
            code = cli.main(case.argv)
        except SystemExit as exc:  # argparse's --help
            code = exc.code if isinstance(exc.code, int) else 0
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: B036  (anything escaping the CLI is a finding)
        traceback.print_exc()
        sys.stderr.flush()
        code = 98
    os._exit(code)


def _spawn(case: Case, mem_cap: int, code: Path) -> subprocess.Popen:
    """The case as a real `python -m amp_rewriter` process (slow: one interpreter each)."""
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mem_cap, mem_cap))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_CAP, FILE_SIZE_CAP))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    env = dict(os.environ, TMPDIR=str(case.meta / "tmp"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "amp_rewriter", *case.argv], cwd=case.folder,
                            stdin=subprocess.DEVNULL, stdout=open(case.meta / "stdout", "wb"),
                            stderr=open(case.meta / "stderr", "wb"), env=env,
                            preexec_fn=limits, start_new_session=True)


class Runner:
    """Runs cases `jobs` at a time (forked children, or subprocesses with `spawn` that import
    the amp_rewriter of the checkout `code`)."""

    def __init__(self, jobs: int, mem_cap: int, timeout: float, spawn: bool = False,
                 code: Path = CHECKOUT):
        self.jobs = jobs
        self.code = code
        self.mem_cap = mem_cap
        self.timeout = timeout
        self.spawn = spawn

    def run(self, cases: list[Case]):
        """Yield (case, exit status, rusage, seconds, timed_out) as cases finish."""
        pending = list(reversed(cases))
        running: dict[int, tuple[Case, float, subprocess.Popen | None]] = {}
        while pending or running:
            while pending and len(running) < self.jobs:
                case = pending.pop()
                if self.spawn:
                    process = _spawn(case, self.mem_cap, self.code)
                    running[process.pid] = (case, time.monotonic(), process)
                else:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        _child(case, self.mem_cap)
                    running[pid] = (case, time.monotonic(), None)
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                now = time.monotonic()
                for child, (case, started, _process) in list(running.items()):
                    if now - started > self.timeout:
                        _kill(child)
                        _, status, usage = os.wait4(child, 0)
                        del running[child]
                        yield case, status, usage, now - started, True
                time.sleep(0.005)
                continue
            if pid in running:
                case, started, _process = running.pop(pid)
                yield case, status, usage, time.monotonic() - started, False


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, signal.SIGKILL)


# -- checks ------------------------------------------------------------------------------------

def _under(path: str, roots: list[str]) -> bool:
    """Whether `path` is one of `roots`, lies inside one, or (for a root ending in `*`, such as
    `out.onnx.*` for a model's data files) starts with it."""
    return any(path.startswith(root[:-1]) if root.endswith("*")
               else path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


# -- what a successful run wrote -----------------------------------------------------------------

#: Largest relative difference between an input weight and the output's copy of it, per dtype:
#: the rounding to that dtype (a weight overwritten by other bytes is off by far more).
_WEIGHT_RTOL = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 0.0}
#: Each dtype's largest finite value: an fp32 weight beyond it becomes inf, or this (--clamp).
_FINITE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": float("inf")}


def verify_outputs(case: Case, written: list[str]) -> list[str]:
    """Problems with what a successful run wrote: every ONNX model loads with its external data
    and passes onnx's checker, and each weight it shares by name with the input model holds
    the input's values (rounded to its dtype; saturated where --clamp saturates); every report
    and --json parses as a JSON object; every TensorFlow graph parses."""
    problems = []
    for rel in written:
        path = case.folder / rel
        if path.suffix == ".onnx" and path.is_file():
            problems += _verify_onnx_output(case, path)
    for flag in ("--report", "--json"):
        if flag in case.argv[:-1]:
            rel = case.argv[case.argv.index(flag) + 1]
            try:
                loaded = json.loads((case.folder / rel).read_text())
            except (OSError, ValueError) as exc:
                problems.append(f"output destroyed: {flag} {rel} does not parse ({exc})")
                continue
            if not isinstance(loaded, dict):
                problems.append(f"output destroyed: {flag} {rel} is no JSON object")
    return problems


def _verify_onnx_output(case: Case, path: Path) -> list[str]:
    import numpy as np
    import onnx
    from onnx import numpy_helper

    rel = path.relative_to(case.folder)
    try:
        output = onnx.load_model(str(path), load_external_data=True)
        onnx.checker.check_model(output)
    except Exception as exc:  # noqa: BLE001  (any failure to load is the finding)
        return [f"output destroyed: {rel} does not load ({type(exc).__name__}: "
                f"{str(exc).strip()[:120]})"]
    source_rel = case.argv[1] if case.argv[:1] == ["convert"] and len(case.argv) > 2 else ""
    if not source_rel.endswith(".onnx"):
        return []
    try:
        source = onnx.load_model(str(case.folder / source_rel), load_external_data=True)
    except Exception:  # noqa: BLE001  (an input onnx cannot load: nothing to compare with)
        return []
    originals = {t.name: t for t in source.graph.initializer
                 if t.data_type == onnx.TensorProto.FLOAT}
    problems = []
    for tensor in output.graph.initializer:
        before = originals.get(tensor.name)
        dtype = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
                 onnx.TensorProto.BFLOAT16: "bfloat16"}.get(tensor.data_type)
        if before is None or dtype is None or list(before.dims) != list(tensor.dims):
            continue
        limit = _FINITE_MAX[dtype]
        with np.errstate(all="ignore"):
            old = numpy_helper.to_array(before).astype(np.float64)
            new = numpy_helper.to_array(tensor).astype(np.float64)
            rounded = np.abs(new - old) <= _WEIGHT_RTOL[dtype] * np.abs(old) + 1e-7
            overflowed = (np.abs(old) > limit) & ((np.abs(new) == limit) | np.isinf(new)) & (
                np.sign(new) == np.sign(old))  # inf, or saturated by --clamp
        same = (old == new) | np.isnan(old) & np.isnan(new) | rounded | overflowed
        if not np.all(same):
            problems.append(f"output does not match its input: {rel}'s weight {tensor.name!r} "
                            f"is not the input's values in {dtype}")
            break
    return problems


def check(case: Case, status: int, usage, seconds: float, timed_out: bool,
          baseline_rss: int) -> Outcome:
    """Every rule the issue sets, on one finished case."""
    stderr = (case.meta / "stderr").read_text(errors="replace")
    stdout = (case.meta / "stdout").read_text(errors="replace")
    exit_code = os.waitstatus_to_exitcode(status) if not timed_out else None
    sig = -exit_code if exit_code is not None and exit_code < 0 else None
    outcome = Outcome(case.index, case.recipe["family"], str(case.recipe.get("op", "")),
                      case.argv, exit_code if sig is None else None, sig, timed_out, seconds,
                      usage.ru_maxrss * 1024, stderr, stdout[-400:], recipe=case.recipe)
    problems = outcome.problems
    if timed_out:
        problems.append("hang: killed after the time limit")
    elif sig is not None:
        problems.append(f"crash: killed by signal {signal.Signals(sig).name}")
    elif exit_code not in (0, 1, 2):
        problems.append(f"exit code {exit_code}")
    text = stdout + stderr
    if "Traceback" in text:
        problems.append("traceback printed")
    if "unexpected" in text.lower():
        problems.append("'unexpected' error")
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith(f"{PROG}: warning:")]
    if exit_code not in (None, 0) and sig is None:
        if len(errors) != 1:
            problems.append(f"{len(errors)} error lines on stderr (want exactly 1)")
    if any(not line.startswith(f"{PROG}:") for line in lines):
        problems.append("stderr line not from amp-rewriter (library noise)")
    after = snapshot(case.folder)
    changed = sorted(path for path in set(case.before) | set(after)
                     if case.before.get(path) != after.get(path))
    # A new file a successful run was allowed to write may lie in an input's folder (a model
    # converted beside its own external data); what the input held may not change.
    touched_inputs = [p for p in changed if _under(p, case.inputs) and not (
        exit_code == 0 and p not in case.before and _under(p, case.outputs))]
    if touched_inputs:
        problems.append(f"input changed: {', '.join(touched_inputs[:4])}")
    allowed = case.outputs if exit_code == 0 else []
    if exit_code == 0:
        problems += verify_outputs(case, [p for p in changed if _under(p, allowed)
                                          and p in after and after[p].startswith("file:")])
    stray = [p for p in changed if not _under(p, allowed) and not _under(p, case.inputs)]
    if stray:
        what = "left behind after a failure" if exit_code else "written outside the output"
        problems.append(f"{what}: {', '.join(stray[:4])}")
    destroyed = [p for p in changed if case.before.get(p, "").startswith("special:")
                 and not _under(p, case.inputs)]
    if destroyed:
        problems.append(f"device, FIFO or socket replaced: {', '.join(destroyed[:4])}")
    leftovers = [path for path in (case.meta / "tmp").iterdir() if path.name not in NOT_OURS] \
        if (case.meta / "tmp").exists() else []
    if leftovers:
        problems.append(f"temporary files left: {', '.join(p.name for p in leftovers[:3])}")
    budget = baseline_rss + MEMORY_FLOOR + MEMORY_PER_INPUT_BYTE * case.input_size
    if outcome.max_rss > budget:
        problems.append(f"memory: peak RSS {outcome.max_rss / MIB:.0f} MiB over the budget "
                        f"{budget / MIB:.0f} MiB for {case.input_size} input bytes")
    return outcome


# -- the server --------------------------------------------------------------------------------

def import_everything() -> None:
    """What every case needs, imported once in the server (TensorFlow quietly)."""
    import onnxruntime  # noqa: F401

    import amp_rewriter.cli  # noqa: F401
    import amp_rewriter.formats.onnx  # noqa: F401
    import amp_rewriter.formats.tf  # noqa: F401
    import amp_rewriter.formats.tf.training.rewrite  # noqa: F401


def build_seeds_in_child(seed_dir: Path) -> None:
    """Build the seeds in a forked child: it runs TensorFlow, which the server must not."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            err = os.open(seed_dir.parent / "seeds.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(err, 2)
            os.dup2(err, 1)
            fuzz_cases.build_seeds(seed_dir)
        except BaseException:  # noqa: B036
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        log = (seed_dir.parent / "seeds.log").read_text(errors="replace")
        raise SystemExit(f"fuzz: building the seed models failed:\n{log[-3000:]}")


def prepare(index: int, recipe: dict, work: Path, seeds: fuzz_cases.Seeds) -> Case:
    """Case `index`: the recipe's files in a fresh folder, with a snapshot of what is there."""
    folder = work / "cases" / f"{index:05d}"
    meta = work / "meta" / f"{index:05d}"
    for path in (folder, meta):
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    (meta / "tmp").mkdir()
    (meta / "recipe.json").write_text(json.dumps(recipe, indent=1))
    files = fuzz_cases.materialize(recipe, folder, seeds)
    case = Case(index, recipe, folder, meta, files.argv, files.inputs, files.outputs)
    case.before = snapshot(folder)
    case.input_size = input_bytes(folder, files.inputs)
    return case


def measure_baseline(runner: Runner, work: Path, seeds: fuzz_cases.Seeds) -> int:
    """Peak RSS of a trivial run (usage error), the zero of the memory budget."""
    recipe = {"family": "cli_misuse", "op": "no_args", "k": 0, "tf": False}
    case = prepare(0, recipe, work, seeds)
    peaks = [usage.ru_maxrss * 1024 for _, _, usage, _, _ in runner.run([case])]
    return peaks[0]


def summarize(outcomes: list[Outcome], wall: float) -> str:
    """The summary table: per family, cases, exit codes, problems, time."""
    by_family: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        by_family[outcome.family].append(outcome)
    rows = [("family", "cases", "exit 0", "exit 1", "exit 2", "failed", "crash", "hang",
             "max s", "max RSS MiB")]
    for family in sorted(by_family) + ["all"]:
        group = outcomes if family == "all" else by_family[family]
        codes = Counter(o.exit_code for o in group)
        rows.append((family, str(len(group)), str(codes[0]), str(codes[1]), str(codes[2]),
                     str(sum(bool(o.problems) for o in group)),
                     str(sum(o.signal is not None for o in group)),
                     str(sum(o.timed_out for o in group)),
                     f"{max((o.seconds for o in group), default=0):.1f}",
                     f"{max((o.max_rss for o in group), default=0) / MIB:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
                       for i, cell in enumerate(row)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(-1, lines[1])
    kinds = Counter(problem.split(":")[0] for o in outcomes for problem in o.problems)
    lines.append(f"{len(outcomes)} cases in {wall:.0f} s; problems: "
                 + (", ".join(f"{k} x{v}" for k, v in kinds.most_common()) or "none"))
    return "\n".join(lines)
