"""The corpus scripts/same_output.py replays under two code versions: each part's builder writes
its cases (testkit.same_output_cases) into a folder, without importing amp_rewriter, so that the
corpus is the same whichever version replays it.

Parts: the hand-built ONNX models with every option variant (onnx), torch exports of real
architectures (real), the 10k-node synthetic graph (synthetic), onnx's backend test corpus (node),
TF GraphDefs (tf), SavedModels (saved_model) and TF1 training graphs (training).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testkit import same_output_cases as cases_lib

REPO_ROOT = Path(__file__).resolve().parent.parent


ONNX_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("fp16-ort-cuda", {"target": "fp16", "backend": "ort-cuda"}),
    ("bf16-ort-cuda", {"target": "bf16", "backend": "ort-cuda"}),
    ("fp16-ort-cpu", {"target": "fp16", "backend": "ort-cpu"}),
    ("bf16-ort-cpu", {"target": "bf16", "backend": "ort-cpu"}),
    ("fp16-no-keep-io-types", {"target": "fp16", "backend": "ort-cuda", "keep_io_types": False}),
    ("bf16-no-keep-io-types", {"target": "bf16", "backend": "ort-cpu", "keep_io_types": False}),
    ("fp16-clamp", {"target": "fp16", "backend": "ort-cuda", "clamp": True}),
    ("fp16-overrides", {"target": "fp16", "backend": "ort-cuda", "deny": ["Relu", "Softmax"],
                        "allow": ["Add", "Erf"], "infer": ["Tanh"], "clear": ["Transpose"]}),
    ("bf16-overrides", {"target": "bf16", "backend": "ort-cpu", "deny": ["MatMul"],
                        "allow": ["Softmax", "LayerNormalization", "Resize"]}),
    ("fp16-check-off", {"target": "fp16", "backend": "ort-cuda", "check": False}),
    ("defaults", {}),
]
ONNX_ERROR_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("error-allow-and-deny", {"target": "fp16", "allow": ["Relu"], "deny": ["Relu"]}),
    ("error-unknown-target", {"target": "fp8"}),
    ("error-unknown-backend", {"target": "fp16", "backend": "tpu"}),
    ("error-bad-regex", {"target": "fp16", "keep_nodes": ["(unclosed"]}),
]
TF_TARGETS: list[tuple[str, dict[str, Any]]] = [
    ("bf16-tf-cpu", {"target": "bf16", "backend": "tf-cpu"}),
    ("fp16-tf-gpu", {"target": "fp16", "backend": "tf-gpu"}),
    ("fp16-tf-cpu", {"target": "fp16", "backend": "tf-cpu"}),
    ("bf16-tf-gpu", {"target": "bf16", "backend": "tf-gpu"}),
]


def _toml_list(values: list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def _write_config(path: Path, **lists: list[str]) -> Path:
    path.write_text("".join(f"{key} = {_toml_list(values)}\n" for key, values in lists.items()))
    return path


def build_onnx(out: Path, tmp: Path) -> None:
    """The hand-built models (testkit.models.BUILDERS) and examples/tiny_cnn.onnx, with every
    option variant; convert_file with and without external data; a few error cases."""
    import re

    import onnx

    from testkit.models import BUILDERS

    sources: dict[str, Path] = {}
    for name, builder in BUILDERS.items():
        sources[name] = tmp / f"{name}.onnx"
        sources[name].write_bytes(builder().SerializeToString(deterministic=True))
    sources["tiny_cnn"] = REPO_ROOT / "examples" / "tiny_cnn.onnx"
    record = cases_lib.record_case
    for name, path in sources.items():
        model = onnx.load(str(path))
        node_names = [n.name for n in model.graph.node if n.name]
        for variant, options in ONNX_VARIANTS:
            record(out, "onnx", path, options, name=f"{name}/{variant}")
        keep = [re.escape(node_names[len(node_names) // 2]), r"(?i).*(conv|matmul|gemm|attn).*1.*"]
        record(out, "onnx", path, {"target": "fp16", "backend": "ort-cuda", "keep_nodes": keep},
               name=f"{name}/fp16-keep-nodes")
        record(out, "onnx", path, {"target": "bf16", "backend": "ort-cpu",
                                   "keep_nodes": [node_names[0], "no-such-node"]},
               name=f"{name}/bf16-keep-nodes")
        config = _write_config(tmp / f"{name}-lists.toml", deny=["Softmax", "Pow"],
                               allow=["Erf", "ReduceMean"], keep_nodes=[keep[1]])
        record(out, "onnx", path, {"target": "fp16", "backend": "ort-cuda", "config": config},
               name=f"{name}/fp16-config")
        record(out, "onnx", path, {"target": "bf16", "backend": "ort-cuda", "config": config,
                                   "deny": ["Relu"], "allow": ["Softmax"]},
               name=f"{name}/bf16-config-and-options")
        record(out, "onnx", path, {"target": "fp16", "backend": "ort-cuda"}, input="proto",
               name=f"{name}/fp16-model-proto")
        record(out, "onnx_file", path, {"target": "fp16", "backend": "ort-cuda"},
               name=f"{name}/fp16-convert-file")
        # The same model with its weights in external data (every tensor of 64+ bytes).
        external_dir = tmp / f"{name}-external"
        external_dir.mkdir()
        onnx.save_model(onnx.load(str(path)), str(external_dir / "model.onnx"),
                        save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=64, convert_attribute=False)
        record(out, "onnx_file", external_dir / "model.onnx", {"target": "fp16",
                                                                "backend": "ort-cuda"},
               name=f"{name}/fp16-convert-file-external-data")
        record(out, "onnx_file", external_dir / "model.onnx", {"target": "bf16",
                                                                "backend": "ort-cpu"},
               name=f"{name}/bf16-convert-file-external-data")
    bad_config = tmp / "bad.toml"
    bad_config.write_text("deny = [\"Relu\"]\nunknown_key = 1\n")
    for variant, options in ONNX_ERROR_VARIANTS + [("error-bad-config", {"config": bad_config})]:
        record(out, "onnx", sources["cnn"], options, name=f"cnn/{variant}")
    garbage = tmp / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07\x12\xff\xff not a model")
    record(out, "onnx", garbage, {"target": "fp16"}, name="errors/not-a-model")


def build_real(out: Path, tmp: Path) -> None:
    """Real architectures exported by torch (testkit/models/torch_export.py) at opsets 17 and 18:
    fp16 and bf16 conversions, and convert_file of a copy with external data (the exports
    themselves are single files)."""
    import onnx

    from testkit.models import torch_export

    record = cases_lib.record_case
    for name, exporter in torch_export.EXPORTERS.items():
        for opset in torch_export.SUPPORTED_OPSETS:
            stem = f"{name}_opset{opset}"
            started = time.perf_counter()
            path = exporter(tmp / f"{stem}.onnx", opset)
            print(f"  exported {stem} in {time.perf_counter() - started:.1f} s", flush=True)
            record(out, "onnx", path, {"target": "fp16", "backend": "ort-cuda"},
                   name=f"{stem}/fp16-ort-cuda", link=True)
            record(out, "onnx", path, {"target": "bf16", "backend": "ort-cpu"},
                   name=f"{stem}/bf16-ort-cpu", link=True)
            external_dir = tmp / f"{stem}-external"
            external_dir.mkdir()
            onnx.save_model(onnx.load(str(path)), str(external_dir / "model.onnx"),
                            save_as_external_data=True, all_tensors_to_one_file=True,
                            location="model.onnx.data", size_threshold=1024,
                            convert_attribute=False)
            record(out, "onnx_file", external_dir / "model.onnx",
                   {"target": "fp16", "backend": "ort-cuda"},
                   name=f"{stem}/fp16-convert-file-external-data", link=True)


def build_synthetic(out: Path, tmp: Path) -> None:
    """The 10k-node synthetic transformer graph (testkit.synthetic)."""
    from testkit.synthetic import build_synthetic_model

    path = tmp / "synthetic_10k.onnx"
    path.write_bytes(build_synthetic_model(10000).SerializeToString(deterministic=True))
    cases_lib.record_case(out, "onnx", path, {"target": "fp16", "backend": "ort-cuda"},
                          name="synthetic_10k/fp16-ort-cuda", link=True)
    cases_lib.record_case(out, "onnx", path, {"target": "bf16", "backend": "ort-cpu"},
                          name="synthetic_10k/bf16-ort-cpu", link=True)


def build_node(out: Path, tmp: Path) -> None:
    """Every model of onnx's backend test corpus (as testkit.onnx_corpus finds them), fp16 and
    bf16 on ort-cuda."""
    from testkit.onnx_corpus import list_cases

    listed = list_cases()
    for suite, name, path in listed:
        first = cases_lib.record_case(out, "onnx", path, {"target": "fp16", "backend": "ort-cuda"},
                                      name=f"{suite}/{name}/fp16")
        cases_lib.record_case(out, "onnx", first / "model.onnx",
                              {"target": "bf16", "backend": "ort-cuda"},
                              name=f"{suite}/{name}/bf16", link=True)
    print(f"  {len(listed)} backend-test models", flush=True)


def build_tf(out: Path, tmp: Path) -> None:
    """TF1 GraphDefs (testkit/models/tf_graphs.py) for every target/backend pair, option variants,
    Grappler's list variables, a .meta file and a .pb -> .pbtxt file conversion."""
    from testkit.models import tf_graphs

    record = cases_lib.record_case
    graphs = {name: builder() for name, builder in tf_graphs.BUILDERS.items()}
    for name, (graph_def, outputs) in graphs.items():
        for variant, options in TF_TARGETS:
            record(out, "tf_graphdef", graph_def, options, outputs=outputs,
                   name=f"{name}/{variant}")
    def gd(name):
        return graphs[name][0]

    def outs(name):
        return graphs[name][1]

    bf16 = {"target": "bf16", "backend": "tf-cpu"}
    fp16 = {"target": "fp16", "backend": "tf-gpu"}
    extra: list[tuple[str, str, dict[str, Any], Any, dict[str, str] | None]] = [
        ("existing_casts", "bf16-no-keep-io-types", {**bf16, "keep_io_types": False}, "default",
         None),
        ("conv_matmul", "bf16-no-keep-io-types", {**bf16, "keep_io_types": False}, "default",
         None),
        ("fp16_mask", "fp16-clamp", {**fp16, "clamp": True}, "default", None),
        ("divisions", "fp16-clamp", {**fp16, "clamp": True}, "default", None),
        ("two_matmuls_relu", "bf16-overrides", {**bf16, "deny": ["Relu"], "allow": ["Tanh"]},
         "default", None),
        ("exp_pow_deny", "fp16-overrides", {**fp16, "allow": ["Exp"], "infer": ["Relu"],
                                            "clear": ["Sigmoid"]}, "default", None),
        ("conv_matmul", "bf16-keep-nodes", {**bf16, "keep_nodes": ["conv|rel.*", "nope"]},
         "default", None),
        ("sqrt_log_infer", "bf16-default-outputs", bf16, None, None),
        ("sqrt_log_infer", "bf16-default-backend", {"target": "bf16"}, "default", None),
        ("sqrt_log_infer", "fp16-default-backend", {"target": "fp16"}, "default", None),
        ("while_loop_v1", "bf16-check-off", {**bf16, "check": False}, "default", None),
        ("two_matmuls_relu", "bf16-grappler-env-deny-relu", bf16, "default",
         {"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_CLEARLIST_REMOVE": "Relu",
          "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD": "Relu"}),
        ("two_matmuls_relu", "bf16-grappler-env-no-matmul", bf16, "default",
         {"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_REMOVE": "MatMul"}),
        ("sqrt_log_infer", "bf16-grappler-env-infer-as-deny", bf16, "default",
         {"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL": "TREAT_INFER_AS_DENY"}),
        ("mlp_relu", "error-unknown-output", bf16, ["nope"], None),
        ("mlp_relu", "error-allow-and-deny", {**bf16, "allow": ["Relu"], "deny": ["Relu"]},
         "default", None),
        ("mlp_relu", "error-unknown-backend", {"target": "bf16", "backend": "tf-tpu"}, "default",
         None),
    ]
    for name, variant, options, outputs, env in extra:
        fetches = outs(name) if outputs == "default" else outputs
        record(out, "tf_graphdef", gd(name), options, outputs=fetches, env=env,
               name=f"{name}/{variant}")
    config = _write_config(tmp / "tf-lists.toml", deny=["Relu"], allow=["Sqrt"],
                           keep_nodes=["mm3"])
    for name in ("exp_pow_deny", "sqrt_log_infer"):
        record(out, "tf_graphdef", gd(name), {**bf16, "config": config}, outputs=outs(name),
               name=f"{name}/bf16-config")
        record(out, "tf_graphdef", gd(name), {**fp16, "config": config, "deny": ["Tanh"]},
               outputs=outs(name), name=f"{name}/fp16-config-and-options")
    meta = tf_graphs.meta_graph_with_saver()
    for variant, options in TF_TARGETS[:2]:
        name = f"meta_graph_with_saver/{variant}"
        record(out, "tf_meta", meta, options, outputs=["y"], name=name)
        record(out, "tf_meta", meta, options, name=f"{name}-default-outputs")
    pb = tmp / "conv_matmul.pb"
    pb.write_bytes(gd("conv_matmul").SerializeToString(deterministic=True))
    record(out, "tf_meta", pb, bf16, outputs=outs("conv_matmul"), output="model.pbtxt",
           name="conv_matmul/bf16-pb-to-pbtxt-file")
    record(out, "tf_meta", pb, fp16, outputs=outs("conv_matmul"),
           name="conv_matmul/fp16-pb-file")
    garbage = tmp / "garbage.pb"
    garbage.write_bytes(b"\x0a\xff\xff\xff garbage")
    record(out, "tf_meta", garbage, bf16, name="errors/not-a-graphdef")


