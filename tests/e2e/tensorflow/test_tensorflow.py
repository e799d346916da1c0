"""``ringpipe.tensorflow`` and ``ringpipe.tensorflow.keras`` hold Horovod's TensorFlow / Keras semantics on real processes.

Two ranks run a script under ``ringpipe launch``; the expected values are written here: the
collectives from the inputs each rank used, the gradients from Horovod's gradient definitions
(``horovod/tensorflow/mpi_ops.py``), training from one process on the global batch (plain
TensorFlow gradients and the SGD update written out), the warmup rate from Horovod's formula.
Skipped without TensorFlow (``pip install 'ringpipe[tensorflow]'``).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from scripts.tf_problem import regression  # noqa: E402
from tf_ranks import assert_close, horovod_warmup_lr, keras_sgd, mse_grad  # noqa: E402


@pytest.fixture(scope="module")
def collectives(tf_jobs):
    return tf_jobs.results("tf_collectives.py", 2)


@pytest.fixture(scope="module")
def training(tf_jobs):
    return tf_jobs.results("tf_train.py", 2)


def test_ranks_and_import_do_not_need_tensorflow_in_ringpipe(collectives):
    assert [c["rank"] for c in collectives] == [0, 1] and {c["size"] for c in collectives} == {2}
    assert [c["local"] for c in collectives] == [[0, 2, 0, 1], [1, 2, 0, 1]]
    out = subprocess.run([sys.executable, "-c", "import ringpipe, sys; print('tensorflow' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_every_collective_eager_and_in_tf_function(collectives, mode):
    base = [np.arange(6, dtype=np.float64).reshape(2, 3) + 10 * r for r in range(2)]
    for r, c in enumerate(collectives):
        got = {k: np.array(v, dtype=object) if k in ("alltoall", "grouped", "grouped_gather", "grouped_rs") else
               np.array(v) for k, v in c[mode].items()}
        for dtype in ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8"):
            np.testing.assert_array_equal(got[f"sum_{dtype}"], base[0] + base[1], err_msg=dtype)
            np.testing.assert_array_equal(got[f"max_{dtype}"], np.maximum(base[0], base[1]), err_msg=dtype)
            np.testing.assert_array_equal(got[f"gather_{dtype}"], np.concatenate(base), err_msg=dtype)
            np.testing.assert_array_equal(got[f"bcast_{dtype}"], base[1], err_msg=dtype)
        np.testing.assert_allclose(got["avg"], (base[0] + base[1]) / 2)
        np.testing.assert_allclose(got["average_false"], base[0] + base[1])
        np.testing.assert_allclose(got["min"], np.minimum(base[0], base[1]))
        np.testing.assert_allclose(got["prod"], base[0] * base[1])
        np.testing.assert_allclose(got["scaled"], 3.0 * (0.5 * base[0] + 0.5 * base[1]))
        np.testing.assert_allclose(got["fp16"], base[0] + base[1])
        np.testing.assert_allclose(np.array(c[mode]["grouped"][0]), base[0] + base[1])
        np.testing.assert_allclose(np.array(c[mode]["grouped"][1]), base[0][0] + base[1][0])
        np.testing.assert_allclose(got["gather_uneven"], [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
        np.testing.assert_allclose(np.array(c[mode]["grouped_gather"][1]), [base[0][0], base[1][0]])
        # alltoall: rank 0 sends 1 row to rank 0 and 2 to rank 1; rank 1 sends 2 rows to rank 0 and 1 to rank 1
        rows = [[1.0, 2.0, 3.0], [11.0, 12.0, 13.0]]
        mine = [rows[0][:1], rows[1][:2]] if r == 0 else [rows[0][1:], rows[1][2:]]
        received, splits = c[mode]["alltoall"]
        assert [v[0] for v in received] == mine[0] + mine[1] and splits == [len(mine[0]), len(mine[1])]
        assert c[mode]["alltoall_even"] == [1.0 + r, 11.0 + r]
        # reduce-scatter: Horovod's split (the first n % size ranks get one more row), Average by default
        assert c[mode]["rs_sum"] == ([[3.0], [6.0]] if r == 0 else [[9.0]])
        assert c[mode]["rs_avg"] == [[1.5 * (r + 1)]]
        assert c[mode]["grouped_rs"] == [[2.0 * (r + 1)], [4.0 * (r + 1)]]


def test_indexed_slices_are_allgathered_and_averaged_by_size(collectives):
    for c in collectives:
        assert c["slices"] == [[[0.5, 1.0], [1.0, 2.0]], [0, 1]]


def test_indexed_slices_refuse_other_ops_before_communicating(collectives):
    # Horovod: only Sum and Average, no scale factors, for tf.IndexedSlices (NotImplementedError)
    for c in collectives:
        assert len(c["slices_ops"]) == 4
        for got in [*c["slices_ops"].values(), c["slices_scaled"]]:
            assert got is not None and got[0] == "NotImplementedError", got
        assert c["after_slices"] == [2.0]  # nothing was communicated: the ranks are still in step


@pytest.mark.parametrize("mode", ["grads_eager", "grads_function"])
def test_gradients_of_the_collectives_are_horovods(collectives, mode):
    w = [np.array([1.0, 2.0, 3.0]) * (r + 1) for r in range(2)]  # each rank's output weights
    for r, c in enumerate(collectives):
        g = {k: np.array(v) for k, v in c[mode].items()}
        np.testing.assert_allclose(g["allreduce_sum"], w[0] + w[1])  # the same allreduce of the gradient
        np.testing.assert_allclose(g["allreduce_avg"], (w[0] + w[1]) / 2)
        np.testing.assert_allclose(g["allgather"], (w[0] + w[1]) / 2)  # averaged, this rank's rows
        np.testing.assert_allclose(g["broadcast"], (w[0] + w[1]) / 2 if r == 0 else 0 * w[0])  # root only
        # reduce-scatter with Sum: allgather of (gradient * size); each rank's gradient is sum(w[:2]) * out
        np.testing.assert_allclose(g["reducescatter_sum"], [2 * w[0][:2].sum(), 2 * w[1][:2].sum(), 0.0])
        # alltoall: the gradient comes back by the reverse alltoall
        np.testing.assert_allclose(g["alltoall"], [w[0][r], w[1][r], 0.0])


def test_alltoall_gradient_without_splits_when_ranks_hold_different_rows(collectives):
    # rank r holds 2 (r + 1) rows and sends r + 1 to each rank; rank j receives them in rank order,
    # so row i of rank r lands at position off(r) + i % (r + 1) of rank i // (r + 1), off(r) = sum_{k<r} (k + 1),
    # and the gradient of sum(received * (1, 2, ...)) at that row is that position + 1
    for r, c in enumerate(collectives):
        off = sum(k + 1 for k in range(r))
        want = [float(off + i % (r + 1) + 1) for i in range(2 * (r + 1))]
        assert c["alltoall_even_grad"] == [want, want]


def test_variables_objects_process_sets_and_join(collectives):
    for _r, c in enumerate(collectives):
        assert c["bvars"] == [[1.0, 2.0], [0, 0]]
        assert c["binplace"] == [1.0]
        assert c["bobj"] == {"from": 1} and c["gobj"] == [["r", 0], ["r", 1]]
        assert c["join"] == 1
    assert collectives[1]["set_sum"] == [7.0]
    name, internal, text, _ = collectives[0]["set_foreign"]
    assert internal and "Rank 0 is not a member of the provided process set" in text
    # Horovod's TensorFlow ops report a rank outside the set as InvalidArgument, eagerly and in graphs
    for key in ("set_foreign_kinds", "set_foreign_in_function"):
        value_error, invalid_argument, text = collectives[0][key]
        assert invalid_argument and "Rank 0 is not a member of the provided process set" in text, key
    for c in collectives:  # a set never registered: ValueError, raised while the graph is built
        value_error, invalid_argument, text = c["set_unknown_in_function"]
        assert value_error and not invalid_argument and "has not been registered" in text
    # d(x^2)/dx = 2x with x = rank + 1, not reduced: rank 0 is outside the set, rank 1 alone in it
    assert [c["tape_set_of_one"] for c in collectives] == [2.0, 4.0]


def test_mismatched_calls_raise_the_same_error_on_every_rank(collectives):
    for key, words in [("err_shape", "shape"), ("err_dtype", "dtype"), ("err_root", "root_rank"), ("err_op", "op")]:
        errors = [c[key] for c in collectives]
        assert errors[0] == errors[1], key
        assert errors[0][1] is True and "Mismatched" in errors[0][2] and words in errors[0][2], errors[0]
        assert errors[0][3] is True, errors[0]  # eagerly, tf.errors.FailedPreconditionError, as Horovod raises
    for c in collectives:  # inside graphs, the same types as eagerly: Horovod's ops fail a graph with them
        for key, words in [("err_in_function", "Mismatched tensor shapes in allreduce"),
                           ("err_root_in_function", "Mismatched root ranks"),
                           ("err_shape_in_session", "Mismatched tensor shapes in allreduce"),
                           ("err_dtype_in_session", "Mismatched data types")]:
            assert c[key][0] == "FailedPreconditionError" and c[key][3] is True, (key, c[key])
            assert words in c[key][2], (key, c[key])
        for key in ("err_bad_root_in_function", "err_splits_in_function", "err_bad_root_in_session"):
            assert c[key][0] == "InvalidArgumentError", (key, c[key])  # an invalid call, as Horovod reports it
        assert c["ok_in_session"] == [2.0]
        assert c["after_errors"] == [2.0]  # the ranks go on


def test_tf1_sessions_keep_the_collectives_in_order(collectives):
    for c in collectives:  # rank r contributes (k + 1)(1 + r): sums 3 (k + 1) on 2 ranks
        assert c["session_together"] == [[[3.0], [30.0]]] * 3
        assert c["session_built_between_runs"] == [[[3.0 * (j + 1)] for j in range(k + 1)] for k in range(4)]


def test_compression_on_tf_tensors_is_horovods(collectives):
    # Horovod: none -> (tensor, None); fp16 casts floating tensors to float16 with their dtype as ctx,
    # leaves others as they are, and decompress casts back to a floating ctx
    for c in collectives:
        comp = c["compression"]
        for dtype in ("float64", "float32", "float16", "int32", "bool"):
            floating = dtype.startswith("float")
            assert comp[f"none_{dtype}"] == [dtype, None, dtype, [1.0] * 3]
            assert comp[f"fp16_{dtype}"] == ["float16" if floating else dtype, dtype, dtype, [1.0] * 3]


# ----------------------------------------------------------------------------- training

GLOBAL_BATCH, STEPS, LR, MOMENTUM = 8, 4, 0.05, 0.9


def _data():
    return regression(GLOBAL_BATCH, STEPS, seed=0)


def _initial(seed):
    keras.utils.set_random_seed(seed)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    return [w.astype("float64") for w in net.get_weights()]


def test_distributed_gradient_tape_equals_one_process_on_the_global_batch(training):
    x, y = _data()
    weights, moments = _initial(100), [0.0] * 4  # rank 0's weights, broadcast
    for k in range(STEPS):
        batch = slice(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)
        weights, moments = keras_sgd(weights, moments, mse_grad(weights, x[batch], y[batch]), LR, MOMENTUM)
    for t in training:
        assert_close(t["tape"], weights)


def _fit_reference():
    x, y = _data()
    size, peak = 2, LR * 2
    weights, moments, lr, rates = _initial(200), [0.0] * 4, peak, []
    for epoch in range(2):
        for k in range(STEPS):
            new = horovod_warmup_lr(peak, epoch, k, STEPS, 1, size) if epoch < 1 else lr
            momentum = MOMENTUM * new / lr  # Horovod's momentum correction for the batch the rate changes
            lr = new
            rates.append(lr)
            batch = slice(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)
            weights, moments = keras_sgd(weights, moments, mse_grad(weights, x[batch], y[batch]), lr, momentum)
    return weights, moments, rates, lr


def test_keras_fit_with_distributed_optimizer_and_callbacks_equals_one_process(training):
    weights, moments, rates, lr = _fit_reference()
    x, y = _data()
    after, _ = keras_sgd(weights, moments, mse_grad(weights, x[:GLOBAL_BATCH], y[:GLOBAL_BATCH]), lr, MOMENTUM)
    for t in training:
        assert_close(t["fit"], weights)
        np.testing.assert_allclose(t["fit_seen"]["lr"], rates, rtol=1e-6)
        assert t["optimizer_class"][0] == "SGD"
        # load_model: a distributed SGD again, with the momentum buffers and iteration count it was saved with
        assert t["loaded"] == {"distributed": True, "class": "SGD", "iterations": 8, "same_weights": True}
        assert_close(t["loaded_after_step"], after)
    raw = [t["fit_seen"]["raw"] for t in training]
    for t in training:  # MetricAverageCallback: the mean of the ranks' epoch losses
        np.testing.assert_allclose(t["fit_seen"]["averaged"], np.mean(raw, axis=0), rtol=1e-6)


def test_backward_passes_per_step_sums_locally_then_averages(training):
    x, y = _data()
    weights = _initial(300)
    for k in (0, 2):  # applied on the 2nd and 4th call, with the mean of two global batches' gradients
        grads = [mse_grad(weights, x[j * GLOBAL_BATCH : (j + 1) * GLOBAL_BATCH], y[j * GLOBAL_BATCH : (j + 1) * GLOBAL_BATCH])
                 for j in (k, k + 1)]
        weights = [w - LR * (a + b) / 2 for w, a, b in zip(weights, *grads, strict=False)]
    for t in training:
        assert_close(t["accumulated"], weights)
        assert t["accumulated_iterations"] == 4  # every call counts, as in Horovod
