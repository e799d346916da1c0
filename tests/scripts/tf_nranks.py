"""ringpipe.tensorflow's collectives, gradients and training on any number of ranks, gloo or MPI.

Run under ``ringpipe launch -n N`` or ``mpirun -n N`` (``RINGPIPE_BACKEND=mpi``); writes
``rank<R>.json`` into the folder given as argument. Every value is built from the rank and the
size so that the test computes the expected results plainly.
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

GLOBAL_BATCH, STEPS, LR, MOMENTUM = 12, 3, 0.05, 0.9
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64")


def data():
    return regression(GLOBAL_BATCH, STEPS, seed=1)


def shard(a, r, n):
    return rows_of(a, r, n, GLOBAL_BATCH, STEPS)


def model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])


def raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return [isinstance(exc, hvd.HorovodInternalError), str(exc)]
    return None


def collectives(r, n):
    base = np.arange(6, dtype=np.float64).reshape(2, 3) + 10 * r
    result = {}
    for mode in ("eager", "function"):
        wrap = (lambda f: f) if mode == "eager" else tf.function
        res = {}
        for dtype in DTYPES:
            x = tf.cast(tf.constant(base), dtype)
            res[f"sum_{dtype}"] = wrap(lambda x: hvd.allreduce(x, op=hvd.Sum))(x)
            res[f"min_{dtype}"] = wrap(lambda x: hvd.allreduce(x, op=hvd.Min))(x)
            res[f"max_{dtype}"] = wrap(lambda x: hvd.allreduce(x, op=hvd.Max))(x)
            res[f"gather_{dtype}"] = wrap(lambda x: hvd.allgather(x))(x)
            res[f"bcast_{dtype}"] = wrap(lambda x: hvd.broadcast(x, root_rank=n - 1))(x)
        flags = tf.constant([r % 2 == 0, True])
        res["gather_bool"] = wrap(lambda x: hvd.allgather(x))(flags)
        res["bcast_bool"] = wrap(lambda x: hvd.broadcast(x, root_rank=1))(flags)
        x = tf.constant(base)
        res["avg"] = wrap(lambda x: hvd.allreduce(x))(x)
        res["scaled"] = wrap(lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0))(x)
        res["gather_uneven"] = wrap(lambda t: hvd.allgather(t))(tf.fill([r + 1, 2], float(r)))
        splits = tf.constant([(r + j) % 2 + 1 for j in range(n)])
        rows = tf.concat([tf.fill([(r + j) % 2 + 1, 1], float(100 * r + j)) for j in range(n)], 0)
        received, rsplits = wrap(lambda t, s: hvd.alltoall(t, splits=s))(rows, splits)
        res["alltoall"], res["alltoall_splits"] = received, rsplits
        m = 2 * n + 1
        res["rs_sum"] = wrap(lambda t: hvd.reducescatter(t, op=hvd.Sum))(
            tf.reshape(tf.range(1.0, m + 1), [m, 1]) * (r + 1))
        result[mode] = tf.nest.map_structure(lambda t: np.asarray(t, dtype=np.float64).tolist(), res)

    v = tf.constant([1.0, 2.0, 3.0]) * (r + 1)
    w = tf.constant([1.0, 2.0, 3.0]) * (r + 1)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(v)
        ys = {"allreduce_sum": tf.reduce_sum(w * hvd.allreduce(v, op=hvd.Sum)),
              "allreduce_avg": tf.reduce_sum(w * hvd.allreduce(v)),
              "allgather": tf.reduce_sum(tf.tile(w, [n]) * hvd.allgather(v)),
              "broadcast": tf.reduce_sum(w * hvd.broadcast(v, root_rank=0))}
    result["grads"] = {k: tape.gradient(y, v).numpy().tolist() for k, y in ys.items()}

    result["err_shape"] = raised(lambda: hvd.allreduce(tf.ones([r + 1])))
    result["err_root"] = raised(lambda: hvd.broadcast(tf.ones([2]), root_rank=r))
    # the last rank passes a dtype no collective takes: every rank raises (none waits for it)
    result["err_dtype"] = raised(lambda: hvd.allreduce(tf.constant(["a", "b"]) if r == n - 1 else tf.ones([2])))
    result["err_dtype_gather"] = raised(lambda: hvd.allgather(tf.constant(["a"]) if r == n - 1 else tf.ones([1])))
    # the same inside a tf.function: the op runs in the graph, the refusal still reaches every rank
    result["err_dtype_graph"] = raised(lambda: tf.function(lambda t: hvd.allreduce(t))(
        tf.constant(["a", "b"]) if r == n - 1 else tf.ones([2])))
    result["err_dtype_vars"] = raised(lambda: hvd.broadcast_variables(
        [tf.Variable(["a"]) if r == n - 1 else tf.Variable([1.0])], root_rank=0))
    result["after_errors"] = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy().tolist()
    return result


def training(r, n, out_dir):
    x, y = data()
    xs, ys = shard(x, r, n), shard(y, r, n)
    per = GLOBAL_BATCH // n
    out = {}

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
        opt.apply_gradients(zip(grads, net.trainable_variables, strict=True))
        return loss

    for k in range(STEPS):
        step(xs[k * per : (k + 1) * per], ys[k * per : (k + 1) * per])
    out["tape"] = [w.tolist() for w in net.get_weights()]

    net = model(200 + r)
    net.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM)))
    net.fit(xs, ys, batch_size=per, epochs=1, shuffle=False, verbose=0,
            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["fit"] = [w.tolist() for w in net.get_weights()]
    return out


def main(out_dir):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"rank": r, "size": n, "mpi": hvd.mpi_enabled()}
    out.update(collectives(r, n))
    out.update(training(r, n, out_dir))
    hvd.shutdown()
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
