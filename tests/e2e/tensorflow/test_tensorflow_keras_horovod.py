"""``ringpipe.tensorflow.keras.DistributedOptimizer`` holds Horovod's optimizer methods, Keras 3 and tf-keras.

Horovod's Keras wrapper has ``_compute_gradients(loss, var_list, grad_loss=None, tape=None)``
(and ``compute_gradients``): the gradients of ``loss`` reduced over ranks, which
``apply_gradients`` then applies as they are. With ``backward_passes_per_step`` ``k`` every call
sums its local gradients; the ``k``-th reduces the sums (divided by ``k`` with
``average_aggregated_gradients``), applies them and sets ``optimizer._agg_helper.counter`` back to
0, so after ``n`` calls the counter is ``n % k`` and ``iterations`` is ``n`` (every call counts);
without aggregation ``_agg_helper`` is ``None``. An infinite gradient in one aggregation cycle
does not reach the next.

Two real ranks run ``tests/scripts/tf_keras_horovod.py``, once with Keras 3 and once with
``TF_USE_LEGACY_KERAS=1`` (tf-keras: its optimizers and its legacy ones). Rank ``r``'s loss is
``(r + 1) * sum(w)``: its gradient is ``r + 1`` everywhere, the ranks' mean 1.5, their sum 3;
with SGD at rate 1 the weights move by exactly what was applied. The expected values are those
numbers, written here. The infinite-gradient case uses an optimizer without state (``w -= g``,
as Horovod's own test does): tf-keras's SGD keeps a momentum buffer even without momentum, and
an infinite update leaves NaN there by itself.

``load_model`` takes the user's optimizer classes both ways Horovod documents:
``custom_optimizers=[Cls]`` (wrapped as the built-in ones are) and ``custom_objects={"Cls": f}``
with ``f(**config)`` making the optimizer (Keras 2 called such functions; Keras 3 itself takes
only classes there), keeping the settings ``f`` chose; the optimizer state saved comes back.
"""

from __future__ import annotations

from importlib.util import find_spec

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")


pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

SIZE, PASSES, CALLS = 2, 4, 10
W0 = np.array([1.0, 2.0, 3.0])
MEAN = sum(r + 1.0 for r in range(SIZE)) / SIZE  # the ranks' mean gradient: 1.5
TOTAL = sum(r + 1.0 for r in range(SIZE))  # their sum: 3


@pytest.fixture(scope="module", params=["keras3", "tf_keras"])
def ranks(request, tf_jobs):
    if request.param == "tf_keras" and find_spec("tf_keras") is None:
        pytest.skip("tf-keras is not installed (pip install --no-deps tf-keras==2.21.0)")
    got = tf_jobs.results("tf_keras_horovod.py", SIZE, legacy=request.param == "tf_keras")
    assert [g["keras2"] for g in got] == [request.param == "tf_keras"] * SIZE
    return got


def _kinds(ranks):
    return [(kind, [g["kinds"][kind] for g in ranks]) for kind in ranks[0]["kinds"]]


@pytest.mark.parametrize("how", ["eager", "function", "tape"])
@pytest.mark.parametrize("op", ["average", "sum"])
def test_compute_gradients_reduces_once_and_apply_gradients_applies_them(ranks, op, how):
    want = MEAN if op == "average" else TOTAL
    for kind, per_rank in _kinds(ranks):
        for got in per_rank:
            step = got["one_step"][f"{op}-{how}"]
            np.testing.assert_allclose(step["grad"], [want] * 3, err_msg=kind)
            # reduced once: a second reduction of Sum would apply 2 * TOTAL
            np.testing.assert_allclose(step["w"], W0 - want, err_msg=kind)
            assert step["iterations"] == 1, kind


@pytest.mark.parametrize("in_function", [False, True])
@pytest.mark.parametrize("average", [False, True])
def test_backward_passes_per_step_counter_iterations_and_weights(ranks, average, in_function):
    applied = MEAN * (1 if average else PASSES)  # one reduction of PASSES summed gradients
    for kind, per_rank in _kinds(ranks):
        for got in per_rank:
            seen = got["aggregate"][f"{average}-{in_function}"]
            for n, after in enumerate(seen, start=1):
                assert after["counter"] == n % PASSES, (kind, n)
                assert after["iterations"] == n, (kind, n)
                np.testing.assert_allclose(after["w"], W0 - (n // PASSES) * applied, err_msg=f"{kind} call {n}")


def test_agg_helper_is_none_without_aggregation(ranks):
    for kind, per_rank in _kinds(ranks):
        assert all(got["no_helper"] for got in per_rank), kind


def test_an_infinite_gradient_stays_in_its_aggregation_cycle(ranks):
    for kind, per_rank in _kinds(ranks):
        for got in per_rank:
            case = got["infinite"]
            assert np.isinf(case["grads"][0]) and np.isfinite(case["grads"][2:]).all(), (kind, case)
            # x set back to 0 after the first cycle; the second sums two gradients of 1 on each rank
            assert case["x"] == pytest.approx(-2.0), (kind, case)


@pytest.mark.parametrize("how", ["custom_optimizers", "custom_objects"])
def test_load_model_takes_custom_optimizers_and_optimizer_factories(ranks, how):
    for got in ranks:
        case = got["load"][how]
        assert case["class"] == "Custom" and case["custom"] and case["distributed"], case
        assert case["passes"] == (2 if how == "custom_objects" else 1)
        assert case["lr"] == pytest.approx(0.01)
        assert len(case["loaded"]) == len(case["saved"]) > 1  # iterations and the RMSprop buffers
        for a, b in zip(case["loaded"], case["saved"], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
