"""The TensorFlow op lists for a target and backend: tf.toml, Grappler's environment variables,
the user's overrides, and (profiles whose kernel source is the registry) which kernels TF's
registry has for the target dtype on the profile's device."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from tensorflow.python.framework import kernels

from ... import op_lists
from ...ir import DENY, FP32, INFER, TARGET_DTYPES
from ...op_lists import OpLists, Overrides
from .load import dtype_enum

ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
#: Grappler's list names in its environment variables (and their pre-2.4 names).
ENV_LISTS = {"ALLOWLIST": "allow", "INFERLIST": "infer", "DENYLIST": "deny", "CLEARLIST": "clear",
             "WHITELIST": "allow", "GRAYLIST": "infer", "BLACKLIST": "deny"}


#: TensorFlow's device type of each profile device.
TF_DEVICE_TYPES = {"cpu": "CPU", "cuda": "GPU"}


def default_backend(target: str) -> str:
    """The profile tf.toml names for `target` (Grappler's pairing: fp16 for CUDA GPUs, bf16 for
    CPUs with oneDNN)."""
    return op_lists.default_backend("tf", target)


def kernel_checker(device: str, dtype: str) -> Callable[[str, str | None], bool]:
    """(op, type group) -> whether TF registers a `device` kernel with that group in `dtype`.

    Like Grappler's NodeHasF16KernelForTypeAttr: a kernel qualifies when its constraint on the
    group's attr allows `dtype` (or it has no constraint on it). With no group, any kernel of the
    op that allows `dtype` somewhere (or has no type constraint) qualifies.
    """
    enum = dtype_enum(dtype)
    cache: dict[tuple[str, str | None], bool] = {}

    def check(op: str, group: str | None) -> bool:
        attr = group.partition("[")[0] if group else None
        key = (op, attr)
        if key not in cache:
            ok = False
            for kernel in kernels.get_registered_kernels_for_op(op).kernel:
                if kernel.device_type not in (device, "DEFAULT"):
                    continue
                allowed = {c.name: set(c.allowed_values.list.type) for c in kernel.constraint}
                if attr is None:
                    ok = not allowed or any(enum in types for types in allowed.values())
                else:
                    ok = attr not in allowed or enum in allowed[attr]
                if ok:
                    break
            cache[key] = ok
        return cache[key]

    return check


def apply_grappler_env(lists: OpLists, environ: Mapping[str, str] | None = None) -> list[str]:
    """Apply Grappler's list variables (per list: _ADD, then _REMOVE); returns what changed."""
    variables: Mapping[str, str] = os.environ if environ is None else environ
    notes = []
    for key, op_class in ENV_LISTS.items():
        for suffix in ("ADD", "REMOVE"):
            var = f"{ENV_PREFIX}{key}_{suffix}"
            for op in (o.strip() for o in variables.get(var, "").split(",")):
                if not op:
                    continue
                if suffix == "ADD":
                    lists.set_class(op, op_class, f"{op_class}: added by {var}")
                elif lists.classes.get(op) == op_class:
                    lists.set_class(op, FP32, f"removed from the {op_class} list by {var}: "
                                              f"unlisted ops stay fp32")
                else:
                    continue
                notes.append(f"{var}: {op}")
    if variables.get(f"{ENV_PREFIX}LEVEL", "").upper() == "TREAT_INFER_AS_DENY":
        for op, op_class in list(lists.classes.items()):
            if op_class == INFER:
                lists.set_class(op, DENY, f"deny: infer ops are deny with "
                                          f"{ENV_PREFIX}LEVEL=TREAT_INFER_AS_DENY")
        notes.append(f"{ENV_PREFIX}LEVEL=TREAT_INFER_AS_DENY")
    return notes


def load_tf_lists(target: str, backend: str, overrides: Overrides | None = None) -> OpLists:
    """The op lists for TF: generic + backend profile, Grappler's env variables, then the user's."""
    # The user's profiles now, their class moves last: Grappler's variables come before them.
    profiles_only = Overrides(backends=overrides.backends) if overrides is not None else None
    lists = OpLists.load("tf", target, backend, profiles_only)
    apply_grappler_env(lists)
    if overrides is not None:
        lists.apply_overrides(overrides)
    if lists.profile.kernel_source == "registry":
        lists.kernel_check = kernel_checker(TF_DEVICE_TYPES[lists.profile.device],
                                            TARGET_DTYPES[target])
    return lists
