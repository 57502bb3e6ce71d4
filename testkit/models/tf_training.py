"""TF1 training graphs on scikit-learn's digits (no download) for the training rewrite's tests and
scripts/train_digits.py.

    graph = build_training_graph("mlp", "adam")
    losses, accuracy = train(graph, steps=300)

Every graph has placeholders `x` [batch, 64] and `y` [batch], the scalar `loss`, the train op
`train`, `accuracy` on the batch fed, `init` (global_variables_initializer) and a Saver; the train
op is also in the `train_op` collection. Initializers are seeded, so two graphs built with the
same arguments start from the same weights.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import tensorflow as tf

OPTIMIZERS = ("sgd", "momentum", "adam", "rmsprop")
LEARNING_RATES = {"sgd": 0.1, "momentum": 0.05, "adam": 0.003, "rmsprop": 0.003}


def digits_data(test_size: int = 500, seed: int = 0):
    """(x_train, y_train, x_test, y_test): 8x8 digits scaled to [0, 1], a fixed split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    test, train_ = order[:test_size], order[test_size:]
    return x[train_], y[train_], x[test], y[test]


def _variable(name: str, shape: list[int], resource: bool, seed: int, zeros: bool = False):
    initializer = (tf.compat.v1.zeros_initializer() if zeros
                   else tf.compat.v1.glorot_uniform_initializer(seed=seed))
    return tf.compat.v1.get_variable(name, shape, tf.float32, initializer=initializer,
                                     use_resource=resource)


def _logits(model: str, x, resource: bool, seed: int):
    """Forward pass; variables are shared between calls (towers) through the variable scope."""
    with tf.compat.v1.variable_scope("model", reuse=tf.compat.v1.AUTO_REUSE):
        if model == "mlp":
            w1 = _variable("w1", [64, 64], resource, seed)
            b1 = _variable("b1", [64], resource, seed, zeros=True)
            w2 = _variable("w2", [64, 10], resource, seed + 1)
            b2 = _variable("b2", [10], resource, seed, zeros=True)
            hidden = tf.nn.relu(tf.matmul(x, w1) + b1)
            return tf.matmul(hidden, w2) + b2
        if model == "cnn":
            kernel = _variable("conv", [3, 3, 1, 16], resource, seed)
            bias = _variable("conv_b", [16], resource, seed, zeros=True)
            w = _variable("dense", [4 * 4 * 16, 10], resource, seed + 1)
            b = _variable("dense_b", [10], resource, seed, zeros=True)
            images = tf.reshape(x, [-1, 8, 8, 1])
            conv = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(images, kernel, 1, "SAME"), bias))
            pooled = tf.nn.max_pool2d(conv, 2, 2, "VALID")
            return tf.matmul(tf.reshape(pooled, [-1, 4 * 4 * 16]), w) + b
    raise ValueError(f"unknown model {model!r} (mlp or cnn)")


def _optimizer(name: str, learning_rate: float | None):
    lr = LEARNING_RATES[name] if learning_rate is None else learning_rate
    train = tf.compat.v1.train
    if name == "sgd":
        return train.GradientDescentOptimizer(lr)
    if name == "momentum":
        return train.MomentumOptimizer(lr, 0.9)
    if name == "adam":
        return train.AdamOptimizer(lr)
    if name == "rmsprop":
        return train.RMSPropOptimizer(lr)
    raise ValueError(f"unknown optimizer {name!r} ({', '.join(OPTIMIZERS)})")


def _tower_loss(logits, labels, loss_multiplier: float):
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=logits))
    return loss * loss_multiplier if loss_multiplier != 1.0 else loss


