"""Keras 2 (tf-keras, ``TF_USE_LEGACY_KERAS=1``) training with ringpipe.tensorflow.keras on this rank.

Run under ``ringpipe launch -n 2`` with ``TF_USE_LEGACY_KERAS=1``; rank ``r`` trains on rows
``[8k + 4r, 8k + 4r + 4)`` of each global batch ``k`` of :func:`data`, starting from its own
weights :func:`initial` ``(seed + r)`` (rank 0's win the broadcast). Writes ``rank<R>.json``
into the folder given as argument.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf
from tf_problem import regression, sync_bn_case
from tf_problem import shard as rows_of

import ringpipe.tensorflow.keras as hvd

GLOBAL_BATCH, STEPS, LR, MOMENTUM = 8, 4, 0.05, 0.9
keras = tf.keras


def data():
    return regression(GLOBAL_BATCH, STEPS, seed=0)


def initial(seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=0.5, size=s).astype("float32") for s in ((4, 3), (3,), (3, 1), (1,))]


def shard(a, r, n):
    return rows_of(a, r, n, GLOBAL_BATCH, STEPS)


def model(seed):
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    net.set_weights(initial(seed))
    return net


def weights(net):
    return [w.tolist() for w in net.get_weights()]


class Record(keras.callbacks.Callback):
    def __init__(self, seen, key):
        super().__init__()
        self.seen, self.key = seen, key

    def on_train_batch_begin(self, batch, logs=None):
        if self.key == "lr":
            self.seen["lr"].append(float(tf.keras.backend.get_value(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        if self.key != "lr":
            self.seen[self.key].append(float(logs["loss"]))


def fit_with_callbacks(base, seed, xs, ys, per, n):
    """Seed 002's Keras program: DistributedOptimizer, broadcast, metric average, warmup (1 of 2 epochs)."""
    net = model(seed)
    net.compile(loss="mse", optimizer=hvd.DistributedOptimizer(base))
    seen = {"lr": [], "raw": [], "averaged": []}
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        Record(seen, "raw"),
        hvd.callbacks.MetricAverageCallback(),
        Record(seen, "averaged"),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR * n, warmup_epochs=1, verbose=1),
        Record(seen, "lr"),  # after the warmup: the rate each batch trains with
    ]
    net.fit(xs, ys, batch_size=per, epochs=2, shuffle=False, callbacks=callbacks, verbose=0)
    return net, {"weights": weights(net), "seen": seen, "class": [type(net.optimizer).__name__,
                                                                    type(net.optimizer).__module__]}


BN_BOUNDS = [0, 3, 8]  # SyncBatchNormalization: rank r normalises rows BN_BOUNDS[r]:BN_BOUNDS[r + 1]


def sync_bn(r, shape, seed, compiled):
    """tf-keras SyncBatchNormalization on this rank's rows: outputs, gradients of sum(out * c), moving statistics."""
    return sync_bn_case(hvd.SyncBatchNormalization(momentum=0.9, epsilon=1e-3), BN_BOUNDS, r, shape, seed, compiled)


def main(out_dir):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = data()
    xs, ys = shard(x, r, n), shard(y, r, n)
    per = GLOBAL_BATCH // n
    out = {"rank": r, "size": n, "keras2": hvd.KERAS2, "keras": keras.__name__}

    # 1. fit with tf-keras's SGD, and with tf.keras.optimizers.legacy's
    net, out["fit"] = fit_with_callbacks(keras.optimizers.SGD(LR * n, momentum=MOMENTUM), 200 + r, xs, ys, per, n)
    legacy_net, out["fit_legacy"] = fit_with_callbacks(keras.optimizers.legacy.SGD(LR * n, momentum=MOMENTUM),
                                                       400 + r, xs, ys, per, n)

    # 2. load_model re-wraps the optimizer, with its state (native format; HDF5 with legacy_opts)
    path, legacy_path = os.path.join(out_dir, "model.keras"), os.path.join(out_dir, "legacy.h5")
    if r == 0:
        net.save(path)
        legacy_net.save(legacy_path)
    hvd.barrier()
    out["loaded"] = {}
    for key, p, legacy, saved in (("new", path, False, net), ("legacy", legacy_path, True, legacy_net)):
        loaded = hvd.load_model(p, legacy_opts=legacy)
        out["loaded"][key] = {
            "distributed": hasattr(loaded.optimizer, "_rp_setup"),
            "class": type(loaded.optimizer).__name__,
            "iterations": int(loaded.optimizer.iterations.numpy()),
            "same_weights": all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(), saved.get_weights(), strict=True)),
        }
    loaded = hvd.load_model(path)
    loaded.fit(xs[:per], ys[:per], batch_size=per, epochs=1, shuffle=False, verbose=0)
    out["loaded_after_step"] = weights(loaded)

    # 3. backward_passes_per_step in fit: gradients summed over 2 steps, reduced and applied on the 2nd
    for key, base in (("accumulated", keras.optimizers.SGD(LR)), ("accumulated_legacy", keras.optimizers.legacy.SGD(LR))):
        acc_net = model(300)
        acc = hvd.DistributedOptimizer(base, backward_passes_per_step=2, average_aggregated_gradients=True)
        acc_net.compile(loss="mse", optimizer=acc)
        acc_net.fit(xs, ys, batch_size=per, epochs=1, shuffle=False, verbose=0)
        out[key] = {"weights": weights(acc_net), "iterations": int(acc.iterations.numpy())}

    # 4. broadcast_global_variables names the model in eager Keras
    other = model(500 + r)
    hvd.broadcast_global_variables(1, model=other)
    out["broadcast_global_variables"] = weights(other)
    try:
        hvd.broadcast_global_variables(0)
        out["broadcast_without_model"] = "no error"
    except ValueError as exc:
        out["broadcast_without_model"] = str(exc)
    # 5. LearningRateScheduleCallback (staircase, x0.5 per epoch from epoch 1) and BestModelCheckpoint
    sched_net = model(600)
    sched_net.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(LR, momentum=MOMENTUM)))
    seen = {"lr": []}
    best = os.path.join(out_dir, f"best{r}.h5")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.LearningRateScheduleCallback(initial_lr=LR, multiplier=0.5, start_epoch=1),
                 Record(seen, "lr"), hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=best)]
    sched_net.fit(xs, ys, batch_size=per, epochs=3, shuffle=False, callbacks=callbacks, verbose=0)
    out["schedule"] = {"lr": seen["lr"], "best_saved": os.path.exists(best)}
    import ringpipe.keras as standalone  # Horovod's horovod.keras path serves the same Keras

    out["ringpipe_keras_callbacks"] = standalone.callbacks.MetricAverageCallback.__mro__[1].__module__

    # 6. SyncBatchNormalization is a tf-keras layer here
    out["sync_bn"] = {f"{name}-{'function' if compiled else 'eager'}": sync_bn(r, shape, seed, compiled)
                      for name, shape, seed in (("2d", (3,), 10), ("4d", (2, 2, 3), 20)) for compiled in (False, True)}
    hvd.shutdown()
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
