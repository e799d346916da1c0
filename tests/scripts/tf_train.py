"""Training with ringpipe.tensorflow on this rank: a DistributedGradientTape loop in tf.function and a Keras
``fit`` with DistributedOptimizer and Horovod's callbacks, then ``load_model``.

Run under ``ringpipe launch -n 2``; rank ``r`` trains on rows ``[8k + 4r, 8k + 4r + 4)`` of each
global batch ``k`` of :func:`data`; writes ``rank<R>.json`` into the folder given as argument.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf
from tf_problem import regression
from tf_problem import shard as rows_of

import ringpipe.tensorflow.keras as hvd

GLOBAL_BATCH, STEPS, LR, MOMENTUM = 8, 4, 0.05, 0.9


def data():
    return regression(GLOBAL_BATCH, STEPS, seed=0)


def shard(a, r, n):
    return rows_of(a, r, n, GLOBAL_BATCH, STEPS)


def model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])


def main(out_dir):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = data()
    xs, ys = shard(x, r, n), shard(y, r, n)
    per = GLOBAL_BATCH // n
    out = {}

    # 1. GradientTape (seed 002's TensorFlow program): each rank starts from its own weights, rank 0's win
    net = model(100 + r)
    opt = keras.optimizers.SGD(LR, momentum=MOMENTUM)
    opt.build(net.trainable_variables)
    hvd.broadcast_variables(net.variables, root_rank=0)
    hvd.broadcast_variables(opt.variables, root_rank=0)

    @tf.function
    def step(bx, by):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(net(bx) - by))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables, strict=False))
        return loss

    for k in range(STEPS):
        step(xs[k * per : (k + 1) * per], ys[k * per : (k + 1) * per])
    out["tape"] = [w.tolist() for w in net.get_weights()]

    # 2. Keras fit (seed 002's Keras program)
    net = model(200 + r)
    dist = hvd.DistributedOptimizer(keras.optimizers.SGD(LR * n, momentum=MOMENTUM))
    net.compile(loss="mse", optimizer=dist)
    seen = {"lr": [], "raw": [], "averaged": []}

    class Record(keras.callbacks.Callback):
        def __init__(self, key):
            super().__init__()
            self.key = key

        def on_train_batch_begin(self, batch, logs=None):
            if self.key == "lr":
                seen["lr"].append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

        def on_epoch_end(self, epoch, logs=None):
            if self.key != "lr":
                seen[self.key].append(float(logs["loss"]))

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        Record("raw"),
        hvd.callbacks.MetricAverageCallback(),
        Record("averaged"),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR * n, warmup_epochs=1, verbose=1),
        Record("lr"),  # after the warmup: the rate each batch trains with
    ]
    net.fit(xs, ys, batch_size=per, epochs=2, shuffle=False, callbacks=callbacks, verbose=0)
    out["fit"] = [w.tolist() for w in net.get_weights()]
    out["fit_seen"] = seen
    out["optimizer_class"] = [type(net.optimizer).__name__, type(net.optimizer).__module__]

    # 3. load_model re-wraps the optimizer, with its state
    path = os.path.join(out_dir, "model.keras")
    if r == 0:
        net.save(path)
    hvd.barrier()
    loaded = hvd.load_model(path)
    out["loaded"] = {
        "distributed": hasattr(loaded.optimizer, "_rp_setup"),
        "class": type(loaded.optimizer).__name__,
        "iterations": int(loaded.optimizer.iterations.numpy()),
        "same_weights": all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(), net.get_weights(), strict=False)),
    }
    loaded.fit(xs[:per], ys[:per], batch_size=per, epochs=1, shuffle=False, verbose=0)
    out["loaded_after_step"] = [w.tolist() for w in loaded.get_weights()]

    # 4. backward_passes_per_step: gradients summed over 2 calls, reduced and applied on the 2nd
    net = model(300)
    acc = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    for k in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(net(xs[k * per : (k + 1) * per]) - ys[k * per : (k + 1) * per]))
        acc.apply(tape.gradient(loss, net.trainable_variables), net.trainable_variables)
    out["accumulated"] = [w.tolist() for w in net.get_weights()]
    out["accumulated_iterations"] = int(acc.iterations.numpy())
    hvd.shutdown()
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
