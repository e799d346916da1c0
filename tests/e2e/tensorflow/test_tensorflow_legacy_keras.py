"""``ringpipe.tensorflow.keras`` on Keras 2 (tf-keras, ``TF_USE_LEGACY_KERAS=1``) holds Horovod's Keras 2 semantics.

Two real ranks run ``tests/scripts/tf_legacy_keras.py`` under ``ringpipe launch`` with
``TF_USE_LEGACY_KERAS=1``. The expected values are written here with plain TensorFlow (no Keras):
training from one process on the global batch (the mean squared error's gradient and the SGD
update written out), the warmup rates from Horovod's formula, the metric average from the ranks'
own losses, SyncBatchNormalization from batch normalisation of the global batch written out. Skipped when tf-keras is not installed (``pip install --no-deps tf-keras==2.21.0``).
"""

from __future__ import annotations

from importlib.util import find_spec

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from scripts.tf_problem import bn_rows, regression  # noqa: E402
from tf_ranks import assert_close, horovod_warmup_lr, keras_sgd, mse_grad  # noqa: E402

pytestmark = [
    pytest.mark.skipif(find_spec("tf_keras") is None,
                       reason="tf-keras is not installed (pip install --no-deps tf-keras==2.21.0)"),
    pytest.mark.timeout(900),
    pytest.mark.slow,
]

GLOBAL_BATCH, STEPS, LR, MOMENTUM, SIZE = 8, 4, 0.05, 0.9, 2


@pytest.fixture(scope="module")
def ranks(tf_jobs):
    return tf_jobs.results("tf_legacy_keras.py", SIZE, legacy=True)


# ----------------------------------------------------------------------------- one process on the global batch

def _data():
    return regression(GLOBAL_BATCH, STEPS, seed=0)


def _initial(seed):
    """The rank script's starting weights for ``seed`` (Dense(3, tanh) then Dense(1))."""
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=0.5, size=s).astype("float32").astype("float64") for s in ((4, 3), (3,), (3, 1), (1,))]


def _batch(k):
    return slice(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)


def _fit_reference(seed):
    """Two epochs, the first one warming up, with Horovod's momentum correction where the rate changes."""
    x, y = _data()
    peak = LR * SIZE
    weights, moments, lr, rates = _initial(seed), [0.0] * 4, peak, []
    for epoch in range(2):
        for k in range(STEPS):
            new = horovod_warmup_lr(peak, epoch, k, STEPS, 1, SIZE) if epoch < 1 else lr
            momentum = MOMENTUM * new / lr
            lr = new
            rates.append(lr)
            weights, moments = keras_sgd(weights, moments, mse_grad(weights, x[_batch(k)], y[_batch(k)]), lr, momentum)
    return weights, moments, rates, lr


# ----------------------------------------------------------------------------- the checks

def test_the_ranks_ran_tf_keras(ranks):
    for t in ranks:
        assert t["keras2"] is True and t["keras"].startswith("tf_keras")


@pytest.mark.parametrize("key, seed", [("fit", 200), ("fit_legacy", 400)], ids=["optimizers", "optimizers.legacy"])
def test_fit_with_distributed_optimizer_and_callbacks_equals_one_process(ranks, key, seed):
    weights, _, rates, _ = _fit_reference(seed)  # rank 0's weights, broadcast before the first step
    raw = [t[key]["seen"]["raw"] for t in ranks]
    for t in ranks:
        assert_close(t[key]["weights"], weights)
        np.testing.assert_allclose(t[key]["seen"]["lr"], rates, rtol=1e-6)  # the warmup, per batch
        np.testing.assert_allclose(t[key]["seen"]["averaged"], np.mean(raw, axis=0), rtol=1e-6)
        assert t[key]["class"][0] == "SGD" and t[key]["class"][1].startswith("tf_keras.")


def test_load_model_rewraps_the_optimizer_with_its_state(ranks):
    weights, moments, _, lr = _fit_reference(200)
    x, y = _data()
    after, _ = keras_sgd(weights, moments, mse_grad(weights, x[_batch(0)], y[_batch(0)]), lr, MOMENTUM)
    for t in ranks:
        state = {"distributed": True, "class": "SGD", "iterations": 2 * STEPS, "same_weights": True}
        assert t["loaded"] == {"new": state, "legacy": state}
        assert_close(t["loaded_after_step"], after)  # one more averaged step, with the saved momentum buffers


