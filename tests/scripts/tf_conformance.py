"""Horovod's Keras model-parallel options on this rank: ``BroadcastGlobalVariablesCallback(local_variables=...)``
and ``horovod.keras``'s ``PartialDistributedOptimizer(local_layers=...)``; uint16 tensors through allgather,
broadcast and alltoall.

Run under ``ringpipe launch -n N``; writes ``rank<R>.json`` into the folder given as argument
with what the test checks against rules written in the test.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf
from tf_problem import raised

import ringpipe.keras as hvd  # Horovod's standalone-Keras import path
import ringpipe.tensorflow.keras as tfk

LR = 0.5


def broadcast_with_local_variables(r, n):
    """Every variable starts at the rank's number; the first layer's are local, the rest come from the last rank."""
    init = keras.initializers.Constant(float(r))
    model = keras.Sequential([keras.Input((3,)),
                              keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init, trainable=False),
                              keras.layers.Dense(2, kernel_initializer=init, bias_initializer=init, trainable=False)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1))
    local = list(model.layers[0].variables)
    cb = tfk.callbacks.BroadcastGlobalVariablesCallback(root_rank=n - 1, local_variables=local)
    model.fit(np.ones((2, 3), "float32"), np.ones((2, 2), "float32"), batch_size=2, epochs=1, verbose=0,
              callbacks=[cb])
    return {"local": [v.numpy().tolist() for v in model.layers[0].variables],
            "shared": [v.numpy().tolist() for v in model.layers[1].variables],
            "bad_local": raised(lambda: tfk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[1.0]))}


def partial_step(r, n, scale_local_gradients):
    """One SGD step of a wrapped optimizer on this rank's own gradients; the first layer is local."""
    keras.utils.set_random_seed(7)  # the same starting weights on every rank
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    rng = np.random.default_rng(100 + r)  # this rank's own data
    x, y = rng.normal(size=(5, 4)).astype("float32"), rng.normal(size=(5, 1)).astype("float32")
    before = [v.numpy().tolist() for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=model.layers[0],
                                          scale_local_gradients=scale_local_gradients)
    opt.apply(grads, model.trainable_variables)
    return {"before": before, "grads": [g.numpy().tolist() for g in grads],
            "after": [v.numpy().tolist() for v in model.trainable_variables]}


def uint16_collectives(r, n):
    """uint16 values above int16's range (60000 + rank) through the data-moving collectives, eager and in a graph."""
    x = tf.constant(np.full((2, 3), 60000 + r, np.uint16))
    gather_fn = tf.function(lambda t: tfk.allgather(t))
    return {"allgather": tfk.allgather(x).numpy().tolist(), "allgather_fn": gather_fn(x).numpy().tolist(),
            "broadcast": tfk.broadcast(x, n - 1).numpy().tolist(),
            "alltoall": tfk.alltoall(tf.constant(np.arange(2 * n, dtype=np.uint16) + 60000 + 10 * r)).numpy().tolist(),
            "dtypes": sorted({tfk.allgather(x).dtype.name, tfk.broadcast(x, 0).dtype.name})}


def main(out):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    result = {"rank": r, "size": n,
              "broadcast": broadcast_with_local_variables(r, n),
              "partial_scaled": partial_step(r, n, True),
              "partial_unscaled": partial_step(r, n, False),
              "bad_layers": raised(lambda: hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                                                           local_layers=["dense"])),
              "exported": "PartialDistributedOptimizer" in hvd.__all__,
              "uint16": uint16_collectives(r, n)}
    with open(os.path.join(out, f"rank{r}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
