"""Keras 3 entry point (TensorFlow backend; needs the `tensorflow` extra).

    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    step = amp_rewriter.keras.enable(model, target="fp16")   # after compile, before fit
    model.fit(x, y, epochs=3)            # the rewritten train step, loss scaled in the graph
    step.loss_scale, step.report         # the scaler's state, the last trace's Report

See `amp_rewriter.formats.tf.training.keras_fit`.
"""

from .formats.tf.training.keras_fit import enable

__all__ = ["enable"]
