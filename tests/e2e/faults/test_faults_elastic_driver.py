"""Horovod's elastic scenarios under ``ringpipe-horovodrun``'s elastic driver, with real worker processes.

Several hosts on one machine: the discovery script prints loopback addresses (127.0.0.1,
127.0.0.2, ...), every one of which is this machine (so the driver starts their workers here,
without ssh) while the driver treats each as a host of its own (blacklisting, ``HOROVOD_HOSTNAME``,
local ranks). The program is ``tests/scripts/elastic_train.py``: full-batch gradient descent with
momentum and a commit after every step, so whatever the membership changes, the final parameters
equal the same descent run plainly in one process (``oracle`` below). The end states (Horovod's
messages, non-zero status) are read from the driver's output; no worker outlives the job.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "elastic_train.py"
HOROVODRUN = [sys.executable, "-m", "ringpipe.launch.horovodrun"]
STEPS = 20


def oracle(steps=STEPS):
    """Full-batch gradient descent with momentum on the program's data, written plainly."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(12, 4, generator=g)
    y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    vw, vb = None, None
    for _ in range(steps):
        err = X @ w.T + b - y  # d/dw mean((Xw+b-y)^2) = 2/N X^T err
        gw, gb = 2 * (err.T @ X) / len(X), 2 * err.sum(0) / len(X)
        vw = gw if vw is None else 0.9 * vw + gw
        vb = gb if vb is None else 0.9 * vb + gb
        w, b = w - 0.05 * vw, b - 0.05 * vb
    return w, b


def run_job(tmp_path, scenario, hosts, *flags, discovery=True, timeout=240):
    """Start the job; (exit status, output, the sizes seen by rank 0 in order, output lines)."""
    (tmp_path / "hosts").write_text("\n".join(hosts) + "\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    discover.chmod(0o755)
    where = ["--host-discovery-script", str(discover)] if discovery else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGPIPE_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", ELASTIC_STEPS=str(STEPS), ELASTIC_PAUSE="0.1")
    proc = subprocess.run([*HOROVODRUN, *flags, *where, "python", str(SCRIPT), str(tmp_path), scenario],
                          capture_output=True, text=True, timeout=timeout, env=env)
    out = proc.stdout + proc.stderr
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"workers outlived the job: {left}\n{out}"
    sizes = []
    for line in out.splitlines():
        if " rank 0 size " in line and "step " in line:
            size = int(line.split(" size ")[1].split()[0])
            if not sizes or sizes[-1] != size:
                sizes.append(size)
    return proc.returncode, out, sizes


def assert_oracle(tmp_path):
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    w, b = oracle()
    assert final["step"] == STEPS
    torch.testing.assert_close(final["weight"], w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final["bias"], b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_hosts_added_then_removed_rank_zero_moves_to_a_survivor(tmp_path):
    code, out, sizes = run_job(tmp_path, "grow_shrink", ["127.0.0.1:1", "127.0.0.2:1"],
                               "-np", "2", "--min-np", "1", "--max-np", "4")
    assert code == 0, out
    assert sizes == [2, 4, 2], out  # three rendezvous
    assert "world 3: 2 worker(s) on 127.0.0.3:1, 127.0.0.4:1" in out, out
    # rank 0 is now on 127.0.0.3 (its host was not removed), and the removed workers left cleanly
    assert "[127.0.0.3[0]]: done rank 0 size 2 host 127.0.0.3" in out, out
    assert "[127.0.0.4[0]]: done rank 1 size 2 host 127.0.0.4" in out, out
    assert_oracle(tmp_path)


@pytest.mark.timeout(300)
def test_a_rank_failing_by_exception_then_one_killed_blacklists_their_hosts_and_the_rest_go_on(tmp_path):
    code, out, sizes = run_job(tmp_path, "two_failures", ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"],
                               "-np", "3", "--min-np", "1", "--reset-limit", "2")
    assert code == 0, out  # two resets, within the limit of 2
    assert sizes == [3, 2, 1], out
    assert "worker 127.0.0.2[0] failed (exit code 1); blacklisting host 127.0.0.2" in out, out
    assert "worker 127.0.0.3[0] failed (killed by signal SIGKILL); blacklisting host 127.0.0.3" in out, out
    assert "world 2: 2 worker(s) on 127.0.0.1:1, 127.0.0.3:1" in out, out
    assert "done rank 0 size 1 host 127.0.0.1" in out, out
    assert_oracle(tmp_path)


@pytest.mark.timeout(300)
def test_a_blacklisted_host_comes_back_after_its_cooldown(tmp_path):
    code, out, sizes = run_job(tmp_path, "cooldown", ["127.0.0.1:1", "127.0.0.2:1"],
                               "-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "1", "2")
    assert code == 0, out
    assert sizes == [2, 1, 2], out
    assert "blacklisting host 127.0.0.2 for 2 s" in out, out  # 1 * 2**1 + U*1, clamped to 2
    assert "world 3: 2 worker(s) on 127.0.0.1:1, 127.0.0.2:1 (1 new)" in out, out
    assert_oracle(tmp_path)


@pytest.mark.timeout(300)
def test_the_reset_limit_ends_a_job_with_more_resets(tmp_path):
    code, out, _ = run_job(tmp_path, "two_failures", ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"],
                           "-np", "3", "--min-np", "1", "--reset-limit", "1")
    assert code != 0, out
    assert "Horovod was shutdown because number of resets during elastic job exceeded limit: 1" in out, out


@pytest.mark.timeout(300)
def test_fixed_host_set_survives_a_killed_worker(tmp_path):
    code, out, sizes = run_job(tmp_path, "kill_one", [], "-np", "3", "--min-np", "2",
                               "-H", "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1", discovery=False)
    assert code == 0, out
    assert sizes == [3, 2], out
    assert "blacklisting host 127.0.0.2" in out, out
    assert_oracle(tmp_path)


@pytest.mark.timeout(300)
def test_every_worker_failing_ends_the_job(tmp_path):
    code, out, _ = run_job(tmp_path, "all_fail", ["127.0.0.1:1", "127.0.0.2:1"], "-np", "2", "--min-np", "1")
    assert code != 0, out
    assert "Horovod detected that one or more processes exited with non-zero status" in out, out
    assert "every worker of world" in out, out


@pytest.mark.timeout(300)
def test_every_host_blacklisted_ends_the_job(tmp_path):
    code, out, _ = run_job(tmp_path, "fail_each", ["127.0.0.1:1", "127.0.0.2:1"], "-np", "2", "--min-np", "1")
    assert code != 0, out
    assert "every host is blacklisted" in out, out


@pytest.mark.timeout(300)
def test_fewer_than_min_np_slots_after_the_timeout_ends_the_job(tmp_path):
    code, out, _ = run_job(tmp_path, "kill_one", ["127.0.0.1:1", "127.0.0.2:1"], "-np", "2", "--min-np", "2",
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
