"""Hostile inputs through the real CLI (scripts/fuzz.py): a quick sample of generated cases, and
issue 13's crashes, hangs and memory bombs and issue 35's destroyed files, hangs and exit codes
as named regressions.

One fuzz run serves both tests: it imports TensorFlow once and forks every case from there, under
a memory cap (RLIMIT_AS), a file-size cap and a time limit, so a case that would crash, hang or
allocate gigabytes fails its own check instead of the test session. `python scripts/fuzz.py
--cases 2000` is the full run (docs/robustness.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

#: Generated cases in the quick sample, 12 in each of the 14 families (the full run has 2000
#: and more).
QUICK_CASES = 168


def _recipe(name: str, family: str, **fields) -> dict:
    return {"name": name, "family": family, **fields}


def _tf(name: str, op: str, seed: str = "conv_matmul.pb", n: int = 0, options=(), fetch=True):
    return _recipe(name, "tf_proto", seed=seed, op=op, k=0, n=n, options=list(options),
                   fetch=fetch)


#: (recipe, exit code, a fragment of the one stderr line) for each reproduced issue-13 and
#: issue-35 report. On the code before the fixes each of these crashed, hung, blew the memory
#: cap, ended in an "unexpected" error, exited outside 0/1/2, or exited 0 having destroyed an
#: output or an input.
REGRESSIONS = [
    # 5: a function library that recurses killed the process (SIGSEGV in TF's importer)
    (_tf("recursion_direct", "recursion_direct"), 2, "calls itself"),
    (_tf("recursion_mutual", "recursion_mutual"), 2, "calls itself"),
    (_tf("recursion_call_attr", "recursion_call_attr"), 2, "calls itself"),
    (_tf("recursion_while_body", "recursion_while_body", seed="meta.meta", fetch=False), 2,
     "calls itself"),
    (_tf("recursion_nested_attr", "recursion_nested_attr"), 2, "calls itself"),
    (_recipe("saved_model_recursion", "saved_model", seed="sm_nested", op="recursion", k=0,
             ops=[["truncate", 0]], options=[]), 2, "calls itself"),
    # 6: a few hundred bytes must not allocate gigabytes
    (_tf("const_40000x30000_one_value", "const_huge_matmul", options=[["--target", "bf16"]],
         fetch=False), 0, ""),
    (_tf("const_40000x30000_overflowing", "const_huge_matmul", n=2, fetch=False), 0, ""),
    (_tf("addn_n_1e9", "addn_huge"), 2, "expects 1000000000"),
    (_tf("split_num_split_1e9", "split_huge"), 2, "outputs through its attributes"),
    (_tf("custom_op_port_1e9", "unknown_op_port_huge"), 2, "output(s)"),
    (_recipe("dev_zero_as_model", "paths", op="input_dev_zero", k=1, kind="onnx"), 2,
     "character device"),
    (_recipe("onnx_initializer_splat_huge", "onnx_proto", seed="cnn", op="splat_huge", k=0, n=0,
             options=[]), 2, "holds 1 value entries"),
    (_tf("placeholder_huge_with_validate", "placeholder_huge_shape",
         options=[["--validate"]]), 2, "give --inputs"),
    (_recipe("onnx_input_huge_with_validate", "onnx_proto", seed="cnn", op="input_shape_huge",
             k=0, n=0, options=[["--validate"]]), 2, "give --inputs"),
    # 7: nothing may hang: FIFOs, backtracking regexes, SavedModel links to /dev/zero
    (_recipe("fifo_as_model", "paths", op="input_fifo", k=0, kind="onnx"), 2, "FIFO"),
    (_recipe("fifo_as_config", "cli_misuse", op="config_hostile", k=3, tf=False), 2, "FIFO"),
    (_recipe("fifo_as_inputs", "cli_misuse", op="inputs_hostile", k=4, tf=False), 2, "FIFO"),
    (_recipe("fifo_as_report_to_explain", "explain_check", op="explain_fifo", k=0), 2, "FIFO"),
    (_recipe("fifo_to_check", "explain_check", op="check_fifo", k=0), 2, "FIFO"),
    (_recipe("fifo_as_reference", "explain_check", op="check_reference_fifo", k=0), 2, "FIFO"),
    (_recipe("keep_node_backtracking", "cli_misuse", op="keep_node_hostile", k=0, tf=False), 0,
     ""),
    (_recipe("keep_node_backreference", "cli_misuse", op="keep_node_hostile", k=5, tf=False), 2,
     "not a valid regex"),
    (_recipe("saved_model_variables_to_dev_zero", "saved_model", seed="sm_tf1",
             op="variables_symlink_dev_zero", k=0, ops=[["truncate", 0]], options=[]), 2,
     "leaves the SavedModel directory (/dev/zero)"),
    (_recipe("saved_model_variables_fifo", "saved_model", seed="sm_tf1", op="variables_fifo",
             k=0, ops=[["truncate", 0]], options=[]), 2, "FIFO"),
    (_recipe("saved_model_variables_outside", "saved_model", seed="sm_tf1",
             op="variables_symlink_outside", k=0, ops=[["truncate", 0]], options=[]), 2,
     "leaves the SavedModel"),
    (_recipe("saved_model_asset_fifo", "saved_model", seed="sm_nested", op="asset_fifo", k=0,
             ops=[["truncate", 0]], options=[]), 2, "FIFO"),
    # found by the 2000-case run once low-precision weights read the checkpoint by default
    (_recipe("saved_model_variables_data_truncated", "saved_model", seed="sm_nested",
             op="data_truncated", k=65535, ops=[["truncate", 240]], options=[]), 2,
     "variables checkpoint cannot be read"),
    (_recipe("saved_model_symlink_loop", "saved_model", seed="sm_nested",
             op="dir_symlink_loop", k=0, ops=[["truncate", 0]], options=[]), 2, "symlink"),
    (_recipe("saved_model_pb_fifo", "saved_model", seed="sm_nested", op="pb_is_fifo", k=0,
             ops=[["truncate", 0]], options=[]), 2, "FIFO"),
    # 8: "unexpected <Exception>" the fuzzer found, now a message about the model
    (_recipe("loop_body_without_inputs", "onnx_proto", seed="control_flow", op="graph_attr",
             k=4, n=0, options=[]), 2, "body has 0 input(s)"),
    (_tf("type_attr_invalid_with_validate", "attr_T_unknown", seed="while_loop_v1.pb", n=1,
         options=[["--validate"]]), 2, "holds no valid dtype"),
    (_recipe("saved_model_bad_fingerprint_validate", "saved_model", seed="sm_tf1",
             op="fingerprint_bytes", k=0, ops=[["truncate", 3]],
             options=[["--validate"], ["--quiet"]]), 0, ""),
    (_recipe("explain_report_of_the_wrong_shape", "explain_check", op="explain_schema_report",
             k=1), 2, "not an amp-rewriter report (node 0"),
    (_recipe("input_symlink_loop", "paths", op="input_symlink_loop", k=0, kind="onnx"), 2,
     "cannot read"),
    # found by the fuzzer on the output side (minimal here; issue 13 part A reworks outputs)
    (_recipe("report_over_external_data", "paths", op="report_is_data_file", k=0, kind="ext"),
     2, "refusing to overwrite"),
    (_recipe("output_over_external_data", "paths", op="output_is_data_file", k=0, kind="ext"),
     2, "refusing to overwrite"),
    (_recipe("report_inside_saved_model", "paths", op="report_in_saved_model", k=0,
             kind="saved_model"), 2, "refusing to write into it"),
    (_recipe("output_is_a_fifo", "paths", op="output_is_fifo", k=0, kind="onnx"), 2, "FIFO"),
    (_recipe("report_in_missing_folder", "paths", op="report_missing_folder", k=0,
             kind="saved_model"), 2, "does not exist"),
    (_recipe("validation_failure_leaves_nothing", "valid", seed="cnn",
             options=[["--validate", "--rtol", "0"]]), 1, "validation failed"),
    # issue 35: a report or --json over what the run reads or writes (exit 0 and a destroyed
    # output or input before), hostile calibration inputs (a hang, gigabytes, "unexpected"),
    # a metric's sys.exit (exit 7), a trailing slash (wrote out.onnx)
    (_recipe("report_over_its_own_data", "collisions", op="report_is_data", k=0,
             layout="single"), 2, "is also written as the output out.onnx's external data"),
    (_recipe("report_over_its_own_tensor_file", "collisions", op="report_is_data", k=1,
             layout="per-tensor"), 2, "(out.onnx.1.data)"),
    (_recipe("auto_report_over_its_own_data", "collisions", op="auto_report_is_data", k=0,
             layout=""), 2, "is also written as the output"),
    (_recipe("report_linked_to_its_own_data", "collisions", op="report_link_to_data", k=0,
             layout="single"), 2, "is also written as the output"),
    (_recipe("diagnose_json_over_input_data", "collisions", op="json_is_data", k=0,
             layout=""), 2, "is the input model's external data"),
    (_recipe("diagnose_json_over_config", "collisions", op="json_is_config", k=0, layout=""),
     2, "is the --config file"),
    (_recipe("many_tensors_report_collision", "many_tensors",
             op="per_tensor_report_collision", k=7), 2, "(out.onnx.7.data)"),
    (_recipe("calibration_fifo", "calibration", op="fifo_npz", k=0, command="diagnose"), 2,
     "FIFO"),
    (_recipe("calibration_json_to_dev_zero", "calibration", op="dev_zero_json", k=0,
             command="diagnose"), 2, "character device"),
    (_recipe("calibration_zip_bomb", "calibration", op="bomb_npz", k=0, command="auto"), 2,
     "declares"),
    (_recipe("calibration_deep_json", "calibration", op="deep_json", k=5000,
             command="diagnose_json"), 2, "RecursionError"),
    (_recipe("calibration_empty_zip_json", "calibration", op="empty_zip_json", k=0,
             command="diagnose"), 2, "an .npz with 0 arrays"),
    (_recipe("calibration_object_json", "calibration", op="object_json", k=1,
             command="auto"), 2, "Python objects"),
    (_recipe("metric_sys_exit", "metric", op="exits", k=0, report=True), 2,
     "it called sys.exit(7)"),
    (_recipe("metric_huge_int", "metric", op="huge_int", k=0, report=False), 2,
     "a metric must give a finite number"),
    (_recipe("output_trailing_slash", "paths", op="output_trailing_slash", k=0, kind="onnx"), 2,
     "names a folder"),
]


@pytest.fixture(scope="module")
def fuzz_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of scripts/fuzz.py: the regressions, then QUICK_CASES generated cases."""
    work = tmp_path_factory.mktemp("fuzz")
    replay = work / "regressions.json"
    replay.write_text(json.dumps([recipe for recipe, _, _ in REGRESSIONS]))
    result_path = work / "outcomes.json"
    process = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "fuzz.py"), "--cases", str(QUICK_CASES),
         "--seed", "1", "--replay", str(replay), "--work", str(work / "run"), "--json",
         str(result_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result_path.exists(), f"fuzz.py wrote no result:\n{process.stdout}\n{process.stderr}"
    result = json.loads(result_path.read_text())
    result["log"] = process.stdout[-6000:] + process.stderr[-3000:]
    return result


def _describe(outcome: dict) -> str:
    return (f"{outcome['recipe'].get('name') or outcome['family']}: {' '.join(outcome['argv'])} "
            f"-> exit {outcome['exit_code']} signal {outcome['signal']} "
            f"timed out {outcome['timed_out']}; {outcome['problems']}; stderr "
            f"{outcome['stderr'].strip()[:300]!r}")


def test_quick_sample_has_no_crash_hang_traceback_or_damage(fuzz_run: dict) -> None:
    outcomes = [o for o in fuzz_run["outcomes"] if "name" not in o["recipe"]]
    assert len(outcomes) == QUICK_CASES
    assert not fuzz_run["broken_recipes"]
    families = {o["family"] for o in outcomes}
    assert families >= {"onnx_bytes", "onnx_proto", "onnx_external", "tf_bytes", "tf_proto",
                        "saved_model", "cli_misuse", "paths", "explain_check", "valid",
                        "collisions", "calibration", "metric", "many_tensors"}
    failed = [_describe(o) for o in outcomes if o["problems"]]
    assert not failed, "\n".join(failed) + "\n" + fuzz_run["log"]
    # the sample exercises both outcomes: refusals and successful conversions
    codes = {o["exit_code"] for o in outcomes}
    assert {0, 2} <= codes


@pytest.mark.parametrize("index", range(len(REGRESSIONS)),
                         ids=[recipe["name"] for recipe, _, _ in REGRESSIONS])
def test_named_regression(fuzz_run: dict, index: int) -> None:
    recipe, exit_code, fragment = REGRESSIONS[index]
    outcome = next(o for o in fuzz_run["outcomes"] if o["recipe"].get("name") == recipe["name"])
    assert not outcome["problems"], _describe(outcome)
    assert outcome["exit_code"] == exit_code, _describe(outcome)
    assert fragment in outcome["stderr"], _describe(outcome)


def test_compact_constant_output_stays_small(fuzz_run: dict) -> None:
    """The 40000x30000 fill converts (bf16) into a Const of a few bytes, not 2.4 GB."""
    outcome = next(o for o in fuzz_run["outcomes"]
                   if o["recipe"].get("name") == "const_40000x30000_one_value")
    assert outcome["exit_code"] == 0, _describe(outcome)
    assert outcome["max_rss"] < fuzz_run["baseline_rss"] + (512 << 20), _describe(outcome)


def test_regression_recipes_build(tmp_path: Path) -> None:
    """Every regression recipe names a family and op the generator knows (a typo here would make
    a regression silently test something else)."""
    from testkit import fuzz_cases

    known_ops = {"tf_proto": fuzz_cases.TF_PROTO_OPS, "onnx_proto": fuzz_cases.ONNX_PROTO_OPS,
                 "saved_model": fuzz_cases.SAVED_MODEL_OPS, "paths": fuzz_cases.PATH_CASES,
                 "cli_misuse": fuzz_cases.CLI_MISUSES,
                 "explain_check": fuzz_cases.EXPLAIN_CHECK_CASES,
                 "collisions": fuzz_cases.COLLISION_CASES,
                 "calibration": fuzz_cases.CALIBRATION_CASES,
                 "metric": fuzz_cases.METRIC_CASES,
                 "many_tensors": fuzz_cases.MANY_TENSOR_CASES}
    for recipe, _, _ in REGRESSIONS:
        assert recipe["family"] in fuzz_cases.FAMILIES
        if recipe["family"] in known_ops:
            assert recipe["op"] in known_ops[recipe["family"]], recipe
