"""Every ringpipe.tensorflow collective on this rank, eager and inside tf.function, with gradients and errors.

Run under ``ringpipe launch -n 2``; writes ``rank<R>.json`` into the folder given as argument.
The values are written so that the test can compute every expected result plainly.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import ringpipe.tensorflow as hvd


def raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return [type(exc).__name__, isinstance(exc, hvd.HorovodInternalError), str(exc),
                isinstance(exc, tf.errors.FailedPreconditionError)]
    return None


def kinds(fn):
    """Which of Horovod's error classes what ``fn`` raised is (ValueError, InvalidArgumentError), and its text."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return [isinstance(exc, ValueError), isinstance(exc, tf.errors.InvalidArgumentError), str(exc)]
    return None


def main(out_dir):
    hvd.init(process_sets="dynamic")
    r, n = hvd.rank(), hvd.size()
    out = {"rank": r, "size": n, "local": [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()],
           "initialized": hvd.is_initialized(), "gloo_built": hvd.gloo_built()}
    base = np.arange(6, dtype=np.float64).reshape(2, 3) + 10 * r
    for mode in ("eager", "function"):
        wrap = (lambda f: f) if mode == "eager" else tf.function
        res = {}
        for dtype in ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8"):
            x = tf.cast(tf.constant(base), dtype)
            res[f"sum_{dtype}"] = wrap(lambda x: hvd.allreduce(x, op=hvd.Sum))(x)
            res[f"max_{dtype}"] = wrap(lambda x: hvd.allreduce(x, op=hvd.Max))(x)
            res[f"gather_{dtype}"] = wrap(lambda x: hvd.allgather(x))(x)
            res[f"bcast_{dtype}"] = wrap(lambda x: hvd.broadcast(x, root_rank=1))(x)
        x = tf.constant(base)
        res["avg"] = wrap(lambda x: hvd.allreduce(x))(x)
        res["average_false"] = wrap(lambda x: hvd.allreduce(x, average=False))(x)
        res["min"] = wrap(lambda x: hvd.allreduce(x, op=hvd.Min))(x)
        res["prod"] = wrap(lambda x: hvd.allreduce(x, op=hvd.Product))(x)
        res["scaled"] = wrap(lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0))(x)
        res["fp16"] = wrap(lambda x: hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16))(x)
        res["grouped"] = wrap(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum))(x, tf.cast(x[0], tf.float32))
        res["gather_uneven"] = wrap(lambda t: hvd.allgather(t))(tf.fill([r + 1, 2], float(r)))
        res["grouped_gather"] = wrap(lambda a, b: hvd.grouped_allgather([a, b]))(x, x[:1])
        splits = tf.constant([1, 2] if r == 0 else [2, 1])
        res["alltoall"] = wrap(lambda t, s: hvd.alltoall(t, splits=s))(tf.constant([[1.0], [2.0], [3.0]]) + 10 * r,
                                                                       splits)
        res["alltoall_even"] = wrap(lambda t: hvd.alltoall(t))(tf.constant([1.0, 2.0]) + 10 * r)
        res["rs_sum"] = wrap(lambda t: hvd.reducescatter(t, op=hvd.Sum))(tf.constant([[1.0], [2.0], [3.0]]) * (r + 1))
        res["rs_avg"] = wrap(lambda t: hvd.reducescatter(t))(tf.constant([[1.0], [2.0]]) * (r + 1))
        res["grouped_rs"] = wrap(lambda t: hvd.grouped_reducescatter([t, 2 * t], op=hvd.Sum))(tf.constant([1.0, 2.0]))
        out[mode] = tf.nest.map_structure(lambda t: np.asarray(t, dtype=np.float64).tolist(), res)

    # Compression on TF tensors: compress -> (tensor, ctx), decompress(tensor, ctx)
    comp = {}
    for cname in ("none", "fp16"):
        c = getattr(hvd.Compression, cname)
        for dtype in ("float64", "float32", "float16", "int32", "bool"):
            t = tf.ones([3], dtype)
            packed, ctx = c.compress(t)
            back = c.decompress(packed, ctx)
            comp[f"{cname}_{dtype}"] = [packed.dtype.name, None if ctx is None else tf.as_dtype(ctx).name,
                                        back.dtype.name, np.asarray(back, np.float64).tolist()]
    out["compression"] = comp

    # IndexedSlices: Horovod allgathers values and indices (Average divides by the size)
    sl = tf.IndexedSlices(tf.constant([[1.0, 2.0]]) * (r + 1), tf.constant([r]), tf.constant([2, 2]))
    got = hvd.allreduce(sl)
    out["slices"] = [got.values.numpy().tolist(), got.indices.numpy().tolist()]
    # ops an IndexedSlices cannot take raise NotImplementedError before anything is communicated,
    # also when the list mixes it with dense tensors (which alone could be reduced)
    mixed = [sl, tf.ones([1], tf.int32)]
    out["slices_ops"] = {str(op): raised(lambda op=op: hvd.grouped_allreduce(mixed, op=op))
                         for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum)}
    out["slices_scaled"] = raised(lambda: hvd.grouped_allreduce(mixed, op=hvd.Sum, prescale_factor=2.0))
    out["after_slices"] = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy().tolist()

    # gradients, eager and in tf.function
    def grads(v):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(v)
            w = tf.constant([1.0, 2.0, 3.0]) * (r + 1)
            ys = {
                "allreduce_sum": tf.reduce_sum(w * hvd.allreduce(v, op=hvd.Sum)),
                "allreduce_avg": tf.reduce_sum(w * hvd.allreduce(v)),
                "allgather": tf.reduce_sum(tf.tile(w, [2]) * hvd.allgather(v)),
                "broadcast": tf.reduce_sum(w * hvd.broadcast(v, root_rank=0)),
                "reducescatter_sum": tf.reduce_sum(w[:2] * hvd.reducescatter(tf.reshape(v[:2] * 0 + v[:2], [2]),
                                                                             op=hvd.Sum)[:1]),
                "alltoall": tf.reduce_sum(w[:2] * hvd.alltoall(v[:2])),
            }
        return {k: tape.gradient(y, v) for k, y in ys.items()}

    v = tf.constant([1.0, 2.0, 3.0]) * (r + 1)
    out["grads_eager"] = {k: g.numpy().tolist() for k, g in grads(v).items()}
    out["grads_function"] = {k: g.numpy().tolist() for k, g in tf.function(grads)(v).items()}

    # alltoall without splits when ranks hold different dim 0 (rank r: 2 (r + 1) rows, r + 1 to each rank):
    # the gradient of sum(received * (1, 2, 3, ...)) goes back by what each rank sent
    def even_alltoall_grad(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = hvd.alltoall(t)
            loss = tf.reduce_sum(y * tf.cast(tf.range(tf.shape(y)[0]) + 1, t.dtype))
        return tape.gradient(loss, t)

    rows = tf.ones([2 * (r + 1)], tf.float64)
    out["alltoall_even_grad"] = [even_alltoall_grad(rows).numpy().tolist(),
                                 tf.function(even_alltoall_grad)(rows).numpy().tolist()]

    # broadcast_variables, broadcast_ (in place), objects, barrier, join
    var = tf.Variable([1.0, 2.0] if r == 0 else [5.0, 6.0])
    ivar = tf.Variable([r, r], dtype=tf.int64)
    hvd.broadcast_variables([var, ivar], root_rank=0)
    out["bvars"] = [var.numpy().tolist(), ivar.numpy().tolist()]
    var2 = tf.Variable([float(r)])
    hvd.broadcast_([var2], root_rank=1)
    out["binplace"] = var2.numpy().tolist()
    out["bobj"] = hvd.broadcast_object({"from": r}, root_rank=1)
    out["gobj"] = hvd.allgather_object(("r", r))
    hvd.barrier()

    # process sets: the same ProcessSet objects as the torch face
    solo = hvd.add_process_set([1])
    if r == 1:
        out["set_sum"] = hvd.allreduce(tf.constant([7.0]), op=hvd.Sum, process_set=solo).numpy().tolist()
    else:
        out["set_foreign"] = raised(lambda: hvd.allreduce(tf.constant([7.0]), process_set=solo))
        out["set_foreign_kinds"] = kinds(lambda: hvd.allreduce(tf.constant([7.0]), process_set=solo))
        out["set_foreign_in_function"] = kinds(
            tf.function(lambda: hvd.allreduce(tf.constant([7.0]), process_set=solo)))
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 10  # never registered
    out["set_unknown_in_function"] = kinds(tf.function(lambda: hvd.allreduce(tf.constant([1.0]), process_set=fake)))
    x = tf.constant(float(r + 1))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = x * x
    # Horovod: on a rank outside the set, or in a set of one, the gradients stay local
    out["tape_set_of_one"] = float(hvd.DistributedGradientTape(tape, process_set=solo).gradient(y, [x])[0])
    hvd.barrier()

    # mismatched calls: every rank raises, nothing hangs
    out["err_shape"] = raised(lambda: hvd.allreduce(tf.zeros([2 + r])))
    out["err_dtype"] = raised(lambda: hvd.allgather(tf.zeros([2], tf.float32 if r == 0 else tf.float64)))
    out["err_root"] = raised(lambda: hvd.broadcast(tf.zeros([2]), root_rank=r))
    out["err_op"] = raised(lambda: hvd.allreduce(tf.zeros([2]), op=hvd.Sum if r == 0 else hvd.Max))
    out["err_in_function"] = raised(lambda: tf.function(lambda t: hvd.allreduce(t))(tf.zeros([2 + r])))
    out["err_root_in_function"] = raised(lambda: tf.function(lambda t: hvd.broadcast(t, root_rank=r))(tf.zeros([2])))
    out["err_bad_root_in_function"] = raised(lambda: tf.function(lambda t: hvd.broadcast(t, root_rank=n))(
        tf.zeros([2])))
    out["err_splits_in_function"] = raised(lambda: tf.function(lambda t: hvd.alltoall(t, splits=[2, 2]))(
        tf.zeros([3])))
    with tf.Graph().as_default():  # a TF1 graph run by a session, as Horovod's graph-mode tests run it
        shape_op = hvd.allreduce(tf.zeros([2, 2 + r]))
        dtype_op = hvd.allgather(tf.zeros([2], tf.float32 if r == 0 else tf.int32))
        bad_root_op = hvd.broadcast(tf.zeros([2]), root_rank=n)
        ok_op = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
        with tf.compat.v1.Session() as sess:
            out["err_shape_in_session"] = raised(lambda: sess.run(shape_op))
            out["err_dtype_in_session"] = raised(lambda: sess.run(dtype_op))
            out["err_bad_root_in_session"] = raised(lambda: sess.run(bad_root_op))
            out["ok_in_session"] = sess.run(ok_op).tolist()

    # TF1 sessions: collectives built then run together keep their order; so do collectives built and
    # run one at a time and then fetched together (all of the same shape and dtype: a swap would not raise)
    with tf.Graph().as_default():
        x = tf.constant([1.0 + r])
        together = [hvd.allreduce(x, op=hvd.Sum), hvd.allreduce(10 * x, op=hvd.Sum)]
        with tf.compat.v1.Session() as sess:
            out["session_together"] = [[v.tolist() for v in sess.run(together)] for _ in range(3)]
            built, steps = [], []
            for k in range(4):
                built.append(hvd.allreduce(x * (k + 1), op=hvd.Sum))
                sess.run(built[-1])
                steps.append([v.tolist() for v in sess.run(built)])
            out["session_built_between_runs"] = steps
    out["after_errors"] = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy().tolist()
    out["join"] = int(hvd.join())
    hvd.shutdown()
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
