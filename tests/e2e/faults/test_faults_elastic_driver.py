"""Horovod's elastic scenarios under ``ringpipe-horovodrun``'s elastic driver, for both faces, with real workers.

Several hosts on one machine: the discovery script prints loopback addresses (127.0.0.1,
127.0.0.2, ...), every one of which is this machine (so the driver starts their workers here,
without ssh) while the driver treats each as a host of its own (blacklisting, ``HOROVOD_HOSTNAME``,
local ranks). Each scenario runs once with the PyTorch program (``tests/scripts/elastic_train.py``)
and once with the TensorFlow one (``elastic_train_tf.py``, ``TensorFlowKerasState`` and
``DistributedGradientTape``): full-batch gradient descent with momentum and a commit after every
step, so whatever the membership changes, the final parameters equal the same descent written
plainly in one process (``tests/elastic_jobs.py``'s oracle), and every rank of every world prints
the same digest of its parameters and optimizer state at each step: a survivor's restored state is
its last commit bit for bit, and a new worker's is rank 0's. The end states (Horovod's messages,
non-zero status) are read from the driver's output; no worker outlives the job.
"""

import pytest

from elastic_jobs import assert_one_state_per_step, assert_oracle, run_job


@pytest.mark.timeout(300)
def test_hosts_added_then_removed_rank_zero_moves_to_a_survivor(tmp_path, face):
    code, out, sizes = run_job(tmp_path, face, "grow_shrink", ["127.0.0.1:1", "127.0.0.2:1"],
                               "-np", "2", "--min-np", "1", "--max-np", "4")
    assert code == 0, out
    assert sizes == [2, 4, 2], out  # three rendezvous
    assert "world 3: 2 worker(s) on 127.0.0.3:1, 127.0.0.4:1" in out, out
    # rank 0 is now on 127.0.0.3 (its host was not removed), and the removed workers left cleanly
    assert "[127.0.0.3[0]]: done rank 0 size 2 host 127.0.0.3" in out, out
    assert "[127.0.0.4[0]]: done rank 1 size 2 host 127.0.0.4" in out, out
    assert_one_state_per_step(out)
    assert_oracle(tmp_path, face)


@pytest.mark.timeout(300)
def test_a_rank_failing_by_exception_then_one_killed_blacklists_their_hosts_and_the_rest_go_on(tmp_path, face):
    code, out, sizes = run_job(tmp_path, face, "two_failures", ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"],
                               "-np", "3", "--min-np", "1", "--reset-limit", "2")
    assert code == 0, out  # two resets, within the limit of 2
    assert sizes == [3, 2, 1], out
    assert "worker 127.0.0.2[0] failed (exit code 1); blacklisting host 127.0.0.2" in out, out
    assert "worker 127.0.0.3[0] failed (killed by signal SIGKILL); blacklisting host 127.0.0.3" in out, out
    assert "world 2: 2 worker(s) on 127.0.0.1:1, 127.0.0.3:1" in out, out
    assert "done rank 0 size 1 host 127.0.0.1" in out, out
    assert_one_state_per_step(out)
    assert_oracle(tmp_path, face)


@pytest.mark.timeout(300)
def test_a_world_lost_with_every_worker_alive_is_made_again_from_the_same_workers(tmp_path, face):
    """No worker ends, so only the workers' word (``elastic/v<V>/lost``) can tell the driver the world is gone."""
    code, out, sizes = run_job(tmp_path, face, "lost_world", ["127.0.0.1:1", "127.0.0.2:1"], "-np", "2", "--min-np", "1",
                               timeout=120, HOROVOD_GLOO_TIMEOUT_SECONDS="5")
    assert code == 0, out
    assert sizes == [2], out  # the same two workers, in a world made again
    assert "world 1 was lost with every worker alive (a collective failed or timed out" in out, out
    assert "world 2: 2 worker(s) on 127.0.0.1:1, 127.0.0.2:1" in out, out
    assert "blacklisting" not in out, out
    assert "[127.0.0.2[0]]: done rank 1 size 2 host 127.0.0.2" in out, out
    assert_one_state_per_step(out)
    assert_oracle(tmp_path, face)


