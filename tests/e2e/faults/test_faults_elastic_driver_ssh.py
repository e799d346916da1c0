"""The elastic driver's ssh path: hosts added, removed and lost on two namespace hosts reached over ssh.

Each host is a network namespace running its own ``sshd`` (:mod:`sshhosts`); the driver runs in a
third namespace (a login node), so every worker starts over ssh. One launch of
``horovodrun -np 1 --min-np 1 --max-np 2 --host-discovery-script`` runs the ``ssh_hosts`` scenario
of ``tests/scripts/elastic_train.py`` (PyTorch) or ``elastic_train_tf.py`` (TensorFlow): the discovery script prints a hosts
file that the training rewrites, so the job starts on host A, grows to A and B at step 2 (B's
worker starts over ssh), shrinks to A at step 5 (B's worker leaves), grows again at step 8, and
at step 11 B's worker is SIGKILLed: B is lost (blacklisted) and A finishes alone. The final
parameters must equal plain full-batch descent with momentum in one process (``tests/elastic_jobs.py``), and
nothing may be left running on any host.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

import sshhosts
from elastic_jobs import (
    JOB_ENV,
    PAUSE,
    PROGRAMS,
    STEPS,
    assert_one_state_per_step,
    assert_oracle,
    discovery,
    sizes_seen,
)

REASON = sshhosts.can_run()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

HOROVODRUN = [sys.executable, "-m", "ringpipe.launch.horovodrun"]


def _nothing_left(marker: str, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := sshhosts.processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.timeout(400)
def test_hosts_added_removed_and_lost_over_ssh(tmp_path, face):
    with sshhosts.ssh_hosts(2) as sh:
        a, b = sh.hosts
        discover = discovery(tmp_path, [f"{a.addr}:1"])
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RINGPIPE_", "TORCHELASTIC_", "HOROVOD_", "GLOO_"))
               and k not in ("MASTER_ADDR", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS="1", ELASTIC_STEPS=str(STEPS), ELASTIC_PAUSE=str(PAUSE), TF_CPP_MIN_LOG_LEVEL="2",
                   **JOB_ENV, ELASTIC_HOSTS=f"{a.addr} {b.addr}", RINGPIPE_SSH_COMMAND=f"ssh -F {sh.config}")
        cmd = [*sh.client.prefix(), *HOROVODRUN, "-np", "1", "--min-np", "1", "--max-np", "2",
               "--host-discovery-script", str(discover), "-p", str(sh.port), "-i", sh.key,
               "python", str(PROGRAMS[face]), str(tmp_path), "ssh_hosts"]
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"the job did not end within 240 s:\n{out[-6000:]}")
        left = _nothing_left(str(tmp_path))
    assert proc.returncode == 0, out[-6000:]
    assert left == [], left
    assert sizes_seen(out) == [1, 2, 1, 2, 1], out[-6000:]  # added, removed, added again, lost
    assert f"world 2: 2 worker(s) on {a.addr}:1, {b.addr}:1 (1 new)" in out, out[-6000:]
    assert f"world 3: 1 worker(s) on {a.addr}:1" in out, out[-6000:]
    assert f"world 4: 2 worker(s) on {a.addr}:1, {b.addr}:1 (1 new)" in out, out[-6000:]
    assert f"worker {b.addr}[0] failed" in out and f"blacklisting host {b.addr}" in out, out[-6000:]
    assert f"world 5: 1 worker(s) on {a.addr}:1" in out, out[-6000:]
    # B's worker sees B as HOROVOD_HOSTNAME (as discovery printed it) and rank 1
    assert f"[{b.addr}[0]]: step 2 rank 1 size 2 host {b.addr}" in out, out[-6000:]
    assert f"done rank 0 size 1 host {a.addr}" in out, out[-6000:]
    assert_one_state_per_step(out)
    assert_oracle(tmp_path, face)
