"""What each input of TensorFlow's variable-writing ops is: the optimizer argument tables, as data.

The training front end reads them to list a step's variable writes (which input is the variable,
which the gradient) and `check` to find the constants an optimizer update reads (learning rate,
epsilon, the other hyperparameters). An op not in these tables writes no variable for either.
`tests/tf/test_optimizer_tables.py` checks every entry against TensorFlow's OpDefs and that no
Apply/Scatter/Assign kernel TensorFlow registers is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...training.plan import ScaleFold

#: What a data input of a write is.
VARIABLE = "variable"            # the variable written (a reference or a resource handle)
SLOT = "slot"                    # optimizer state written with it (Adam's m and v, momentum)
GRADIENT = "gradient"            # the gradient the update applies
INDICES = "indices"              # the rows a sparse update or a scatter writes
LEARNING_RATE = "learning_rate"
EPSILON = "epsilon"              # added to a denominator: 0 in the update's dtype divides by 0
HYPERPARAMETER = "hyperparameter"  # momentum, betas and their powers, rho, l1/l2, ...
VALUE = "value"                  # what an assign or a scatter writes

#: Optimizer update kernels by family: each data input of the dense form (`ApplyX`), in OpDef
#: order, with its role. The sparse forms take `indices` right after the gradient, which they
#: call `grad` (ProximalGradientDescent's dense form calls it `delta`).
_FAMILIES: dict[str, tuple[tuple[str, str], ...]] = {
    "GradientDescent": (("var", VARIABLE), ("alpha", LEARNING_RATE), ("delta", GRADIENT)),
    "ProximalGradientDescent": (("var", VARIABLE), ("alpha", LEARNING_RATE),
                                ("l1", HYPERPARAMETER), ("l2", HYPERPARAMETER),
                                ("delta", GRADIENT)),
    "Momentum": (("var", VARIABLE), ("accum", SLOT), ("lr", LEARNING_RATE), ("grad", GRADIENT),
                 ("momentum", HYPERPARAMETER)),
    "KerasMomentum": (("var", VARIABLE), ("accum", SLOT), ("lr", LEARNING_RATE),
                      ("grad", GRADIENT), ("momentum", HYPERPARAMETER)),
    "Adagrad": (("var", VARIABLE), ("accum", SLOT), ("lr", LEARNING_RATE), ("grad", GRADIENT)),
    "AdagradV2": (("var", VARIABLE), ("accum", SLOT), ("lr", LEARNING_RATE),
                  ("epsilon", EPSILON), ("grad", GRADIENT)),
    "ProximalAdagrad": (("var", VARIABLE), ("accum", SLOT), ("lr", LEARNING_RATE),
                        ("l1", HYPERPARAMETER), ("l2", HYPERPARAMETER), ("grad", GRADIENT)),
    "AdagradDA": (("var", VARIABLE), ("gradient_accumulator", SLOT),
                  ("gradient_squared_accumulator", SLOT), ("grad", GRADIENT),
                  ("lr", LEARNING_RATE), ("l1", HYPERPARAMETER), ("l2", HYPERPARAMETER),
                  ("global_step", HYPERPARAMETER)),
    "Ftrl": (("var", VARIABLE), ("accum", SLOT), ("linear", SLOT), ("grad", GRADIENT),
             ("lr", LEARNING_RATE), ("l1", HYPERPARAMETER), ("l2", HYPERPARAMETER),
             ("lr_power", HYPERPARAMETER)),
    "FtrlV2": (("var", VARIABLE), ("accum", SLOT), ("linear", SLOT), ("grad", GRADIENT),
               ("lr", LEARNING_RATE), ("l1", HYPERPARAMETER), ("l2", HYPERPARAMETER),
               ("l2_shrinkage", HYPERPARAMETER), ("lr_power", HYPERPARAMETER)),
    "Adadelta": (("var", VARIABLE), ("accum", SLOT), ("accum_update", SLOT),
                 ("lr", LEARNING_RATE), ("rho", HYPERPARAMETER), ("epsilon", EPSILON),
                 ("grad", GRADIENT)),
    "Adam": (("var", VARIABLE), ("m", SLOT), ("v", SLOT), ("beta1_power", HYPERPARAMETER),
             ("beta2_power", HYPERPARAMETER), ("lr", LEARNING_RATE), ("beta1", HYPERPARAMETER),
             ("beta2", HYPERPARAMETER), ("epsilon", EPSILON), ("grad", GRADIENT)),
    "AdamWithAmsgrad": (("var", VARIABLE), ("m", SLOT), ("v", SLOT), ("vhat", SLOT),
                        ("beta1_power", HYPERPARAMETER), ("beta2_power", HYPERPARAMETER),
                        ("lr", LEARNING_RATE), ("beta1", HYPERPARAMETER),
                        ("beta2", HYPERPARAMETER), ("epsilon", EPSILON), ("grad", GRADIENT)),
    "AdaMax": (("var", VARIABLE), ("m", SLOT), ("v", SLOT), ("beta1_power", HYPERPARAMETER),
               ("lr", LEARNING_RATE), ("beta1", HYPERPARAMETER), ("beta2", HYPERPARAMETER),
               ("epsilon", EPSILON), ("grad", GRADIENT)),
    "AddSign": (("var", VARIABLE), ("m", SLOT), ("lr", LEARNING_RATE),
                ("alpha", HYPERPARAMETER), ("sign_decay", HYPERPARAMETER),
                ("beta", HYPERPARAMETER), ("grad", GRADIENT)),
    "PowerSign": (("var", VARIABLE), ("m", SLOT), ("lr", LEARNING_RATE),
                  ("logbase", HYPERPARAMETER), ("sign_decay", HYPERPARAMETER),
                  ("beta", HYPERPARAMETER), ("grad", GRADIENT)),
    "RMSProp": (("var", VARIABLE), ("ms", SLOT), ("mom", SLOT), ("lr", LEARNING_RATE),
                ("rho", HYPERPARAMETER), ("momentum", HYPERPARAMETER), ("epsilon", EPSILON),
                ("grad", GRADIENT)),
    "CenteredRMSProp": (("var", VARIABLE), ("mg", SLOT), ("ms", SLOT), ("mom", SLOT),
                        ("lr", LEARNING_RATE), ("rho", HYPERPARAMETER),
                        ("momentum", HYPERPARAMETER), ("epsilon", EPSILON), ("grad", GRADIENT)),
}

#: How each family's update takes gradients multiplied by c (`ScaleFold`): the input to multiply
#: and the power of c that leaves the step unchanged, when its slots start at zero. SGD and
#: momentum (both forms; Nesterov too) are linear in the gradient: lr / c. Adam, AMSGrad and
#: AdaMax divide m by sqrt(v) or max|g|, both scaled by c, plus epsilon: epsilon * c. RMSProp
#: divides by sqrt(ms + epsilon), ms scaled by c^2: epsilon * c^2. The others have no such
#: fold (Adagrad's accumulator starts above zero; FTRL's and the proximal ones' l1/l2
#: shrinkage, Adadelta's and AddSign/PowerSign's updates are not homogeneous in the gradient).
SCALE_FOLDS: dict[str, tuple[str, int]] = {
    "GradientDescent": (LEARNING_RATE, -1), "Momentum": (LEARNING_RATE, -1),
    "KerasMomentum": (LEARNING_RATE, -1), "Adam": (EPSILON, 1), "AdamWithAmsgrad": (EPSILON, 1),
    "AdaMax": (EPSILON, 1), "RMSProp": (EPSILON, 2), "CenteredRMSProp": (EPSILON, 2),
}

#: The forms TensorFlow has of each family: "" (ApplyX, reference variables), "Resource",
#: "Sparse", "ResourceSparse".
_ALL_FORMS = ("", "Resource", "Sparse", "ResourceSparse")
_FORMS: dict[str, tuple[str, ...]] = {
    **{family: _ALL_FORMS for family in (
        "ProximalGradientDescent", "Momentum", "Adagrad", "AdagradV2", "ProximalAdagrad",
        "AdagradDA", "Ftrl", "FtrlV2", "Adadelta", "RMSProp", "CenteredRMSProp")},
    **{family: ("", "Resource") for family in ("GradientDescent", "Adam", "AdaMax", "AddSign",
                                               "PowerSign")},
    "AdamWithAmsgrad": ("Resource",),
    "KerasMomentum": ("Resource", "ResourceSparse"),
}

#: Assigns: the variable, then the value written (read, added or subtracted).
_ASSIGN_OPS = ("Assign", "AssignAdd", "AssignSub", "AssignVariableOp", "AssignAddVariableOp",
               "AssignSubVariableOp")
#: Assigns that add to the variable: on an integer variable, a step counter.
COUNTING_OPS = frozenset({"AssignAdd", "AssignAddVariableOp"})
#: Scatters: the variable, the rows (or nd-indices), the values written there. The variable input
#: is `ref` but for the resource row scatters (`resource`): ResourceScatterNd* keep `ref`.
_SCATTER_OPS = tuple(f"{prefix}{op}" for prefix in ("Scatter", "ResourceScatter")
                     for op in ("Add", "Sub", "Mul", "Div", "Min", "Max", "Update")) + tuple(
    f"{prefix}Nd{op}" for prefix in ("Scatter", "ResourceScatter")
    for op in ("Add", "Sub", "Min", "Max", "Update"))


@dataclass(frozen=True)
class WriteArgs:
    """One variable-writing op: its kind ("optimizer_update", "assign", "scatter") and each
    data input's OpDef name and role, in order."""

    op: str
    kind: str
    args: tuple[tuple[str, str], ...]
    #: The optimizer family of an update kernel ("Adam" for ResourceSparseApplyAdam).
    family: str = ""

    def slots(self, role: str) -> tuple[int, ...]:
        """The input slots with `role`."""
        return tuple(i for i, (_name, r) in enumerate(self.args) if r == role)

    def slot(self, role: str) -> int | None:
        """The one input slot with `role` (None when there is none)."""
        found = self.slots(role)
        return found[0] if found else None

    def role(self, slot: int) -> str | None:
        """The role of input `slot` (None past the op's inputs)."""
        return self.args[slot][1] if slot < len(self.args) else None

    @property
    def is_optimizer_update(self) -> bool:
        return self.kind == "optimizer_update"


