"""An elastic Keras ``model.fit`` program for the elastic driver's end-to-end tests (Horovod's Keras recipe).

``elastic_fit_keras.py OUT_DIR [SCENARIO]``: a Dense(1) from fixed weights, compiled with
``hvd.DistributedOptimizer(SGD(0.05, momentum=0.9))`` and mean squared error, trained by
``model.fit`` under ``@hvd.elastic.run`` with ``KerasState`` and Horovod's elastic callbacks
(``CommitStateCallback``, ``UpdateBatchStateCallback``, ``UpdateEpochStateCallback``). Each epoch is
one batch: rank r of n fits rows ``r::n`` of the 12 rows of ``elastic_train.py``, so the averaged
gradient is the full-batch one whatever the world size. ``two_failures`` (the default), as
``elastic_scenarios.py``'s: the worker on 127.0.0.2 raises at the start of epoch 3, the one on
127.0.0.3 is SIGKILLed at the start of epoch 6 (each once). ``grow``: the job starts on 127.0.0.1
alone and rank 0 adds 127.0.0.2 at epoch 2, whose new worker (its optimizer not built yet) gets
the state, momentum included, from rank 0. Every rank prints ``step E rank R size N host H``
at each epoch's start; rank 0 saves the final kernel, bias and epoch to ``OUT_DIR/final.json``.
"""

import json
import os
import signal
import sys
import time

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_scenarios import hold, once, write_hosts  # noqa: E402 (beside this file)

import ringpipe.tensorflow.keras as hvd  # noqa: E402

out_dir = sys.argv[1]
scenario = sys.argv[2] if len(sys.argv) > 2 else "two_failures"
EPOCHS = int(os.environ.get("ELASTIC_STEPS", "20"))
PAUSE = float(os.environ.get("ELASTIC_PAUSE", "0.1"))
KERNEL0 = np.array([[0.1], [-0.2], [0.3], [0.05]], dtype=np.float32)
BIAS0 = np.array([0.1], dtype=np.float32)


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
        if scenario == "two_failures":
            if e == 3 and host == "127.0.0.2" and once(out_dir, "fail-exc"):
                raise ValueError("injected failure on 127.0.0.2")
            if e == 6 and host == "127.0.0.3" and once(out_dir, "fail-kill"):
                os.kill(os.getpid(), signal.SIGKILL)
        elif scenario == "grow" and e == 2 and hvd.size() == 1:
            if once(out_dir, "grow"):
                write_hosts(out_dir, ["127.0.0.1:1", "127.0.0.2:1"])
            hold(self.state)  # until the new worker waits to join (HostsUpdatedInterrupt)

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
