"""``DistributedOptimizer._compute_gradients`` on a tf-keras (Keras 2) optimizer, as Horovod's Keras tests call it.

Run under ``ringpipe launch -n N`` with ``TF_USE_LEGACY_KERAS=1``; writes ``rank<R>.json`` into the
folder given as argument: this rank's own gradients and what the wrapper returned.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import ringpipe.tensorflow.keras as hvd


def main(out):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    keras = tf.keras  # tf-keras here
    tf.random.set_seed(3)
    model = keras.Sequential([keras.layers.Dense(3, activation="tanh", input_shape=(4,)), keras.layers.Dense(1)])
    rng = np.random.default_rng(200 + r)
    x, y = rng.normal(size=(5, 4)).astype("float32"), rng.normal(size=(5, 1)).astype("float32")
    result = {"rank": r, "size": n, "keras": type(model).__module__}
    for kind, opt in [("new", keras.optimizers.SGD(0.1)), ("legacy", keras.optimizers.legacy.SGD(0.1))]:
        wrapped = hvd.DistributedOptimizer(opt)
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        own = tape.gradient(loss, model.trainable_variables)
        pairs = wrapped._compute_gradients(loss, model.trainable_variables, tape=tape)
        result[kind] = {"own": [g.numpy().tolist() for g in own],
                        "reduced": [g.numpy().tolist() for g, _ in pairs]}
    with open(os.path.join(out, f"rank{r}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
