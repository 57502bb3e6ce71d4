"""TensorFlow entry points (needs the `tensorflow` extra); they live in `amp_rewriter.formats.tf`.

    from amp_rewriter.tf import mixed_precision
    step = mixed_precision(train_step, target="fp16")    # a tf.function with a GradientTape
    loss = step(x, y)                                     # the rewritten step, loss scaled

    from amp_rewriter.tf import rewrite_training_graph   # TF1 training graphs
    result = rewrite_training_graph(tf.compat.v1.get_default_graph(), loss=loss, train_op=train_op)
    with tf.compat.v1.Session(graph=result.graph) as session: ...

Inference graphs and SavedModels: `convert_graphdef`, `convert_saved_model`, `convert_tf_file`.
"""

from .formats.tf import (
    LossScaleRule,
    MixedPrecisionStep,
    TrainingRewrite,
    check_tf_graph,
    convert_graphdef,
    convert_saved_model,
    convert_tf_file,
    mixed_precision,
    rewrite_training_graph,
)

__all__ = ["mixed_precision", "MixedPrecisionStep", "rewrite_training_graph", "TrainingRewrite",
           "LossScaleRule", "check_tf_graph", "convert_graphdef", "convert_saved_model",
           "convert_tf_file"]