@pytest.mark.parametrize("key", ["accumulated", "accumulated_legacy"])
def test_backward_passes_per_step_sums_locally_then_averages(ranks, key):
    x, y = _data()
    weights = _initial(300)
    for k in (0, 2):  # applied on the 2nd and 4th step, with the mean of two global batches' gradients
        a, b = (mse_grad(weights, x[_batch(j)], y[_batch(j)]) for j in (k, k + 1))
        weights = [w - LR * (ga + gb) / 2 for w, ga, gb in zip(weights, a, b, strict=True)]
    for t in ranks:
        assert_close(t[key]["weights"], weights)
        assert t[key]["iterations"] == STEPS  # every step counts, as in Horovod


def test_schedule_callback_and_best_checkpoint(ranks):
    # Horovod's staircase schedule: initial_lr * 0.5 ** (epoch - start_epoch) from start_epoch on
    want = [LR] * STEPS + [LR] * STEPS + [LR * 0.5] * STEPS
    for t in ranks:
        np.testing.assert_allclose(t["schedule"]["lr"], want, rtol=1e-6)
        assert t["schedule"]["best_saved"] is True
        assert t["ringpipe_keras_callbacks"].startswith("tf_keras.")


BN_BOUNDS = [0, 3, 8]


def _bn_batch(shape, seed):
    return bn_rows(BN_BOUNDS[-1], shape, seed)


def _batch_norm_by_hand(shape, seed):
    """Batch normalisation of the whole global batch written out: the moments over all axes but the channel."""
    x = tf.constant(_bn_batch(shape, seed).astype("float64"))
    c = tf.constant(_bn_batch(shape, seed + 1).astype("float64"))
    gamma = tf.Variable(np.linspace(0.5, 1.5, shape[-1]))
    beta = tf.Variable(np.linspace(-0.2, 0.3, shape[-1]))
    axes = list(range(len(shape)))
    with tf.GradientTape() as tape:
        tape.watch(x)
        mean = tf.reduce_mean(x, axes)
        var = tf.reduce_mean(tf.square(x - mean), axes)
        out = gamma * (x - mean) / tf.sqrt(var + 1e-3) + beta
        loss = tf.reduce_sum(out * c)
    gx, gg, gb = tape.gradient(loss, [x, gamma, beta])
    return {"out": out.numpy(), "grad_x": gx.numpy(), "grad_gamma": gg.numpy(), "grad_beta": gb.numpy(),
            "moving_mean": 0.9 * 0.0 + 0.1 * mean.numpy(), "moving_variance": 0.9 * 1.0 + 0.1 * var.numpy()}


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name, shape, seed", [("2d", (3,), 10), ("4d", (2, 2, 3), 20)], ids=["2d", "4d"])
def test_sync_batch_norm_is_a_tf_keras_layer_normalising_the_global_batch(ranks, name, shape, seed, mode):
    want = _batch_norm_by_hand(shape, seed)
    got = [t["sync_bn"][f"{name}-{mode}"] for t in ranks]
    for r, g in enumerate(got):  # ranks with 3 and 5 rows
        assert g["class"].startswith("tf_keras.")
        rows = slice(BN_BOUNDS[r], BN_BOUNDS[r + 1])
        for key in ("out", "grad_x"):
            np.testing.assert_allclose(np.array(g[key]), want[key][rows], rtol=1e-4, atol=1e-4, err_msg=key)
        for key in ("moving_mean", "moving_variance"):
            np.testing.assert_allclose(np.array(g[key]), want[key], rtol=1e-5, atol=1e-5, err_msg=key)
    for key in ("grad_gamma", "grad_beta"):
        np.testing.assert_allclose(np.sum([g[key] for g in got], axis=0), want[key], rtol=1e-4, atol=1e-4,
                                   err_msg=key)


def test_broadcast_global_variables_takes_the_model(ranks):
    for t in ranks:
        assert_close(t["broadcast_global_variables"], _initial(501))  # rank 1's weights
        assert "pass the model" in t["broadcast_without_model"]
