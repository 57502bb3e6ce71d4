"""TF2 steps whose variables the caller stores in 16 bits (a Keras model built with
`dtype="float16"` or `"bfloat16"`, whose optimizer makes its slots in the same dtype), trained
with `mixed_precision(..., weights="fp16"|"bf16")`.

Before the training rewrite the body is read as the fp32 step it stands for (`read_as_fp32`):
each read of a 16-bit variable is followed by a Cast to float32, and every other 16-bit value of
the body (the forward and backward pass the model's dtype made 16-bit, and the optimizer's
arithmetic, which Keras runs in the variable's dtype) becomes float32: type attributes, 16-bit
constants, casts. The writes of those variables then write float32, and the training core's
`update_weights_in_fp32` makes every one of them update an fp32 scratch copy and writes the copy
back rounded (stochastically by default) into the caller's 16-bit variable. The precision passes
then choose, as for an fp32 step, what runs in 16 bits (the matmuls and convolutions, forward
and backward) and what stays fp32 (softmax, the loss, the update).

Arguments and return values keep their dtypes (a 16-bit one is cast at the boundary). A body
that calls a library function with 16-bit values is refused in one line.
"""

from __future__ import annotations

import numpy as np
from tensorflow.core.framework import attr_value_pb2, function_pb2, types_pb2
from tensorflow.python.framework import tensor_util

from ....errors import AmpError

#: The 16-bit dtypes read as float32.
SIXTEEN_BITS = frozenset({types_pb2.DT_HALF, types_pb2.DT_BFLOAT16})
#: Ops that read a variable through its handle (input 0) in their `dtype`.
READ_OPS = frozenset({"ReadVariableOp"})
#: Ops that write a variable through its handle (input 0) from a value of their `dtype`.
WRITE_OPS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})
#: Ops that read or write a variable's dtype from a handle and are neither (refused).
OTHER_HANDLE_OPS = frozenset({"ResourceGather", "ResourceScatterAdd", "ResourceScatterSub",
                              "ResourceScatterUpdate", "ResourceGatherNd"})


def _is_sixteen(attr: attr_value_pb2.AttrValue) -> bool:
    return attr.type in SIXTEEN_BITS or any(t in SIXTEEN_BITS for t in attr.list.type)


def _upcast_attr(attr: attr_value_pb2.AttrValue) -> None:
    if attr.type in SIXTEEN_BITS:
        attr.type = types_pb2.DT_FLOAT
    for index, dtype in enumerate(attr.list.type):
        if dtype in SIXTEEN_BITS:
            attr.list.type[index] = types_pb2.DT_FLOAT


def _cast_node(fdef: function_pb2.FunctionDef, name: str, source: str, src: int,
               dst: int) -> str:
    """Add a Cast node reading `source`; its output's reference."""
    node = fdef.node_def.add()
    node.name, node.op = name, "Cast"
    node.input.append(source)
    node.attr["SrcT"].type = src
    node.attr["DstT"].type = dst
    node.attr["Truncate"].b = False
    return f"{name}:y:0"


def read_as_fp32(fdef: function_pb2.FunctionDef, library: function_pb2.FunctionDefLibrary,
                 stored: dict[str, str]) -> tuple[function_pb2.FunctionDef, int]:
    """The body `fdef` read as the fp32 step it stands for (see the module docstring);
    `stored`: the resource arguments of the 16-bit variables (their IR dtype), by name. Returns
    the new FunctionDef and how many 16-bit values became float32."""
    out = function_pb2.FunctionDef()
    out.CopyFrom(fdef)
    called = {f.signature.name for f in library.function}
    names = {node.name for node in out.node_def} | {a.name for a in out.signature.input_arg}

    def fresh(base: str) -> str:
        name, number = base, 0
        while name in names:
            number += 1
            name = f"{base}_{number}"
        names.add(name)
        return name

    renamed: dict[str, str] = {}  # output reference -> the float32 reference replacing it
    added: set[str] = set()  # the casts made here

    def cast(base: str, source: str, src: int, dst: int) -> str:
        name = fresh(base)
        added.add(name)
        return _cast_node(out, name, source, src, dst)

    changed = 0
    nodes = list(out.node_def)
    for argument in out.signature.input_arg:
        if argument.type in SIXTEEN_BITS:
            renamed[argument.name] = cast(f"{argument.name}_amp_fp32", argument.name,
                                          argument.type, types_pb2.DT_FLOAT)
            changed += 1
    for node in nodes:
        handle = node.input[0] if node.input else ""
        on_stored = handle in stored
        if node.op in called or any(a.func.name in called for a in node.attr.values()):
            if any(_is_sixteen(a) for a in node.attr.values()):
                raise AmpError(f"16-bit weights: {node.name!r} calls function {node.op!r} with "
                               f"16-bit values; the step cannot be read as fp32")
            continue
        if node.op in READ_OPS and on_stored:
            # the read stays in the variable's dtype; its readers read a float32 Cast of it
            dtype = node.attr["dtype"].type
            if dtype in SIXTEEN_BITS:
                reference = f"{node.name}:value:0"
                renamed[reference] = cast(f"{node.name}_amp_fp32", reference, dtype,
                                          types_pb2.DT_FLOAT)
                changed += 1
            continue
        if node.op in OTHER_HANDLE_OPS and on_stored:
            raise AmpError(f"16-bit weights: {node.op} {node.name!r} reads or writes a 16-bit "
                           f"variable; only ReadVariableOp and Assign(Add|Sub)VariableOp can")
        if (node.op in READ_OPS or node.op in WRITE_OPS or node.op in OTHER_HANDLE_OPS) \
                and not on_stored and node.attr["dtype"].type in SIXTEEN_BITS:
            raise AmpError(f"16-bit weights: {node.op} {node.name!r} uses a 16-bit variable the "
                           f"step does not capture")
        if node.op == "Const" and node.attr["dtype"].type in SIXTEEN_BITS:
            array = tensor_util.MakeNdarray(node.attr["value"].tensor).astype(np.float32)
            node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(array))
            node.attr["dtype"].type = types_pb2.DT_FLOAT
            changed += 1
            continue
        if any(_is_sixteen(a) for a in node.attr.values()):
            for attr in node.attr.values():
                _upcast_attr(attr)
            changed += 1
    if renamed:
        for node in out.node_def:
            if node.name in added:
                continue
            for index, reference in enumerate(node.input):
                if reference in renamed:
                    node.input[index] = renamed[reference]
    for output in out.signature.output_arg:
        reference = out.ret[output.name]
        reference = renamed.get(reference, reference)
        if output.type in SIXTEEN_BITS:
            reference = cast(f"{output.name}_amp_16bit", reference, types_pb2.DT_FLOAT,
                             output.type)
        out.ret[output.name] = reference
    return out, changed
