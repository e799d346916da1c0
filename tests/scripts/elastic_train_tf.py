"""The elastic driver's end-to-end program on TensorFlow/Keras (``elastic_train.py``'s twin).

``elastic_train_tf.py OUT_DIR SCENARIO``: full-batch gradient descent with momentum (Keras SGD) on
the 12 rows of ``elastic_train.py``, a Dense(1) layer starting from fixed weights, gradients
averaged by ``DistributedGradientTape``, a commit after every step under ``@hvd.elastic.run`` with
``TensorFlowKerasState``. Every scenario of ``elastic_scenarios.py``, as there, and the same
``step S rank R size N host H state D`` lines (D: a digest of the bytes of the model's and the
optimizer's variables); rank 0 saves the final kernel and bias to ``OUT_DIR/final.json``.
"""

import hashlib
import json
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_scenarios import act  # noqa: E402 (beside this file)

import ringpipe.tensorflow as hvd  # noqa: E402

out_dir, scenario = sys.argv[1], sys.argv[2]
STEPS = int(os.environ.get("ELASTIC_STEPS", "20"))
PAUSE = float(os.environ.get("ELASTIC_PAUSE", "0.15"))
KERNEL0 = np.array([[0.1], [-0.2], [0.3], [0.05]], dtype=np.float32)
BIAS0 = np.array([0.1], dtype=np.float32)

hvd.init()
rng = np.random.default_rng(1)
X = rng.standard_normal((12, 4)).astype(np.float32)
y = X @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype=np.float32)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.layers[0].set_weights([KERNEL0, BIAS0])
optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
optimizer.build(model.trainable_variables)
host = os.environ["HOROVOD_HOSTNAME"]


def digest():
    """The state's bytes: the model's variables, then the optimizer's (iterations, momentum), in order."""
    h = hashlib.sha256()
    for v in [*model.variables, *optimizer.variables]:
        h.update(np.asarray(v.numpy()).tobytes())
    return h.hexdigest()[:16]


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        rank, size = hvd.rank(), hvd.size()
        print(f"step {state.step} rank {rank} size {size} host {host} state {digest()}", flush=True)
        act(hvd, scenario, out_dir, state.step, state)
        rows = np.arange(12)[rank::size]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(X[rows]) - y[rows])) / 12 * size
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        state.step += 1
        time.sleep(PAUSE)
        state.commit()


state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)
train(state)
print(f"done rank {hvd.rank()} size {hvd.size()} host {host}", flush=True)
if hvd.rank() == 0:
    kernel, bias = model.layers[0].get_weights()
    with open(os.path.join(out_dir, "final.json"), "w") as f:
        json.dump({"kernel": kernel.tolist(), "bias": bias.tolist(), "step": state.step}, f)
