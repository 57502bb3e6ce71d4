"""The training core: what a mixed-precision training rewrite needs, for any format and front end
(nothing here imports onnx or tensorflow).

- `rule`: the loss-scale rule, declared once, and its pure step function;
- `plan`: `TrainingPlan`, a training step over IR values (loss, gradient seeds, the frontier
  where gradients leave the backward pass, their aggregation, the variable writes);
- `ops`: `TrainingOps`, what a format supplies to build the scaler's nodes (its op names, its
  state variables, its gating form);
- `passes`: the training passes (registered with the others; the pipelines name them).

A front end (TF1 graphs: `formats/tf/training/`) finds the plan in its graph, puts a
`TrainingContext` on the `PassContext` and runs the `tf-training` pipeline.
"""

from .rule import DEFAULT_MODE, LossScaleRule, ScalerState

__all__ = ["DEFAULT_MODE", "LossScaleRule", "ScalerState"]
