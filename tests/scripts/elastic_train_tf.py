"""The elastic driver's end-to-end program on TensorFlow/Keras (``elastic_train.py``'s twin).

``elastic_train_tf.py OUT_DIR SCENARIO``: full-batch gradient descent with momentum (Keras SGD) on
the 12 rows of ``elastic_train.py``, a Dense(1) layer starting from fixed weights, gradients
averaged by ``DistributedGradientTape``, a commit after every step under ``@hvd.elastic.run`` with
``TensorFlowKerasState``. Scenarios ``grow_shrink`` and ``two_failures`` as there; rank 0 saves
the final kernel and bias to ``OUT_DIR/final.json``.
"""

import json
import os
import signal
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import ringpipe.tensorflow as hvd

out_dir, scenario = sys.argv[1], sys.argv[2]
STEPS = int(os.environ.get("ELASTIC_STEPS", "20"))
PAUSE = float(os.environ.get("ELASTIC_PAUSE", "0.15"))
KERNEL0 = np.array([[0.1], [-0.2], [0.3], [0.05]], dtype=np.float32)
BIAS0 = np.array([0.1], dtype=np.float32)


def once(name):
    try:
        os.close(os.open(os.path.join(out_dir, name), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def write_hosts(lines):
    tmp = os.path.join(out_dir, "hosts.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, os.path.join(out_dir, "hosts"))


hvd.init()
rng = np.random.default_rng(1)
X = rng.standard_normal((12, 4)).astype(np.float32)
y = X @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype=np.float32)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.layers[0].set_weights([KERNEL0, BIAS0])
optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
optimizer.build(model.trainable_variables)
host = os.environ["HOROVOD_HOSTNAME"]


def hold(state):
    """Every rank: wait at this step for the driver's next world (HostsUpdatedInterrupt), 60 s at most."""
    for _ in range(300):
        time.sleep(0.2)
        state.check_host_updates()


def act(step, state):
    rank, size = hvd.rank(), hvd.size()
    if scenario == "grow_shrink":
        if size == 2 and step == 2:
            if rank == 0 and once("grow"):
                write_hosts(["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"])
            hold(state)  # until the new workers joined
        elif size == 4:
            if rank == 0 and once("shrink"):
                write_hosts(["127.0.0.3:1", "127.0.0.4:1"])
            hold(state)  # until the hosts of ranks 0 and 1 are gone
    elif scenario == "two_failures":
        if step == 3 and host == "127.0.0.2" and once("fail-exc"):
            raise ValueError("injected failure on 127.0.0.2")
        if step == 6 and host == "127.0.0.3" and once("fail-kill"):
            os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        rank, size = hvd.rank(), hvd.size()
        print(f"step {state.step} rank {rank} size {size} host {host}", flush=True)
        act(state.step, state)
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
