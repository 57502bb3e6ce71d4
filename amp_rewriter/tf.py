"""TensorFlow entry points (needs the `tensorflow` extra); they live in `amp_rewriter.formats.tf`.

    from amp_rewriter.tf import rewrite_training_graph
    result = rewrite_training_graph(tf.compat.v1.get_default_graph(), loss=loss, train_op=train_op)
    with tf.compat.v1.Session(graph=result.graph) as session: ...

Inference graphs and SavedModels: `convert_graphdef`, `convert_saved_model`, `convert_tf_file`.
"""

from .formats.tf import (
    LossScaleRule,
    TrainingRewrite,
    check_tf_graph,
    convert_graphdef,
    convert_saved_model,
    convert_tf_file,
    rewrite_training_graph,
)

__all__ = ["rewrite_training_graph", "TrainingRewrite", "LossScaleRule", "check_tf_graph",
           "convert_graphdef", "convert_saved_model", "convert_tf_file"]
