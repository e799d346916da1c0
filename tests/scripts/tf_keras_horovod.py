"""Horovod's Keras optimizer methods on this rank: ``_compute_gradients``, local aggregation and its counter.

Run under ``ringpipe launch -n 2``, with Keras 3 or with ``TF_USE_LEGACY_KERAS=1`` (tf-keras).
Rank ``r``'s loss is ``(r + 1) * sum(w)`` (gradient ``r + 1`` in every entry), so the reduced
gradient says which reduction happened and how often. Writes ``rank<R>.json`` into the folder
given as argument.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import ringpipe.tensorflow.keras as hvd
from ringpipe.tensorflow.keras._which import KERAS2

W0 = [1.0, 2.0, 3.0]


def optimizers():
    """The optimizer kinds of this Keras: SGD (and tf-keras's legacy SGD), rate 1, no momentum."""
    found = {"sgd": lambda: tf.keras.optimizers.SGD(learning_rate=1.0)}
    if KERAS2:
        found["legacy_sgd"] = lambda: tf.keras.optimizers.legacy.SGD(learning_rate=1.0)
    return found


def compute_then_apply(make, op, how):
    """One ``_compute_gradients`` + ``apply_gradients`` step; ``how``: eager, tf.function, or a tape given."""
    r = hvd.rank()
    w = tf.Variable(W0)
    opt = hvd.DistributedOptimizer(make(), op=op)

    def loss():
        return (r + 1.0) * tf.reduce_sum(w)

    def step():
        if how == "tape":
            with tf.GradientTape() as tape:
                value = loss()
            pairs = opt._compute_gradients(value, [w], tape=tape)
        else:
            pairs = opt._compute_gradients(loss, [w])
        opt.apply_gradients(pairs)
        return pairs[0][0]

    grad = tf.function(step)() if how == "function" else step()
    return {"grad": np.asarray(grad).tolist(), "w": w.numpy().tolist(), "iterations": int(opt.iterations.numpy())}


def aggregate(make, passes, average, calls, in_function):
    """``calls`` steps with ``backward_passes_per_step=passes``: the weights, iterations and counter after each."""
    r = hvd.rank()
    w = tf.Variable(W0)
    opt = hvd.DistributedOptimizer(make(), backward_passes_per_step=passes, average_aggregated_gradients=average,
                                   sparse_as_dense=True)

    def step():
        pairs = opt._compute_gradients(lambda: (r + 1.0) * tf.reduce_sum(w), [w])
        opt.apply_gradients(pairs)

    run = tf.function(step) if in_function else step
    seen = []
    for _ in range(calls):
        run()
        seen.append({"w": w.numpy().tolist(), "iterations": int(opt.iterations.numpy()),
                     "counter": int(opt._agg_helper.counter.numpy())})
    return seen


class Subtract(tf.keras.optimizers.Optimizer):
    """``w -= gradient`` and no state, as Horovod's test optimizer (SGD's momentum buffer would keep an inf)."""

    def __init__(self, name="subtract", **kwargs):
        if KERAS2:  # tf-keras's base optimizer takes no rate; its subclasses build one
            super().__init__(name=name, **kwargs)
            self._learning_rate = self._build_learning_rate(1.0)
        else:
            kwargs.setdefault("learning_rate", 1.0)
            super().__init__(name=name, **kwargs)

    def update_step(self, gradient, variable, learning_rate=None):
        variable.assign_sub(gradient)


def infinite_first_cycle(kind, make):
    """Horovod's case: an infinite gradient in the first aggregation cycle does not reach the second.

    ``x`` is set back to 0 between the cycles; the second cycle then applies only its own sum.
    The optimizer keeps no state (tf-keras's legacy SGD without momentum keeps none).
    """
    count = tf.Variable(0)
    x = tf.Variable(0.0)
    base = make() if kind == "legacy_sgd" else Subtract()
    opt = hvd.DistributedOptimizer(base, backward_passes_per_step=2, sparse_as_dense=True)

    def loss():
        count.assign_add(1)
        return tf.cond(count > 1, lambda: x, lambda: x * float("inf"))

    grads = []
    for call in range(4):
        if call == 2:
            x.assign(0.0)
        pairs = opt._compute_gradients(loss, [x])
        opt.apply_gradients(pairs)
        grads.append(float(pairs[0][0].numpy()))
    return {"grads": grads, "x": float(x.numpy())}


class Custom(tf.keras.optimizers.RMSprop):
    """An optimizer class of the user's own, as in Horovod's load_model tests."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


def load_custom(out_dir):
    """Save a model trained one step with ``DistributedOptimizer(Custom)``; load it back the two Horovod ways.

    ``custom_optimizers=[Custom]``, and ``custom_objects={"Custom": factory}`` whose factory wraps
    with ``backward_passes_per_step=2`` (settings ``load_model`` must keep). Each rank saves its own file.
    """
    keras = tf.keras
    ext = ".h5" if KERAS2 else ".keras"  # each Keras's native file
    x, y = np.ones((2, 3), "float32"), np.zeros((2, 2), "float32")
    found = {}
    for how in ("custom_optimizers", "custom_objects"):
        net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        net.compile(loss="mse", optimizer=hvd.DistributedOptimizer(Custom(learning_rate=0.01)))
        net.train_on_batch(x, y)
        saved = [np.asarray(v).tolist() for v in _optimizer_variables(net.optimizer)]
        path = os.path.join(out_dir, f"rank{hvd.rank()}-{how}{ext}")
        net.save(path)
        if how == "custom_optimizers":
            loaded = hvd.load_model(path, custom_optimizers=[Custom])
        else:
            loaded = hvd.load_model(path, custom_objects={
                "Custom": lambda **kw: hvd.DistributedOptimizer(Custom(**kw), backward_passes_per_step=2)})
        opt = loaded.optimizer
        found[how] = {"class": type(opt).__name__, "custom": isinstance(opt, Custom),
                      "distributed": hasattr(opt, "_rp"), "passes": opt._rp["passes"] if hasattr(opt, "_rp") else None,
                      "lr": float(np.asarray(opt.learning_rate)), "saved": saved,
                      "loaded": [np.asarray(v).tolist() for v in _optimizer_variables(opt)]}
    return found


def _optimizer_variables(opt):
    found = opt.variables
    return list(found() if callable(found) else found)


def main(out_dir):
    hvd.init()
    out = {"rank": hvd.rank(), "size": hvd.size(), "keras2": bool(KERAS2), "kinds": {}}
    for kind, make in optimizers().items():
        got = {"one_step": {}, "aggregate": {}}
        for op in ("average", "sum"):
            for how in ("eager", "function", "tape"):
                got["one_step"][f"{op}-{how}"] = compute_then_apply(make, hvd.Sum if op == "sum" else hvd.Average,
                                                                     how)
        for average in (False, True):
            for in_function in (False, True):
                got["aggregate"][f"{average}-{in_function}"] = aggregate(make, 4, average, 10, in_function)
        got["no_helper"] = hvd.DistributedOptimizer(make())._agg_helper is None
        got["infinite"] = infinite_first_cycle(kind, make)
        out["kinds"][kind] = got
    out["load"] = load_custom(out_dir)
    with open(os.path.join(out_dir, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
