"""An elastic Keras ``model.fit`` program for the elastic driver's end-to-end tests (Horovod's Keras recipe).

``elastic_fit_keras.py OUT_DIR``: a Dense(1) from fixed weights, compiled with
``hvd.DistributedOptimizer(SGD(0.05, momentum=0.9))`` and mean squared error, trained by
``model.fit`` under ``@hvd.elastic.run`` with ``KerasState`` and Horovod's elastic callbacks
(``CommitStateCallback``, ``UpdateBatchStateCallback``, ``UpdateEpochStateCallback``). Each epoch is
one batch: rank r of n fits rows ``r::n`` of the 12 rows of ``elastic_train.py``, so the averaged
gradient is the full-batch one whatever the world size. Failures as ``elastic_train.py``'s
``two_failures``: the worker on 127.0.0.2 raises at the start of epoch 3, the one on 127.0.0.3 is
SIGKILLed at the start of epoch 6 (each once). Every rank prints ``step E rank R size N host H``
at each epoch's start; rank 0 saves the final kernel, bias and epoch to ``OUT_DIR/final.json``.
"""

import json
import os
import signal
import sys
import time

import keras
import numpy as np

import ringpipe.tensorflow.keras as hvd

out_dir = sys.argv[1]
EPOCHS = int(os.environ.get("ELASTIC_STEPS", "20"))
PAUSE = float(os.environ.get("ELASTIC_PAUSE", "0.1"))
KERNEL0 = np.array([[0.1], [-0.2], [0.3], [0.05]], dtype=np.float32)
BIAS0 = np.array([0.1], dtype=np.float32)


def once(name):
    try:
        os.close(os.open(os.path.join(out_dir, name), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


hvd.init()
rng = np.random.default_rng(1)
X = rng.standard_normal((12, 4)).astype(np.float32)
y = X @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype=np.float32)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.layers[0].set_weights([KERNEL0, BIAS0])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
host = os.environ["HOROVOD_HOSTNAME"]


class Faults(keras.callbacks.Callback):
    """Print where training is at each epoch's start; fail there as the scenario says."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_begin(self, epoch, logs=None):
        e = self.state.epoch
        print(f"step {e} rank {hvd.rank()} size {hvd.size()} host {host}", flush=True)
        if e == 3 and host == "127.0.0.2" and once("fail-exc"):
            raise ValueError("injected failure on 127.0.0.2")
        if e == 6 and host == "127.0.0.3" and once("fail-kill"):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_end(self, epoch, logs=None):
        time.sleep(PAUSE)


@hvd.elastic.run
def train(state):
    rank, size = hvd.rank(), hvd.size()
    rows = np.arange(12)[rank::size]
    # UpdateEpochStateCallback first: the commit at the epoch's end then holds the new epoch count
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state), Faults(state)]
    model.fit(X[rows], y[rows], batch_size=len(rows), epochs=EPOCHS - state.epoch, shuffle=False,
              callbacks=callbacks, verbose=0)


state = hvd.elastic.KerasState(model, batch=0, epoch=0)
train(state)
print(f"done rank {hvd.rank()} size {hvd.size()} host {host}", flush=True)
if hvd.rank() == 0:
    kernel, bias = model.layers[0].get_weights()
    with open(os.path.join(out_dir, "final.json"), "w") as f:
        json.dump({"kernel": kernel.tolist(), "bias": bias.tolist(), "epoch": state.epoch}, f)