def build_training_graph(model: str = "mlp", optimizer: str = "adam", *, resource: bool = False,
                         global_step: bool = True, towers: int = 1, loss_multiplier: float = 1.0,
                         learning_rate: float | None = None, seed: int = 0) -> tf.Graph:
    """A TF1 training graph (see the module docstring for its names).

    towers > 1 splits the batch between towers that share the variables; their gradients are
    summed and averaged before one update, as multi-GPU TF1 scripts do. loss_multiplier scales
    the loss (a tiny one makes fp16 gradients underflow without loss scaling).
    """
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, 64], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        opt = _optimizer(optimizer, learning_rate)
        step = tf.compat.v1.train.get_or_create_global_step() if global_step else None
        if towers == 1:
            logits = _logits(model, x, resource, seed)
            loss = tf.identity(_tower_loss(logits, y, loss_multiplier), name="loss")
            train_op = opt.minimize(loss, global_step=step, name="train")
        else:
            xs, ys = tf.split(x, towers), tf.split(y, towers)
            tower_losses, tower_grads, all_logits = [], [], []
            for i in range(towers):
                with tf.name_scope(f"tower_{i}"):
                    logits_i = _logits(model, xs[i], resource, seed)
                    loss_i = _tower_loss(logits_i, ys[i], loss_multiplier)
                    tower_losses.append(loss_i)
                    all_logits.append(logits_i)
                    tower_grads.append(opt.compute_gradients(loss_i))
            averaged = []
            for pairs in zip(*tower_grads):
                grads = [g for g, _ in pairs]
                averaged.append((tf.add_n(grads) / float(towers), pairs[0][1]))
            loss = tf.identity(tf.add_n(tower_losses) / float(towers), name="loss")
            logits = tf.concat(all_logits, 0)
            train_op = opt.apply_gradients(averaged, global_step=step, name="train")
        correct = tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y)
        tf.reduce_mean(tf.cast(correct, tf.float32), name="accuracy")
        tf.compat.v1.add_to_collection("train_op", train_op)
        tf.compat.v1.global_variables_initializer()
        tf.compat.v1.train.Saver()
    return graph


def _classifier_head(features, labels, name: str = "head"):
    w = tf.compat.v1.get_variable(name, [int(features.shape[-1]), 10])
    logits = tf.matmul(features, w)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits), name="loss")


