"""ringpipe.tensorflow on 3 ranks and under MPI, and the rest of Horovod's TF / Keras surface.

Real processes: ``ringpipe launch`` (gloo) and ``mpirun`` (``RINGPIPE_BACKEND=mpi``) run the
scripts in ``tests/scripts``. The expected values are written here: collectives from the inputs
each rank used, gradients from Horovod's definitions, training from one process on the global
batch (plain TensorFlow gradients and the optimizer's update written out), the elastic callbacks
from Horovod's rules (``horovod/_keras/elastic.py``). Skipped without TensorFlow.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from scripts.tf_problem import regression  # noqa: E402
from tf_ranks import HAVE_MPI, assert_close, keras_sgd, mse_grad  # noqa: E402

needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
# A module fixture's run (TensorFlow in every process) counts against its first test's time.
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def _run(tf_jobs, script: str, n: int, mpi: bool) -> list[dict]:
    results = tf_jobs.results(script, n, mpi=mpi)
    assert [x["rank"] for x in results] == list(range(n)) and {x["size"] for x in results} == {n}
    assert {x["mpi"] for x in results} == {mpi}
    return results


@pytest.fixture(scope="module", params=[pytest.param(("gloo", 3), id="gloo-3"),
                                        pytest.param(("mpi", 3), id="mpi-3", marks=[needs_mpi, pytest.mark.mpi])])
def nranks(request, tf_jobs):
    backend, n = request.param
    return _run(tf_jobs, "tf_nranks.py", n, backend == "mpi")


@pytest.fixture(scope="module", params=[pytest.param(("gloo", 2), id="gloo-2"),
                                        pytest.param(("mpi", 2), id="mpi-2", marks=[needs_mpi, pytest.mark.mpi])])
def more(request, tf_jobs):
    backend, n = request.param
    return _run(tf_jobs, "tf_more.py", n, backend == "mpi")


@pytest.fixture(scope="module", params=[pytest.param(("gloo", 2), id="gloo-2"),
                                        pytest.param(("mpi", 2), id="mpi-2", marks=[needs_mpi, pytest.mark.mpi])])
def elastic_run(request, tf_jobs):
    backend, n = request.param
    return _run(tf_jobs, "tf_elastic_run.py", n, backend == "mpi")


# ----------------------------------------------------------------------------- one-process references

GLOBAL_BATCH, STEPS, LR, MOMENTUM = 12, 3, 0.05, 0.9


def _data(seed):
    return regression(GLOBAL_BATCH, STEPS, seed)


def _initial(seed):
    keras.utils.set_random_seed(seed)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    return [w.astype("float64") for w in net.get_weights()]


def _train(seed, data_seed, epochs, momentum):
    """Keras's SGD on the global batches."""
    x, y = _data(data_seed)
    weights, moments = _initial(seed), [0.0] * 4
    for _ in range(epochs):
        for k in range(STEPS):
            g = mse_grad(weights, x[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH], y[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH])
            weights, moments = keras_sgd(weights, moments, g, LR, momentum)
    return weights