def _sparse(args: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for name, role in args:
        if role == GRADIENT:
            out += [("grad", GRADIENT), ("indices", INDICES)]
        else:
            out.append((name, role))
    return tuple(out)


def _table() -> dict[str, WriteArgs]:
    table: dict[str, WriteArgs] = {}
    for family, args in _FAMILIES.items():
        for form in _FORMS[family]:
            op = f"{form}Apply{family}"
            table[op] = WriteArgs(op, "optimizer_update",
                                  _sparse(args) if "Sparse" in form else args, family)
    for op in _ASSIGN_OPS:
        variable = "resource" if op.endswith("VariableOp") else "ref"
        table[op] = WriteArgs(op, "assign", ((variable, VARIABLE), ("value", VALUE)))
    for op in _SCATTER_OPS:
        variable = "resource" if op.startswith("Resource") and "Nd" not in op else "ref"
        table[op] = WriteArgs(op, "scatter", ((variable, VARIABLE), ("indices", INDICES),
                                              ("updates", VALUE)))
    return table


#: Every variable-writing op TensorFlow has, by op name.
WRITE_ARGS: dict[str, WriteArgs] = _table()


def write_args(op: str) -> WriteArgs | None:
    """What the inputs of `op` are, when it writes a variable (None otherwise)."""
    return WRITE_ARGS.get(op)


def is_optimizer_update(op: str) -> bool:
    """Whether `op` is an optimizer's update kernel (ApplyAdam, ResourceSparseApplyFtrl, ...)."""
    args = WRITE_ARGS.get(op)
    return args is not None and args.is_optimizer_update


def scale_fold(op: str) -> ScaleFold | None:
    """How update kernel `op` can take gradients multiplied by a factor (`SCALE_FOLDS`; None
    for other ops and families without an exact fold)."""
    args = WRITE_ARGS.get(op)
    fold = SCALE_FOLDS.get(args.family) if args is not None else None
    if args is None or fold is None:
        return None
    role, power = fold
    slot = args.slot(role)
    assert slot is not None, f"{op} has no {role} input"
    return ScaleFold(slot, power, role.replace("_", " "))
