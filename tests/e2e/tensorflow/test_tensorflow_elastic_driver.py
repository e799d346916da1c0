"""The elastic driver with Keras ``model.fit`` and Horovod's elastic Keras callbacks: failures, and a host added.

The driver's scenarios for the TensorFlow face (``TensorFlowKerasState`` with
``DistributedGradientTape``) run in tests/e2e/faults/test_faults_elastic_driver.py, parametrized
over both faces. Here ``tests/scripts/elastic_fit_keras.py`` trains through ``model.fit`` with
``KerasState`` and the commit / batch / epoch callbacks, one batch an epoch, and must end on the
weights of the same full-batch descent written plainly (``tests/elastic_jobs.py``'s oracle).
"""

import pytest

from elastic_jobs import assert_oracle, run_job

pytest.importorskip("tensorflow")


@pytest.mark.timeout(450)
def test_keras_model_fit_with_the_elastic_callbacks_through_a_raised_and_a_killed_worker(tmp_path):
    """One batch an epoch, so an epoch is one step of the oracle's descent; the workers on 127.0.0.2
    (an exception) and 127.0.0.3 (SIGKILL) fail at the start of epochs 3 and 6, and the survivor
    restores the commit made at the end of the epoch before.
    """
    code, out, sizes = run_job(tmp_path, "keras_fit", None, ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"],
                               "-np", "3", "--min-np", "1", timeout=400)
    assert code == 0, out
    assert sizes == [3, 2, 1], out
    assert "blacklisting host 127.0.0.2" in out and "blacklisting host 127.0.0.3" in out, out
    # the epochs the survivor ran after each failure: the committed epoch count, not one more
    assert "[127.0.0.1[0]]: step 3 rank 0 size 2 host 127.0.0.1" in out, out
    assert "[127.0.0.1[0]]: step 6 rank 0 size 1 host 127.0.0.1" in out, out
    assert_oracle(tmp_path, "keras_fit")  # and its final epoch count is STEPS


@pytest.mark.timeout(300)
def test_keras_model_fit_gives_a_new_worker_the_state_with_the_optimizers_momentum(tmp_path):
    """A worker added during ``fit`` starts with an optimizer that has no slots yet; rank 0's has its
    momentum. The state's sync builds the new one's so that the broadcast matches (Horovod's own
    example builds it by hand with a first ``fit`` step), and the job ends on the oracle's weights,
    which need the momentum carried over.
    """
    code, out, sizes = run_job(tmp_path, "keras_fit", "grow", ["127.0.0.1:1"], "-np", "1", "--min-np", "1",
                               "--max-np", "2", "--reset-limit", "3", timeout=240)
    assert code == 0, out
    assert sizes == [1, 2], out
    assert "world 2: 2 worker(s) on 127.0.0.1:1, 127.0.0.2:1 (1 new)" in out, out
    assert "[127.0.0.2[0]]: step 2 rank 1 size 2 host 127.0.0.2" in out, out
    assert "Mismatched" not in out, out
    assert_oracle(tmp_path, "keras_fit")
