"""Where `convert --auto` and `diagnose` run ONNX models, and how low precision is made real there.

onnxruntime's CPU provider has fp16 kernels for few ops and bf16 kernels for almost none; for the
rest it computes in fp32 and drops the casts around the op, so an fp16 model run there mostly
shows fp32 numbers (a MatMul whose output exceeds 65504 does not overflow). Measuring on it as
is would miss the hazards `--auto` exists to find. So, unless the backend profile's providers are
available (and its `emulation` is not "always"), a converted model runs *emulated*: every op
computes in fp32 and every
tensor the model holds in fp16/bf16 is rounded to that dtype where it is produced (an explicit
cast pair, which onnxruntime keeps), as a kernel that computes in fp32 and stores its output in
low precision does. Ops whose low-precision kernels accumulate in low precision (ORT CUDA's
CumSum) are not modelled.

`Execution` is the pluggable part: `prepare` turns a converted model into what runs, `providers`
says where, `description` says which for the report. `select_execution` reads the backend
profile (`op_lists.BackendProfile`: its providers, their options and its emulation policy), or
the user's `--device`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import onnx

from ...errors import AmpError, first_line
from ...op_lists import BackendProfile
from . import ort_registry
from .emulation import WHOLE_MODEL, emulate_low_precision

_LOW = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16"}


@dataclass(frozen=True)
class Execution:
    """How models run: onnxruntime providers, and whether low-precision models are emulated."""

    providers: tuple[str, ...]
    emulate: bool
    description: str
    provider_options: tuple[dict, ...] = field(default=())
    #: Who chose it, for messages: "--device cuda", "backend ort-cuda".
    chosen_by: str = ""

    def prepare(self, model: onnx.ModelProto, base_dir: str | os.PathLike | None = None,
                in_place: bool = False) -> onnx.ModelProto:
        """The model to hand to onnxruntime for a converted model (`base_dir`: where its
        external data lives; `in_place`: `model` may be changed, saving a copy)."""
        if not self.emulate:
            return model
        return emulate_low_precision(model, base_dir, WHOLE_MODEL, copy=not in_place).model

    def session(self, model: onnx.ModelProto | str, label: str, lean: bool = False):
        """An onnxruntime session for a model (proto or path); failures are one-line errors.
        `lean`: hold the weights once (for big models) rather than run as onnxruntime runs by
        default; the two differ in fp32 summation order (pre-packed GEMM), which fp16 rounding
        can amplify, so small models run the default way users run them."""
        ort = ort_registry.required()
        options = ort_registry.session_options()
        disabled: list[str] = []
        if lean:
            # The arena keeps the largest batch's buffers for the session's life; measurement
            # runs go batch by batch, so give memory back between them.
            options.enable_cpu_mem_arena = False
            # Pre-packing copies every MatMul weight into a second buffer.
            options.add_session_config_entry("session.disable_prepacking", "1")
            # Constant folding would turn each emulated model's Cast(fp16 weight) into an fp32
            # copy of the weight: the weights would be held twice.
            disabled.append("ConstantFolding")
        try:
            source = model if isinstance(model, str) else model.SerializeToString()
            return ort.InferenceSession(source, options, providers=list(self.providers),
                                        provider_options=list(self.provider_options) or None,
                                        disabled_optimizers=disabled or None)
        except Exception as exc:
            message = first_line(exc)
            raise AmpError(f"onnxruntime cannot load the {label}: {message}") from None


#: Where `--device` runs the converted model.
DEVICE_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
CPU_PROVIDER = DEVICE_PROVIDERS["cpu"]


class ProviderMissing(AmpError):
    """The providers an execution asks for are not in this onnxruntime (the runtime's fault,
    not the model's)."""


def provider_label(provider: str) -> str:
    """"CUDA" for CUDAExecutionProvider: how messages name a provider."""
    return provider.removesuffix("ExecutionProvider")


def select_execution(profile: BackendProfile, target: str, device: str | None = None
                     ) -> Execution:
    """Where converted models run for `profile` (`device`: the user's --device, which wins).

    The profile's providers when onnxruntime has its first one and the profile does not
    always emulate; else the CPU provider, emulated, unless the profile never emulates (then
    its missing provider is an error)."""
    if device is not None:
        if device not in DEVICE_PROVIDERS:
            raise AmpError(f"--device {device!r}: expected one of {', '.join(DEVICE_PROVIDERS)}")
        if device != "cpu":
            return Execution((DEVICE_PROVIDERS[device],), False,
                             f"onnxruntime {provider_label(DEVICE_PROVIDERS[device])} provider",
                             chosen_by=f"--device {device}")
        return _emulated(target, f"--device {device}", "--device cpu")
    ort = ort_registry.onnxruntime()
    available = ort.get_available_providers() if ort is not None else []
    chosen_by = f"backend {profile.name}"
    first = profile.providers[0] if profile.providers else CPU_PROVIDER
    if profile.emulation != "always" and first in available:
        providers = tuple(p for p in profile.providers if p in available) or (first,)
        options = tuple(dict(profile.provider_options.get(p, {})) for p in providers)
        tf32 = " with TF32 off" if any(o.get("use_tf32") == "0" for o in options) else ""
        return Execution(providers, False,
                         f"onnxruntime {provider_label(first)} provider: {target} kernels run "
                         f"natively, the fp32 reference{tf32}",
                         options if any(options) else (), chosen_by)
    if profile.emulation == "never":
        raise ProviderMissing(f"{chosen_by}: this onnxruntime has no {first} (the profile runs "
                              f"there and never emulates; {profile.source})")
    why = (f"no {provider_label(first)} provider" if profile.emulation == "fallback"
           else f"{profile.name} computes most {target} ops in fp32 between casts")
    return _emulated(target, chosen_by, why)


def _emulated(target: str, chosen_by: str, why: str) -> Execution:
    return Execution((CPU_PROVIDER,), True,
                     f"onnxruntime CPU provider, {target} emulated: every op computes in fp32 "
                     f"and each {target} tensor is rounded to {target} where it is produced "
                     f"({why})", chosen_by=chosen_by)


def low_precision_inputs(model: onnx.ModelProto) -> dict[str, str]:
    """The model's graph inputs that take fp16/bf16, with their dtype."""
    return {info.name: _LOW[info.type.tensor_type.elem_type] for info in model.graph.input
            if info.type.tensor_type.elem_type in _LOW}


def round_feeds(model: onnx.ModelProto | dict[str, str], feeds: dict[str, np.ndarray]
                ) -> dict[str, np.ndarray]:
    """Feeds for `model`'s emulated copy: fp32 values rounded where the model takes fp16/bf16
    (`model` may be `low_precision_inputs(model)`)."""
    from ...ir.dtypes import NUMPY_DTYPES

    low = model if isinstance(model, dict) else low_precision_inputs(model)
    return {name: (value.astype(NUMPY_DTYPES[low[name]]).astype(np.float32)
                   if name in low and value.dtype == np.float32 else value)
            for name, value in feeds.items()}


def native_feeds(session, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feeds cast to the dtypes a session's inputs take (fp32 data for an fp16 input)."""
    from ...ir.dtypes import NUMPY_DTYPES

    wanted = {"tensor(float16)": NUMPY_DTYPES["float16"],
              "tensor(bfloat16)": NUMPY_DTYPES["bfloat16"]}
    result = {}
    for info in session.get_inputs():
        value = feeds[info.name]
        target = wanted.get(info.type)
        result[info.name] = value.astype(target) if target is not None \
            and value.dtype != target else value
    return result