@pytest.mark.timeout(300)
def test_a_world_lost_the_same_way_every_time_ends_the_job_instead_of_looping(tmp_path):
    """The driver's logic alone (one face is enough): without a reset limit, remaking it would loop for ever."""
    code, out, _ = run_job(tmp_path, "torch", "lost_always", ["127.0.0.1:1", "127.0.0.2:1"], "-np", "2",
                           "--min-np", "1", timeout=120)
    assert code != 0, out
    assert "times in a row, each within 10 s of being made" in out, out
    assert out.count("was lost with every worker alive (a collective failed") == 5, out
    assert "blacklisting" not in out, out


@pytest.mark.timeout(300)
def test_a_blacklisted_host_comes_back_after_its_cooldown(tmp_path, face):
    code, out, sizes = run_job(tmp_path, face, "cooldown", ["127.0.0.1:1", "127.0.0.2:1"],
                               "-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "1", "2")
    assert code == 0, out
    assert sizes == [2, 1, 2], out
    assert "blacklisting host 127.0.0.2 for 2 s" in out, out  # 1 * 2**1 + U*1, clamped to 2
    assert "world 3: 2 worker(s) on 127.0.0.1:1, 127.0.0.2:1 (1 new)" in out, out
    assert_one_state_per_step(out)
    assert_oracle(tmp_path, face)


@pytest.mark.timeout(300)
def test_the_reset_limit_ends_a_job_with_more_resets(tmp_path, face):
    code, out, _ = run_job(tmp_path, face, "two_failures", ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"],
                           "-np", "3", "--min-np", "1", "--reset-limit", "1")
    assert code != 0, out
    assert "Horovod was shutdown because number of resets during elastic job exceeded limit: 1" in out, out


@pytest.mark.timeout(300)
def test_fixed_host_set_survives_a_killed_worker(tmp_path, face):
    code, out, sizes = run_job(tmp_path, face, "kill_one", [], "-np", "3", "--min-np", "2",
                               "-H", "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1", discovered=False)
    assert code == 0, out
    assert sizes == [3, 2], out
    assert "blacklisting host 127.0.0.2" in out, out
    assert_one_state_per_step(out)
    assert_oracle(tmp_path, face)


@pytest.mark.timeout(300)
def test_every_worker_failing_ends_the_job(tmp_path, face):
    code, out, _ = run_job(tmp_path, face, "all_fail", ["127.0.0.1:1", "127.0.0.2:1"], "-np", "2", "--min-np", "1")
    assert code != 0, out
    assert "Horovod detected that one or more processes exited with non-zero status" in out, out
    assert "every worker of world" in out, out


@pytest.mark.timeout(300)
def test_every_host_blacklisted_ends_the_job(tmp_path, face):
    code, out, _ = run_job(tmp_path, face, "fail_each", ["127.0.0.1:1", "127.0.0.2:1"], "-np", "2", "--min-np", "1")
    assert code != 0, out
    assert "every host is blacklisted" in out, out


@pytest.mark.timeout(300)
def test_fewer_than_min_np_slots_after_the_timeout_ends_the_job(tmp_path, face):
    code, out, _ = run_job(tmp_path, face, "kill_one", ["127.0.0.1:1", "127.0.0.2:1"], "-np", "2", "--min-np", "2",
                           "--elastic-timeout", "2")
    assert code != 0, out
    assert "Timed out waiting for available slots" in out and "at least 2 Horovod processes" in out, out


@pytest.mark.timeout(300)
def test_run_api_with_a_discovery_script_runs_an_elastic_job(tmp_path):
    import ringpipe

    def _elastic_fn():  # defined here: it travels by value to the workers
        import os

        import torch

        import ringpipe as hvd

        hvd.init()
        state = hvd.elastic.TorchState(model=torch.nn.Linear(2, 1), epoch=0)

        @hvd.elastic.run
        def train(state):
            while state.epoch < 3:
                hvd.allreduce(torch.ones(1))
                state.epoch += 1
                state.commit()
            return hvd.rank(), hvd.size(), os.environ["HOROVOD_HOSTNAME"]

        return train(state)

    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho 127.0.0.1:1\necho 127.0.0.2:1\n")
    discover.chmod(0o755)
    values = ringpipe.run(_elastic_fn, num_proc=2, min_num_proc=2, max_num_proc=2,
                          host_discovery_script=str(discover))
    assert values == [(0, 2, "127.0.0.1"), (1, 2, "127.0.0.2")]  # the first min_num_proc, as Horovod returns
