"""The kinds of rule behind a precision decision: every decision records one, beside its text.

`explain` and the report show the kind, so users can tell an op-list entry from a propagation
path, a constant that would not fit, a missing kernel, their own override or a front end's pin.
"""

OP_LIST = "op_list"                # the op's class in the generic or backend op list
PROPAGATION = "propagation"        # Grappler-style painting along the graph
CONSTANT_RANGE = "constant_range"  # a constant input the target dtype cannot represent
BACKEND_KERNEL = "backend_kernel"  # the backend has no low-precision kernel for the op
USER_OVERRIDE = "user_override"    # --allow/--deny/..., --keep-node, a config file, env lists
PIN = "pin"                        # a front end keeps the node fp32 (fetch nodes, training paths)
TYPE_GROUP = "type_group"          # slots or nodes that must agree (loop edges, parameters)
SCHEMA = "schema"                  # the op's schema: no schema, or the target type not allowed
EXISTING_CAST = "existing_cast"    # a Cast already in the model, retargeted
STRUCTURE = "structure"            # a pattern in the graph: an attention mask, tanh-GELU's cube,
                                   # float arithmetic that computes shapes or indices
MEASUREMENT = "measurement"        # calibration data showed a hazard or an error (convert --auto)

ALL_KINDS = (OP_LIST, PROPAGATION, CONSTANT_RANGE, BACKEND_KERNEL, USER_OVERRIDE, PIN, TYPE_GROUP,
             SCHEMA, EXISTING_CAST, STRUCTURE, MEASUREMENT)
