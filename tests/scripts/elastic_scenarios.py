"""The failures and host changes of the elastic driver's end-to-end programs, one table for both faces.

``elastic_train.py`` (PyTorch) and ``elastic_train_tf.py`` (TensorFlow) train the same full-batch
descent and call :func:`act` before each step with their face's module (``ringpipe`` or
``ringpipe.tensorflow``: the same ``rank``, ``size``, ``shutdown`` and ``HorovodInternalError``).
The scenario acts at a step:

* ``grow_shrink``: rank 0 rewrites the hosts file (``OUT_DIR/hosts``, which the discovery script
  prints) to four hosts at step 2, then, once the world has 4 ranks, to the last two only (the
  hosts of ranks 0 and 1 go);
* ``two_failures``: the worker on 127.0.0.2 raises at step 3, the one on 127.0.0.3 is SIGKILLed
  at step 6;
* ``kill_one``: the worker on 127.0.0.2 is SIGKILLed at step 3;
* ``cooldown``: the worker on 127.0.0.2 raises at step 3; the survivor waits for the host to come
  back from the blacklist;
* ``lost_world``: at step 3 the worker on 127.0.0.2 leaves its world and raises
  ``HorovodInternalError``, as a collective that timed out does: every worker lives, the world is
  lost, and the driver must make it again from the workers' word alone;
* ``lost_always``: every worker raises ``HorovodInternalError`` at step 3, every time: the world is
  lost again each time it is made;
* ``all_fail``: every worker raises at step 3;
* ``fail_each``: the worker on 127.0.0.1 raises at step 2, then the one on 127.0.0.2 at step 4;
* ``ssh_hosts``: two hosts named by ``ELASTIC_HOSTS`` (``A B``, reached over ssh); the job starts on
  A alone. Rank 0 adds B at step 2 (1 -> 2 workers), removes it at step 5 (2 -> 1), adds it again
  at step 8 (1 -> 2), and B's worker is SIGKILLed at step 11: B is lost and the job ends on A.

Each failure happens once (a marker file in OUT_DIR).
"""

import os
import signal
import time


def once(out_dir, name):
    """True the first time any worker of the job asks for ``name``."""
    try:
        os.close(os.open(os.path.join(out_dir, name), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def write_hosts(out_dir, lines):
    """Change what the discovery script prints (atomically)."""
    tmp = os.path.join(out_dir, "hosts.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, os.path.join(out_dir, "hosts"))


def hold(state):
    """Every rank: wait at this step for the driver's next world (HostsUpdatedInterrupt), 60 s at most."""
    for _ in range(1200):
        time.sleep(0.05)
        state.check_host_updates()


def act(hvd, scenario, out_dir, step, state):
    """Do what ``scenario`` does at ``step`` on this worker (``HOROVOD_HOSTNAME``)."""
    rank, size = hvd.rank(), hvd.size()
    host = os.environ["HOROVOD_HOSTNAME"]
    if scenario == "grow_shrink":
        # step 2 on 2 ranks comes twice: in the first world (grow there) and in the last, made after
        # the shrink, which must go on (every rank of it sees the shrink's marker)
        if size == 2 and step == 2 and not os.path.exists(os.path.join(out_dir, "shrink")):
            if rank == 0 and once(out_dir, "grow"):
                write_hosts(out_dir, ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"])
            hold(state)  # until the new workers joined
        elif size == 4:
            if rank == 0 and once(out_dir, "shrink"):
                write_hosts(out_dir, ["127.0.0.3:1", "127.0.0.4:1"])
            hold(state)  # until the hosts of ranks 0 and 1 are gone
    elif scenario == "two_failures":
        if step == 3 and host == "127.0.0.2" and once(out_dir, "fail-exc"):
            raise ValueError("injected failure on 127.0.0.2")
        if step == 6 and host == "127.0.0.3" and once(out_dir, "fail-kill"):
            os.kill(os.getpid(), signal.SIGKILL)
    elif scenario == "cooldown":
        if step == 3 and host == "127.0.0.2" and once(out_dir, "fail-exc"):
            raise ValueError("injected failure on 127.0.0.2")
        if step >= 3 and size == 1:
            hold(state)  # until 127.0.0.2's cooldown ends and its new worker joins
    elif scenario == "kill_one":
        if step == 3 and host == "127.0.0.2" and once(out_dir, "fail-kill"):
            os.kill(os.getpid(), signal.SIGKILL)
    elif scenario == "lost_world":
        if step == 3 and host == "127.0.0.2" and once(out_dir, "lost"):
            hvd.shutdown()
            raise hvd.HorovodInternalError("injected: a collective of this world timed out")
    elif scenario == "lost_always":
        if step == 3:
            raise hvd.HorovodInternalError(f"injected: a collective failed on {host}")
    elif scenario == "all_fail":
        if step == 3:
            raise ValueError(f"injected failure on {host}")
    elif scenario == "fail_each":
        if step == 2 and host == "127.0.0.1" and once(out_dir, "fail-1"):
            raise ValueError("injected failure on 127.0.0.1")
        if step == 4 and host == "127.0.0.2" and once(out_dir, "fail-2"):
            raise ValueError("injected failure on 127.0.0.2")
    elif scenario == "ssh_hosts":
        a, b = os.environ.get("ELASTIC_HOSTS", "").split()
        if size == 1 and step in (2, 8):
            if rank == 0 and once(out_dir, f"add-{step}"):
                write_hosts(out_dir, [f"{a}:1", f"{b}:1"])
            hold(state)  # until B's new worker joined
        elif size == 2 and step == 5:
            if rank == 0 and once(out_dir, "remove"):
                write_hosts(out_dir, [f"{a}:1"])
            hold(state)  # until B's worker left
        elif size == 2 and step == 11 and host == b and once(out_dir, "lose"):
            os.kill(os.getpid(), signal.SIGKILL)
    elif scenario != "none":
        raise SystemExit(f"unknown scenario {scenario!r}")
