"""The rest of Horovod's TensorFlow / Keras surface on this rank: graph-time queries, the TF1-style optimizer,
the standalone ``ringpipe.keras`` face with ``BestModelCheckpoint``, and the elastic states and callbacks.

Run under ``ringpipe launch -n N`` or ``mpirun -n N`` (``RINGPIPE_BACKEND=mpi``); writes
``rank<R>.json`` into the folder given as argument. Rank ``r`` trains on rows
``[G k + r G / N, G k + (r + 1) G / N)`` of each global batch ``k`` (``G = GLOBAL_BATCH``).
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf
from tf_problem import raised, regression
from tf_problem import shard as rows_of

import ringpipe.keras as hvd  # Horovod's standalone-Keras import path
import ringpipe.tensorflow as htf

GLOBAL_BATCH, STEPS, LR, MOMENTUM = 12, 3, 0.05, 0.9


def data(seed=2):
    return regression(GLOBAL_BATCH, STEPS, seed)


def shard(a, r, n):
    return rows_of(a, r, n, GLOBAL_BATCH, STEPS)


def model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])


def weights(net):
    return [w.tolist() for w in net.get_weights()]


def queries(r, n):
    out = {}
    ps = hvd.add_process_set([n - 1])
    ps_id = ps.process_set_id
    ids = [0, ps_id, 99]

    @tf.function
    def graph_queries():
        return [htf.size_op(), htf.size_op(process_set_id=ps.process_set_id), htf.rank_op(), htf.local_rank_op(),
                htf.local_size_op()]

    @tf.function
    def graph_included():
        return [htf.process_set_included_op(i) for i in ids]

    out["eager"] = [int(htf.size_op()), int(htf.size_op(ps.process_set_id)), int(htf.rank_op()),
                    int(htf.local_rank_op()), int(htf.local_size_op())] + [int(htf.process_set_included_op(i))
                                                                             for i in ids]
    out["function"] = [int(t) for t in graph_queries()] + [int(t) for t in graph_included()]
    out["local"] = [hvd.local_rank(), hvd.local_size()]
    hvd.remove_process_set(ps)
    out["function_after_remove"] = [int(t) for t in graph_included()]  # the same graph, read when it runs
    error = raised(graph_queries) or ["", ""]
    out["size_after_remove"] = [error[0], f"process set id {ps_id} is unknown" in error[1]]
    out["bobj_fn"] = htf.broadcast_object_fn(root_rank=n - 1)({"from": r})
    return out


def legacy(r, n):
    """tf.compat.v1 MomentumOptimizer under htf.DistributedOptimizer, minimize in tf.function."""
    x, y = data(3)
    xs, ys = shard(x, r, n), shard(y, r, n)
    per = GLOBAL_BATCH // n
    w = tf.Variable(np.full((4, 1), 0.1, dtype="float64"))
    b = tf.Variable(np.zeros((1,), dtype="float64"))
    opt = htf.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(LR, MOMENTUM))

    @tf.function
    def step(bx, by):
        opt.minimize(lambda: tf.reduce_mean(tf.square(bx @ w + b - by)), var_list=[w, b])

    for k in range(STEPS):
        step(xs[k * per : (k + 1) * per].astype("float64"), ys[k * per : (k + 1) * per].astype("float64"))
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    errors = {
        "adasum": raised(lambda: htf.DistributedOptimizer(sgd, op=htf.Adasum)),
        "passes": raised(lambda: htf.DistributedOptimizer(sgd, backward_passes_per_step=2)),
        "predivide": raised(lambda: htf.DistributedOptimizer(sgd, op=htf.Sum, gradient_predivide_factor=2.0)),
        "keras_adasum": raised(lambda: htf.DistributedOptimizer(keras.optimizers.SGD(0.1), op=htf.Adasum)),
    }
    keras_opt = htf.DistributedOptimizer(keras.optimizers.Adam(0.01))
    return {"w": w.numpy().tolist(), "b": b.numpy().tolist(), "name": opt.get_name(),
            "slots": opt.get_slot_names(), "errors": errors,
            "keras_through_tf": [type(keras_opt).__name__, isinstance(keras_opt, keras.optimizers.Adam)]}


def keras_face(r, n, out_dir):
    """Seed 002's Keras program with only the import changed, plus BestModelCheckpoint and the wrapper's class."""
    x, y = data(4)
    xs, ys = shard(x, r, n), shard(y, r, n)
    xv, yv = data(5)
    per = GLOBAL_BATCH // n
    out = {}
    adam = keras.optimizers.Adam(0.01)
    dist = hvd.DistributedOptimizer(adam)
    out["wrapper"] = {"name": type(dist).__name__, "module": type(dist).__module__ == type(adam).__module__,
                      "isinstance": isinstance(dist, keras.optimizers.Adam),
                      "config": dist.get_config() == adam.get_config()}

    net = model(400 + r)
    net.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)))
    seen = {"weights": [], "val_loss": []}

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen["weights"].append(weights(self.model))
            seen["val_loss"].append(float(logs["val_loss"]))

    path = os.path.join(out_dir, f"best{r}.keras")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(), Record(),
                 hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=path)]
    # validation targets of the opposite sign: the best validation loss comes before the last epoch
    net.fit(xs, ys, batch_size=per, epochs=4, shuffle=False, verbose=0, validation_data=(xv[:12], -yv[:12]),
            callbacks=callbacks)
    out["fit"], out["seen"] = weights(net), seen
    best = keras.models.load_model(path)  # plain Keras: the wrapper's class names the wrapped one
    out["best"] = weights(best)
    out["best_optimizer"] = [type(best.optimizer).__name__, type(best.optimizer) is keras.optimizers.SGD]
    out["best_errors"] = {
        "no_path": raised(lambda: net.fit(xs[:per], ys[:per], epochs=1, verbose=0,
                                          callbacks=[hvd.callbacks.BestModelCheckpoint(monitor="loss")])),
        "weights_ext": raised(lambda: hvd.callbacks.BestModelCheckpoint(save_weights_only=True, filepath="b.keras")),
    }
    return out


def elastic(r, n):
    x, y = data(6)
    xs, ys = shard(x, r, n), shard(y, r, n)
    per = GLOBAL_BATCH // n
    out = {}

    # commit / restore / sync of a Keras model and optimizer, and of plain variables
    net = model(600 + r)
    opt = keras.optimizers.SGD(LR, momentum=MOMENTUM)
    opt.build(net.trainable_variables)
    state = hvd.elastic.KerasState(net, opt, epoch=0, batch=0)
    state.sync()
    out["synced"] = weights(net)

    @tf.function
    def step(bx, by):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(net(bx) - by))
        grads = htf.DistributedGradientTape(tape).gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables, strict=True))

    state.commit()
    step(xs[:per], ys[:per])
    state.epoch = 7
    moved = weights(net)
    state.restore()
    out["restored"] = [weights(net) == out["synced"], moved != out["synced"], state.epoch,
                       int(opt.iterations.numpy())]

    v = tf.Variable([float(r), 1.0])
    tstate = htf.elastic.TensorFlowState([v], counter=r)
    tstate.sync()
    out["tf_state"] = [v.numpy().tolist(), tstate.counter]
    v.assign([5.0, 5.0])
    tstate.counter = 9
    tstate.restore()
    out["tf_state_restored"] = [v.numpy().tolist(), tstate.counter]

    # the Keras callbacks: commits every 2 batches and at each epoch's end, state.batch / state.epoch kept
    net3 = model(800)
    net3.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)))
    commits = []

    class Counting(hvd.elastic.KerasState):
        def commit(self):
            commits.append([self.epoch, self.batch])
            super().commit()

    state3 = Counting(net3, epoch=0, batch=0)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(["batch", state3.batch])

        def on_epoch_end(self, epoch, logs=None):
            seen.append(["epoch", state3.epoch, state3.batch])

    net3.fit(xs, ys, batch_size=per, epochs=2, shuffle=False, verbose=0,
             callbacks=[hvd.elastic.UpdateBatchStateCallback(state3), hvd.elastic.UpdateEpochStateCallback(state3),
                        Record(), hvd.elastic.CommitStateCallback(state3, batches_per_commit=2)])
    out["callbacks"] = {"commits": commits, "seen": seen}
    return out


def main(out_dir):
    out = {"before_init": [int(htf.process_set_included_op()), raised(lambda: htf.size_op())]}
    hvd.init(process_sets="dynamic")
    r, n = hvd.rank(), hvd.size()
    out.update(rank=r, size=n, mpi=hvd.mpi_enabled())
    out["queries"] = queries(r, n)
    out["legacy"] = legacy(r, n)
    out["keras"] = keras_face(r, n, out_dir)
    out["elastic"] = elastic(r, n)
    hvd.shutdown()
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