def build_saved_model(out: Path, tmp: Path) -> None:
    """SavedModels (testkit/models/tf_saved_models.py): Keras model.export and
    tf.saved_model.save, a module with nested functions and an asset, a TF1 simple_save."""
    from testkit.models import tf_saved_models

    record = cases_lib.record_case
    exported = {name: exporter(tmp / name) for name, exporter in tf_saved_models.EXPORTERS.items()}
    bf16 = {"target": "bf16", "backend": "tf-cpu"}
    fp16 = {"target": "fp16", "backend": "tf-gpu"}
    for name, path in exported.items():
        record(out, "tf_saved_model", path, bf16, name=f"{name}/bf16-tf-cpu", link=True)
        record(out, "tf_saved_model", path, {**fp16, "check": False},
               name=f"{name}/fp16-tf-gpu-check-off", link=True)
    variants: list[tuple[str, str, dict[str, Any]]] = [
            ("keras_cnn", "fp16-tf-gpu", fp16),
            ("keras_cnn", "fp16-tf-cpu", {"target": "fp16", "backend": "tf-cpu"}),
            ("keras_cnn", "bf16-no-keep-io-types", {**bf16, "keep_io_types": False}),
            ("keras_cnn", "bf16-overrides", {**bf16, "deny": ["Relu"], "allow": ["Mean"]}),
            ("keras_encoder", "bf16-keep-nodes", {**bf16, "keep_nodes": [".*softmax.*"]}),
            ("keras_encoder", "fp16-tf-gpu", fp16),
            ("tf1_simple_save", "fp16-tf-gpu", fp16),
            ("nested_module", "bf16-clamp", {**bf16, "clamp": True})]
    for name, variant, options in variants:
        record(out, "tf_saved_model", exported[name], options, name=f"{name}/{variant}",
               link=True)


