"""Keras 3 `fit`, `evaluate` and `predict` in mixed precision (TensorFlow backend): `enable`.

Keras's TensorFlow trainer traces `model.train_step(data)` inside its own train function (and
`test_step`, `predict_step` likewise), under `strategy.run` when the model was compiled in a
strategy's scope. `enable` puts a `MixedPrecisionStep` in place of the model's `train_step` and
a `MixedPrecisionFunction` in place of `test_step` and `predict_step`, as instance attributes
that Keras's tracking does not see (the model's checkpoints keep their layout), and drops the
functions Keras made already, so the next `fit` traces the rewritten step. The model is not
changed: no policy, no cast layers, its variables stay fp32; any op in the step, Keras's or the
user's (`tf.matmul` on a weight made with `autocast=False`), goes through the op lists.

XLA is turned off for the model (`jit_compile`): the rewritten step gates its updates with
TensorFlow's executor (Switch/Merge on the all-finite flag), which XLA's clusters do not run.

Logging: `fit` gets a callback that adds `loss_scale` and `skipped_steps` to the logs of every
batch and epoch, so the progress bar, the History and a TensorBoard callback (as
`epoch_loss_scale`, `batch_loss_scale`, ...) show them.
"""

from __future__ import annotations

import functools
from typing import Any

from ....errors import AmpError
from .hook import MixedPrecisionFunction, MixedPrecisionStep, step_options


def _scale_logger(step: MixedPrecisionStep) -> Any:
    """A Keras callback that adds the scaler's state to the logs (before the user's callbacks,
    so a TensorBoard callback writes them)."""
    import keras

    class LossScaleLogs(keras.callbacks.Callback):
        """Adds `loss_scale` and `skipped_steps` to each batch's and epoch's logs."""

        def _add(self, logs: dict | None) -> None:
            if logs is None:
                return
            if step.loss_scale is not None:
                logs["loss_scale"] = float(step.loss_scale.numpy())
            if step.skipped_steps is not None:
                logs["skipped_steps"] = int(step.skipped_steps.numpy())

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self._add(logs)

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            self._add(logs)

    return LossScaleLogs()


def enable(model: Any, target: str = "fp16", **options: Any) -> MixedPrecisionStep:
    """Make `model.fit` run its train step in mixed precision with in-graph loss scaling, and
    `evaluate` / `predict` their steps in mixed precision (see the module docstring).

    Args:
        model: a compiled Keras 3 model (TensorFlow backend).
        target, **options: as for `amp_rewriter.tf.mixed_precision` (the conversion options and
            the loss-scale rule).

    Returns:
        The `MixedPrecisionStep` now in `model.train_step`: `loss_scale`, `good_steps`,
        `skipped_steps` and `report` (the last traced train step's).
    """
    import keras

    if not isinstance(model, keras.Model):
        raise AmpError(f"expected a Keras model, got {type(model).__name__}")
    if keras.backend.backend() != "tensorflow":
        raise AmpError(f"amp_rewriter.keras.enable needs Keras's TensorFlow backend, not "
                       f"{keras.backend.backend()!r}")
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", True):
        raise AmpError("compile the model (optimizer and loss) before amp_rewriter.keras.enable")
    if isinstance(model.train_step, MixedPrecisionStep):
        raise AmpError("amp_rewriter.keras.enable was already called on this model")
    converted, rule, update = step_options(target, options)
    train_step = MixedPrecisionStep(model.train_step, converted, rule, update)
    replacements = {"train_step": train_step,
                    "test_step": MixedPrecisionFunction(model.test_step, converted),
                    "predict_step": MixedPrecisionFunction(model.predict_step, converted)}
    for name, replacement in replacements.items():
        object.__setattr__(model, name, replacement)  # not tracked: checkpoints keep layout
    model.jit_compile = False
    for name in ("train_function", "test_function", "predict_function"):
        setattr(model, name, None)
    fit = model.fit

    @functools.wraps(fit)
    def fit_with_scale_logs(*args: Any, callbacks: Any = None, **kwargs: Any) -> Any:
        callbacks = [_scale_logger(train_step), *(callbacks or [])]
        return fit(*args, callbacks=callbacks, **kwargs)

    object.__setattr__(model, "fit", fit_with_scale_logs)
    return train_step