def _special_graph(body) -> tf.Graph:
    """A graph with placeholders `x` and `y`, `loss` and `train` from `body(x, y)`, and `init`."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 64], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        body(x, y)
        tf.compat.v1.variables_initializer(tf.compat.v1.global_variables(), name="init")
    return graph


def integer_fill_graph() -> tf.Graph:
    """reduce_sum over a non-batch axis with a dynamic batch: its gradient (Sum_grad) holds an
    int32 Fill(shape, 1), which is not a gradient seed."""
    def body(x, y):
        w = tf.compat.v1.get_variable("w", [64, 40])
        features = tf.reduce_sum(tf.reshape(tf.matmul(x, w), [-1, 10, 4]), axis=2)
        loss = _classifier_head(features, y)
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return _special_graph(body)


def sparse_embedding_graph(resource: bool) -> tf.Graph:
    """An embedding table trained by Adam through sparse gradients (IndexedSlices: scatters into
    the slots). x picks the rows, so an inf goes in through the `poison` multiplier instead."""
    def body(x, y):
        tokens = tf.cast(tf.round(x * 16.0), tf.int32) + tf.range(64) * 17
        table = tf.compat.v1.get_variable("table", [64 * 17, 16], use_resource=resource)
        poison = tf.compat.v1.placeholder_with_default(1.0, [], name="poison")
        embedded = tf.reduce_mean(tf.nn.embedding_lookup(table, tokens), axis=1) * poison
        tf.compat.v1.train.AdamOptimizer(0.01).minimize(_classifier_head(embedded, y),
                                                        name="train")
    return _special_graph(body)


def batch_norm_graph() -> tf.Graph:
    """Moving averages updated the TF1 way: the train op is built under
    control_dependencies(UPDATE_OPS), one reference and one resource variable."""
    def body(x, y):
        hidden = tf.matmul(x, tf.compat.v1.get_variable("w", [64, 32]))
        mean, variance = tf.nn.moments(hidden, [0])
        zeros = tf.compat.v1.zeros_initializer()
        moving_mean = tf.compat.v1.get_variable("moving_mean", [32], initializer=zeros,
                                                trainable=False, use_resource=False)
        moving_variance = tf.compat.v1.get_variable("moving_variance", [32], initializer=zeros,
                                                    trainable=False, use_resource=True)
        updates = [tf.compat.v1.assign(moving_mean, 0.9 * moving_mean + 0.1 * mean),
                   moving_variance.assign_sub(0.1 * (moving_variance - variance))]
        normed = tf.nn.batch_normalization(hidden, mean, variance, None, None, 1e-3)
        loss = _classifier_head(tf.nn.relu(normed), y)
        with tf.control_dependencies(updates):
            tf.compat.v1.train.MomentumOptimizer(0.05, 0.9).minimize(loss, name="train")
    return _special_graph(body)


def classic_sum_graph(copies: int = 1000, start: float = 0.0, update: float = 1e-4,
                      resource: bool = False) -> tf.Graph:
    """The classic small-updates example: `copies` independent weights `w` (one variable of
    shape [1, copies]) start at `start`, and each step of SGD adds `update` to every one (the
    loss is -sum(x @ w) with x fed [[1]]: the gradient is -1, the learning rate `update`)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 1], name="x")
        w = tf.compat.v1.get_variable("w", [1, copies], tf.float32, use_resource=resource,
                                      initializer=tf.compat.v1.constant_initializer(start))
        loss = tf.identity(-tf.reduce_sum(tf.matmul(x, w)), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(update).minimize(loss, name="train")
        tf.compat.v1.global_variables_initializer()
        tf.compat.v1.train.Saver()
    return graph


#: The other training graphs the tests build, by name: each has `x`, `y`, `loss`, `train` and
#: `init` (sparse_* also `poison`, a multiplier that carries an inf past the row lookup).
SPECIAL_GRAPHS = {
    "integer_fill": integer_fill_graph,
    "sparse_ref": lambda: sparse_embedding_graph(False),
    "sparse_resource": lambda: sparse_embedding_graph(True),
    "batch_norm": batch_norm_graph,
}


def batches(x: np.ndarray, y: np.ndarray, batch: int, steps: int, seed: int = 0):
    """`steps` seeded mini-batches (reshuffled each epoch)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    position = 0
    for _ in range(steps):
        if position + batch > len(x):
            order, position = rng.permutation(len(x)), 0
        index = order[position:position + batch]
        position += batch
        yield x[index], y[index]


def train(graph: tf.Graph, steps: int = 300, batch: int = 64, loss: str = "loss:0",
          train_op: str = "train", data=None, seed: int = 0, session_hook=None,
          end_hook=None) -> tuple[list[float], float]:
    """Train from the graph's initializers; returns (loss per step, test accuracy).

    `session_hook(session, step)` runs before each step (tests use it to look at variables).
    `end_hook(session)` runs once after the last step, before the session closes (for state
    that only exists inside it, such as a rewrite's final loss scale).
    """
    x_train, y_train, x_test, y_test = data if data is not None else digits_data()
    losses = []
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(graph.get_operation_by_name("init"))
        for step, (xb, yb) in enumerate(batches(x_train, y_train, batch, steps, seed)):
            if session_hook is not None:
                session_hook(session, step)
            _, value = session.run([train_op, loss], {"x:0": xb, "y:0": yb})
            losses.append(float(value))
        accuracy = session.run("accuracy:0", {"x:0": x_test, "y:0": y_test})
        if end_hook is not None:
            end_hook(session)
    return losses, float(accuracy)


def train_and_measure(model: str, optimizer: str, weights: str | None, steps: int, data) -> dict:
    """Train `build_training_graph(model, optimizer)` for `steps` mini-batches of `data`
    (`digits_data()`), its weights stored in `weights` (a 16-bit type, stochastic rounding) or
    fp32 (None): the test accuracy and the checkpoint bytes and dtypes of the model's weights."""
    import tensorflow as tf

    from amp_rewriter.tf import rewrite_training_graph

    graph = build_training_graph(model, optimizer)
    if weights is not None:
        graph = rewrite_training_graph(graph, target=weights, weights=weights).graph
    with graph.as_default():
        saver = tf.compat.v1.train.Saver()
    x_train, y_train, x_test, y_test = data
    with tf.compat.v1.Session(graph=graph) as session, tempfile.TemporaryDirectory() as tmp:
        session.run("init")
        for xb, yb in batches(x_train, y_train, 64, steps):
            session.run("train", {"x:0": xb, "y:0": yb})
        accuracy = float(session.run("accuracy:0", {"x:0": x_test, "y:0": y_test}))
        path = saver.save(session, str(Path(tmp) / "ckpt"))
        reader = tf.train.load_checkpoint(path)
        names = [name for name in reader.get_variable_to_dtype_map()
                 if name.startswith("model/") and "/" not in name[len("model/"):]]
        weight_bytes = sum(reader.get_tensor(name).nbytes for name in names)
        dtypes = sorted({reader.get_variable_to_dtype_map()[name].name for name in names})
    return {"model": model, "optimizer": optimizer, "weights": weights or "fp32",
            "steps": steps, "test_accuracy": round(100 * accuracy, 2),
            "checkpoint_weight_bytes": weight_bytes, "checkpoint_weight_dtypes": dtypes}
