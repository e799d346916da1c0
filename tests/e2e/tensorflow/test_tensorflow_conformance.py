"""Horovod's Keras model-parallel options, as Horovod's own Keras tests use them, on 2 real ranks (gloo).

``BroadcastGlobalVariablesCallback(root_rank, local_variables=...)`` leaves the local variables
at each rank's value and gives every other variable the root's; ``horovod.keras``'s
``PartialDistributedOptimizer(local_layers=...)`` averages the gradients of every variable but
those of the local layers, which stay the rank's own, divided by the number of ranks when
``scale_local_gradients`` (Horovod's rule). With tf-keras (``TF_USE_LEGACY_KERAS=1``) the
wrapper's ``_compute_gradients``, which Horovod's Keras tests call, returns the ranks' mean
gradients for tf-keras's optimizers and for ``tf.keras.optimizers.legacy`` ones. The expected
values are written here from the gradients each rank reports and plain SGD (``w - lr * g``).
uint16 tensors (Horovod's CPU dtypes include it) go through allgather, broadcast and
alltoall bit for bit, values above int16's range included. Skipped without TensorFlow (and the
tf-keras test without tf-keras).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

N, LR = 2, 0.5


@pytest.fixture(scope="module")
def ranks(tf_jobs):
    return tf_jobs.results("tf_conformance.py", N)


def test_broadcast_callback_keeps_local_variables_and_broadcasts_the_rest(ranks):
    root = N - 1
    for r, res in enumerate(ranks):
        for v in res["broadcast"]["local"]:
            np.testing.assert_array_equal(np.array(v), np.full_like(np.array(v), float(r)))
        for v in res["broadcast"]["shared"]:
            np.testing.assert_array_equal(np.array(v), np.full_like(np.array(v), float(root)))


def test_broadcast_callback_rejects_local_variables_that_are_not_variables(ranks):
    for res in ranks:
        kind, message = res["broadcast"]["bad_local"]
        assert kind == "ValueError" and "local_variables" in message


@pytest.mark.parametrize("key,scale", [("partial_scaled", True), ("partial_unscaled", False)])
def test_partial_optimizer_averages_all_but_local_layers(ranks, key, scale):
    grads = [[np.array(g) for g in res[key]["grads"]] for res in ranks]
    local = {0, 1}  # the first Dense layer's kernel and bias
    for r, res in enumerate(ranks):
        for i, (w0, w1) in enumerate(zip(res[key]["before"], res[key]["after"], strict=True)):
            if i in local:
                g = grads[r][i] / N if scale else grads[r][i]
            else:
                g = sum(grads[q][i] for q in range(N)) / N
            np.testing.assert_allclose(np.array(w1), np.array(w0) - LR * g, rtol=1e-5, atol=1e-6)
    # the ranks' own gradients differ, so the local layers really differ across ranks afterwards
    assert not np.allclose(np.array(ranks[0][key]["after"][0]), np.array(ranks[1][key]["after"][0]))


def test_partial_optimizer_is_exported_and_rejects_non_layers(ranks):
    for res in ranks:
        assert res["exported"]
        kind, message = res["bad_layers"]
        assert kind == "ValueError" and "local_layers" in message


def test_uint16_moves_through_allgather_broadcast_and_alltoall(ranks):
    block = lambda q: [[60000 + q] * 3] * 2  # noqa: E731 - rank q's (2, 3) input
    gathered = [row for q in range(N) for row in block(q)]
    for r, res in enumerate(ranks):
        u = res["uint16"]
        assert u["dtypes"] == ["uint16"]
        assert u["allgather"] == gathered and u["allgather_fn"] == gathered
        assert u["broadcast"] == block(N - 1)
        # alltoall: rank q sends [60000 + 10 q + 2 r', 60000 + 10 q + 2 r' + 1] to rank r'
        assert u["alltoall"] == [60000 + 10 * q + 2 * r + k for q in range(N) for k in range(2)]


def test_keras2_compute_gradients_returns_the_mean_for_new_and_legacy_optimizers(tf_jobs):
    pytest.importorskip("tf_keras")
    ranks = tf_jobs.results("tf_conformance_legacy.py", N, legacy=True)
    assert ranks[0]["keras"].startswith("tf_keras")
    for kind in ("new", "legacy"):
        own = [[np.array(g) for g in res[kind]["own"]] for res in ranks]
        want = [sum(own[q][i] for q in range(N)) / N for i in range(len(own[0]))]
        for res in ranks:
            for got, w in zip(res[kind]["reduced"], want, strict=True):
                np.testing.assert_allclose(np.array(got), w, rtol=1e-5, atol=1e-6)
