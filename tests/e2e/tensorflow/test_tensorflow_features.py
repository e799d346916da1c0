"""``ringpipe.tensorflow``'s SyncBatchNormalization, is_homogeneous and TF1 session hook, on three real ranks.

Three ranks run ``tests/scripts/tf_features.py`` under ``ringpipe launch``. The expected values
are written here: SyncBatchNormalization against one process running plain Keras
``BatchNormalization`` on the concatenated global batch (the ranks hold 2, 3 and 4 rows), eager
and inside ``tf.function``; the hook's broadcast and the averaged SGD steps from the update
written out; ``is_homogeneous`` from Horovod's definition (every host runs the same number of
ranks), on the launched job and on placements given as data. Skipped without TensorFlow.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from ringpipe.core.basics import is_homogeneous_placement  # noqa: E402
from scripts.tf_problem import bn_rows  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

SIZE = 3
BOUNDS = [0, 2, 5, 9]
MOMENTUM, EPSILON = 0.9, 1e-3


@pytest.fixture(scope="module")
def ranks(tf_jobs):
    return tf_jobs.results("tf_features.py", SIZE)


# ----------------------------------------------------------------------------- SyncBatchNormalization

def _batch(shape, seed):
    return bn_rows(BOUNDS[-1], shape, seed)


def _plain_bn_on_global_batch(shape, seed):
    """One process, plain tf.keras BatchNormalization, all 9 rows; loss = sum(out * c) over them."""
    x, c = tf.constant(_batch(shape, seed)), tf.constant(_batch(shape, seed + 1))
    layer = tf.keras.layers.BatchNormalization(momentum=MOMENTUM, epsilon=EPSILON)
    layer.build(x.shape)
    layer.gamma.assign(np.linspace(0.5, 1.5, shape[-1]).astype("float32"))
    layer.beta.assign(np.linspace(-0.2, 0.3, shape[-1]).astype("float32"))
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x, training=True)
        loss = tf.reduce_sum(out * c)
    gx, gg, gb = tape.gradient(loss, [x, layer.gamma, layer.beta])
    return {"out": out.numpy(), "grad_x": gx.numpy(), "grad_gamma": gg.numpy(), "grad_beta": gb.numpy(),
            "moving_mean": layer.moving_mean.numpy(), "moving_variance": layer.moving_variance.numpy(),
            "inference": layer(x, training=False).numpy()}


def _stats_by_hand(shape, seed):
    """The moving statistics written out: 0.9 * initial + 0.1 * the global batch's (biased) moments."""
    x = _batch(shape, seed).astype("float64").reshape(-1, shape[-1])
    return MOMENTUM * 0.0 + (1 - MOMENTUM) * x.mean(0), MOMENTUM * 1.0 + (1 - MOMENTUM) * x.var(0)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name, shape, seed", [("2d", (3,), 10), ("4d", (2, 2, 3), 20)], ids=["2d", "4d"])
def test_sync_batch_norm_equals_plain_batch_norm_on_the_global_batch(ranks, name, shape, seed, mode):
    want = _plain_bn_on_global_batch(shape, seed)
    mean, var = _stats_by_hand(shape, seed)
    np.testing.assert_allclose(want["moving_mean"], mean, rtol=1e-5, atol=1e-6)  # the oracle itself
    np.testing.assert_allclose(want["moving_variance"], var, rtol=1e-5, atol=1e-6)
    got = [t["sync_bn"][f"{name}-{mode}"] for t in ranks]
    for r, g in enumerate(got):
        rows = slice(BOUNDS[r], BOUNDS[r + 1])
        for key in ("out", "grad_x", "inference"):  # this rank's rows of the global result
            np.testing.assert_allclose(np.array(g[key]), want[key][rows], rtol=1e-4, atol=1e-5, err_msg=key)
        for key in ("moving_mean", "moving_variance"):  # the same on every rank
            np.testing.assert_allclose(np.array(g[key]), want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for key in ("grad_gamma", "grad_beta"):  # each rank's loss is its rows' part: the parts sum to the whole
        np.testing.assert_allclose(np.sum([g[key] for g in got], axis=0), want[key], rtol=1e-4, atol=1e-5,
                                   err_msg=key)


def test_sync_batch_norm_refuses_fused():
    import ringpipe.tensorflow as hvd

    with pytest.raises(ValueError, match="fused=True"):
        hvd.SyncBatchNormalization(fused=True)


# ----------------------------------------------------------------------------- is_homogeneous

def test_is_homogeneous_on_the_launched_job(ranks):
    for t in ranks:  # one host, three ranks
        assert t["homogeneous"] == {"tf": True, "api": True, "local_size": SIZE, "cross_size": 1}


@pytest.mark.parametrize("hosts, homogeneous", [
    (["a"], True),
    (["a", "a", "b", "b"], True),
    (["a", "b", "a", "b"], True),  # interleaved placement, two ranks each
    (["a", "a", "b"], False),  # -H a:2,b:1
    (["a", "b", "b", "c", "c", "c"], False),
    (["a", "b", "c"], True),
])
def test_is_homogeneous_means_every_host_runs_the_same_number_of_ranks(hosts, homogeneous):
    assert is_homogeneous_placement(hosts) is homogeneous


def test_check_num_rank_power_of_2():
    import ringpipe.tensorflow as hvd

    assert [n for n in range(70) if hvd.check_num_rank_power_of_2(n)] == [1, 2, 4, 8, 16, 32, 64]


# ----------------------------------------------------------------------------- TF1 hook

def test_broadcast_global_variables_hook_in_a_monitored_training_session(ranks):
    targets = np.array([[r, -r] for r in range(SIZE)], dtype="float64")
    w = np.array([1.0, 2.0])  # rank 0's initial value, broadcast by the hook
    want = [w]
    for _ in range(3):  # GradientDescent on the mean gradient of sum((w - t_r)^2)
        w = w - 0.1 * np.mean(2 * (w - targets), axis=0)
        want.append(w)
    for t in ranks:
        np.testing.assert_allclose(t["hook"]["w"], want, rtol=1e-6)
        assert "does not support eager execution" in t["hook"]["eager"]