def build_training(out: Path, tmp: Path) -> None:
    """TF1 training graphs (testkit/models/tf_training.py) as .meta files through
    rewrite_training_graph: mlp/cnn x sgd/momentum/adam x ref/resource variables x one/two
    towers, fp16 and bf16, and loss-scale and override variants."""
    import tensorflow as tf

    from testkit.models.tf_training import build_training_graph

    record = cases_lib.record_case

    def meta_file(stem: str, **graph_args: Any) -> Path:
        graph = build_training_graph(**graph_args)
        with graph.as_default():
            meta = tf.compat.v1.train.export_meta_graph(graph=graph)
        path = tmp / f"{stem}.meta"
        path.write_bytes(meta.SerializeToString(deterministic=True))
        return path

    for model in ("mlp", "cnn"):
        for optimizer in ("sgd", "momentum", "adam"):
            for resource in (False, True):
                for towers in (1, 2):
                    stem = (f"{model}-{optimizer}-{'resource' if resource else 'ref'}"
                            f"-{towers}tower{'s' if towers > 1 else ''}")
                    path = meta_file(stem, model=model, optimizer=optimizer, resource=resource,
                                     towers=towers)
                    names = {"loss": "loss", "train_op": "train"} if towers > 1 else {}
                    for target in ("fp16", "bf16"):
                        record(out, "tf_training", path, {"target": target, **names},
                               name=f"{stem}/{target}", link=True)
    mlp = meta_file("mlp-adam", model="mlp", optimizer="adam")
    variants: list[tuple[str, Path, dict[str, Any]]] = [
        ("mlp-adam/fp16-loss-scale-fixed", mlp, {"target": "fp16", "loss_scale": 1024.0}),
        ("mlp-adam/fp16-loss-scale-none", mlp, {"target": "fp16", "loss_scale": "none"}),
        ("mlp-adam/bf16-loss-scale-dynamic", mlp, {"target": "bf16", "loss_scale": "dynamic"}),
        ("mlp-adam/fp16-scaler-rule", mlp, {"target": "fp16", "initial_scale": 256.0,
                                            "growth_interval": 10, "growth_factor": 4.0,
                                            "backoff_factor": 0.25, "min_scale": 2.0,
                                            "hysteresis": 3}),
        ("mlp-adam/fp16-tf-cpu", mlp, {"target": "fp16", "backend": "tf-cpu"}),
        ("mlp-adam/bf16-tf-gpu", mlp, {"target": "bf16", "backend": "tf-gpu"}),
        ("mlp-adam/fp16-names-given", mlp, {"target": "fp16", "loss": "loss:0",
                                            "train_op": "train"}),
        ("mlp-adam/fp16-overrides", mlp, {"target": "fp16", "deny": ["Relu"],
                                          "keep_nodes": ["model/MatMul_1"], "clamp": True}),
        ("mlp-adam/error-bad-loss-scale", mlp, {"target": "fp16", "loss_scale": "sometimes"}),
        ("mlp-adam/error-unknown-train-op", mlp, {"target": "fp16", "train_op": "nope"}),
    ]
    two_towers = meta_file("cnn-momentum-2towers", model="cnn", optimizer="momentum", towers=2)
    variants.append(("cnn-momentum-2towers/error-loss-not-given", two_towers, {"target": "fp16"}))
    no_step = meta_file("mlp-rmsprop-no-global-step", model="mlp", optimizer="rmsprop",
                        global_step=False)
    variants += [("mlp-rmsprop-no-global-step/fp16", no_step, {"target": "fp16"}),
                 ("mlp-rmsprop-no-global-step/bf16", no_step, {"target": "bf16"})]
    tiny_loss = meta_file("mlp-sgd-tiny-loss", model="mlp", optimizer="sgd",
                          loss_multiplier=1e-6)
    variants.append(("mlp-sgd-tiny-loss/fp16", tiny_loss, {"target": "fp16"}))
    for name, path, options in variants:
        record(out, "tf_training", path, options, name=name, link=True)


#: Part name -> builder, in build order. The part is the cases' top-level folder name.
CORPUS_PARTS: dict[str, Callable[[Path, Path], None]] = {
    "onnx": build_onnx,
    "synthetic": build_synthetic,
    "node": build_node,
    "real": build_real,
    "tf": build_tf,
    "saved_model": build_saved_model,
    "training": build_training,
}