# ----------------------------------------------------------------------------- N ranks, gloo and MPI

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64")


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_every_collective_on_n_ranks_every_dtype(nranks, mode):
    n = len(nranks)
    base = [np.arange(6, dtype=np.float64).reshape(2, 3) + 10 * r for r in range(n)]
    for r, res in enumerate(nranks):
        got = res[mode]
        for dtype in DTYPES:
            np.testing.assert_array_equal(got[f"sum_{dtype}"], sum(base), err_msg=dtype)
            np.testing.assert_array_equal(got[f"min_{dtype}"], base[0], err_msg=dtype)
            np.testing.assert_array_equal(got[f"max_{dtype}"], base[-1], err_msg=dtype)
            np.testing.assert_array_equal(got[f"gather_{dtype}"], np.concatenate(base), err_msg=dtype)
            np.testing.assert_array_equal(got[f"bcast_{dtype}"], base[n - 1], err_msg=dtype)
        assert got["gather_bool"] == [float(v) for i in range(n) for v in (i % 2 == 0, True)]
        assert got["bcast_bool"] == [0.0, 1.0]  # rank 1's flags
        np.testing.assert_allclose(got["avg"], sum(base) / n)
        np.testing.assert_allclose(got["scaled"], 3.0 * sum(0.5 * b for b in base))
        assert got["gather_uneven"] == [[float(i)] * 2 for i in range(n) for _ in range(i + 1)]
        # alltoall: rank i sends (i + j) % 2 + 1 rows of value 100 i + j to rank j
        assert got["alltoall"] == [[100.0 * i + r] for i in range(n) for _ in range((i + r) % 2 + 1)]
        assert got["alltoall_splits"] == [float((i + r) % 2 + 1) for i in range(n)]
        # reduce-scatter of 2n+1 rows (row k holds (k+1)(rank+1)): the first (2n+1) % n ranks get a row more
        m = 2 * n + 1
        counts = [m // n + (1 if i < m % n else 0) for i in range(n)]
        start = sum(counts[:r])
        total = n * (n + 1) / 2
        assert got["rs_sum"] == [[(k + 1) * total] for k in range(start, start + counts[r])]


def test_gradients_and_mismatches_on_n_ranks(nranks):
    n = len(nranks)
    w = [np.array([1.0, 2.0, 3.0]) * (r + 1) for r in range(n)]
    for r, res in enumerate(nranks):
        g = res["grads"]
        np.testing.assert_allclose(g["allreduce_sum"], sum(w))
        np.testing.assert_allclose(g["allreduce_avg"], sum(w) / n)
        np.testing.assert_allclose(g["allgather"], sum(w) / n)
        np.testing.assert_allclose(g["broadcast"], sum(w) / n if r == 0 else 0 * w[0])
        assert res["after_errors"] == [float(n)]
    for key, words in [("err_shape", "Mismatched tensor shapes in allreduce"), ("err_root", "Mismatched root ranks")]:
        errors = [res[key] for res in nranks]
        assert all(e == errors[0] for e in errors), key  # the same error, every rank
        assert errors[0][0] is True and words in errors[0][1]
        assert all(f"rank {i}:" in errors[0][1] for i in range(n))  # every rank's call is listed
    for key, what in [("err_dtype", "allreduce"), ("err_dtype_gather", "allgather"),
                      ("err_dtype_vars", "broadcast"), ("err_dtype_graph", "allreduce")]:
        # inside a tf.function TF names the rank's own traced function around it: the rest is the same
        errors = [res[key] and [res[key][0], _without_function_names(res[key][1])] for res in nranks]
        assert all(e is not None and e[1] == errors[0][1] for e in errors), (key, errors)
        assert f"{what} on world: rank {n - 1} made an invalid call" in errors[0][1], errors[0]
        assert "dtype string cannot take part in a collective" in errors[0][1], errors[0]


def _without_function_names(message: str) -> str:
    """An error raised in a tf.function without the names TF gives the rank's traced function."""
    message = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", message)
    return re.sub(r"\s*\[Op:__inference_[^\]]*\]$", "", message)


def test_training_on_n_ranks_equals_one_process_on_the_global_batch(nranks):
    tape = _train(100, 1, 1, MOMENTUM)
    fit = _train(200, 1, 1, MOMENTUM)
    for res in nranks:
        assert_close(res["tape"], tape)
        assert_close(res["fit"], fit)


# ----------------------------------------------------------------------------- the rest of the surface


def test_graph_time_queries_are_read_when_the_graph_runs(more):
    n = len(more)
    for r, res in enumerate(more):
        assert res["before_init"][0] == -1  # Horovod's HOROVOD_PROCESS_SET_ERROR_INIT
        assert res["before_init"][1][0] == "NotInitializedError" and "init()" in res["before_init"][1][1]
        q = res["queries"]
        local_rank, local_size = q["local"]
        # size, size of the set [n-1], rank, local rank, local size, included in: global, [n-1], id 99
        want = [n, 1, r, local_rank, local_size, 1, int(r == n - 1), -3]
        assert q["eager"] == want and q["function"] == want
        assert q["function_after_remove"] == [1, -3, -3]  # the graph traced before the removal reads it now
        assert q["size_after_remove"] == ["InvalidArgumentError", True]
        assert q["bobj_fn"] == {"from": n - 1}


def test_tf1_optimizer_minimizes_the_mean_gradient(more):
    x, y = _data(3)
    w, b = np.full((4, 1), 0.1), np.zeros(1)
    acc_w, acc_b = np.zeros_like(w), np.zeros_like(b)
    # TF1 optimizers hold their hyperparameters as float32 tensors, cast to the variable's dtype
    lr, momentum = float(np.float32(LR)), float(np.float32(MOMENTUM))
    for k in range(STEPS):  # tf.compat.v1 MomentumOptimizer: accum = momentum * accum + g; var -= lr * accum
        bx, by = x[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH].astype("float64"), y[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
        err = bx @ w + b - by
        gw, gb = 2 * bx.T @ err / len(bx), 2 * err.sum(0) / len(bx)
        acc_w, acc_b = momentum * acc_w + gw, momentum * acc_b + gb
        w, b = w - lr * acc_w, b - lr * acc_b
    for res in more:
        legacy = res["legacy"]
        np.testing.assert_allclose(legacy["w"], w, rtol=1e-9)
        np.testing.assert_allclose(legacy["b"], b, rtol=1e-9, atol=1e-12)
        assert legacy["name"] == "DistributedMomentumOptimizer" and legacy["slots"] == ["momentum"]
        errors = legacy["errors"]
        assert errors["predivide"] == ["ValueError", "gradient_predivide_factor not supported with op != Average"]
        assert errors["keras_adasum"] == ["ValueError", "op == Adasum is not supported yet with Keras"]
        assert errors["adasum"][0] == "NotImplementedError" and "Keras optimizer" in errors["adasum"][1]
        assert errors["passes"][0] == "ValueError" and "backward_passes_per_step" in errors["passes"][1]
        assert legacy["keras_through_tf"] == ["Adam", True]  # a Keras optimizer goes to the Keras wrapper


def test_standalone_keras_face_trains_like_one_process_and_keeps_the_best_model(more):
    fit = _train(400, 4, 4, 0.0)
    for res in more:
        k = res["keras"]
        # Horovod's wrapper: a subclass of the wrapped class with its name, so a saved model loads without it
        assert k["wrapper"] == {"name": "Adam", "module": True, "isinstance": True, "config": True}
        assert_close(k["fit"], fit)
        val_loss = k["seen"]["val_loss"]
        best = int(np.argmin(val_loss))
        assert best < len(val_loss) - 1  # the data make the last epoch not the best
        assert k["best"] == k["seen"]["weights"][best]
        assert k["best_optimizer"] == ["SGD", True]  # plain keras.models.load_model gives keras's own SGD
        assert k["best_errors"]["no_path"][0] == "ValueError" and "filepath" in k["best_errors"]["no_path"][1]
        assert k["best_errors"]["weights_ext"][0] == "ValueError" and ".weights.h5" in k["best_errors"]["weights_ext"][1]


def test_elastic_states_commit_restore_and_sync(more):
    synced = _initial(600)
    for res in more:
        e = res["elastic"]
        assert_close(e["synced"], synced)  # rank 0's weights everywhere after sync()
        assert e["restored"] == [True, True, 0, 0]  # weights, epoch and optimizer iterations back at the commit
        assert e["tf_state"] == [[0.0, 1.0], 0] and e["tf_state_restored"] == [[0.0, 1.0], 0]


def test_elastic_run_recovers_from_a_failure_inside_tf_function(elastic_run):
    want = _train(700, 6, 1, MOMENTUM)  # three steps, as if nothing had failed
    for res in elastic_run:
        run = res["run"]
        assert run["returned"] == STEPS
        assert run["attempts"] == [0, 1]  # the retry starts from the commit after epoch 0
        assert run["resets"] == [len(elastic_run)]  # reset callbacks ran once, after re-initialisation
        assert run["iterations"] == STEPS  # the step of the failed attempt was rolled back
        assert_close(run["weights"], want)


def _horovod_commits(epochs, steps, every):
    """CommitStateCallback's rule: a commit every `every` batches (counted across epochs) and at each epoch end."""
    commits, remaining = [], every
    for epoch in range(epochs):
        for batch in range(steps):
            remaining -= 1
            if remaining == 0:
                commits.append([epoch, batch])  # state.epoch counts finished epochs
                remaining = every
        commits.append([epoch + 1, 0])
    return commits


def test_elastic_keras_callbacks_follow_horovods_rules(more):
    for res in more:
        cb = res["elastic"]["callbacks"]
        assert cb["commits"] == _horovod_commits(2, STEPS, 2)
        assert cb["seen"] == [*(["batch", b] for b in range(STEPS)), ["epoch", 1, 0],
                              *(["batch", b] for b in range(STEPS)), ["epoch", 2, 0]]
