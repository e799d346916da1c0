"""Faults around ringpipe launch, with real processes: no rank outlives its launcher, an exception ends the job, restarts.

* however the launcher ends (SIGKILL to it alone, or to its whole process group) no rank is
  left running, in every mode (torch's agent, --mode mp, --backend mpi) and with two nodes;
* an uncaught exception on one rank ends the whole job on every backend, with that rank's
  traceback, its exit status and the launcher naming it first (under plain mpirun too);
* --max-restarts N restarts the ranks after one is killed, and the job then finishes.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringpipe.ports import free_port

HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None
RINGPIPE = [sys.executable, "-m", "ringpipe.cli"]
MODES = [
    pytest.param([], id="agent"),
    pytest.param(["--mode", "mp"], id="mp"),
    pytest.param(["--backend", "mpi"], id="mpi", marks=pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")),
]

# Every rank writes its pid (whole: written aside, then renamed, so a reader never sees an empty
# file), then communicates forever.
FOREVER = """
import os, sys, time, pathlib
import ringpipe as rp
comm = rp.init_world()
out = pathlib.Path(sys.argv[1], f"pid-{comm.rank}")
out.with_suffix(".part").write_text(str(os.getpid()))
os.replace(out.with_suffix(".part"), out)
while True:
    comm.barrier()
    time.sleep(0.2)
"""

# Rank 1 raises while the others wait for it in a collective.
RAISES = """
import ringpipe as rp
comm = rp.init_world()
print(f"rank {comm.rank} on {comm.backend}", flush=True)
comm.barrier()
if comm.rank == 1:
    import time
    print(f"raising at {time.time():.3f}", flush=True)
    raise ValueError("boom from rank 1")
comm.barrier()
"""


def env(**extra):
    out = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
    out.update(OMP_NUM_THREADS="1", **extra)
    return out


def alive(marker):
    """Processes (not zombies) whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state not in ("Z", "X"):
            found.append((int(entry.name), cmdline))
    return found


def wait_until(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {seconds} s: {what}")


def start(args, tmp_path, name):
    script = tmp_path / name
    script.write_text(FOREVER)
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - the launcher writes it while the test runs
    # A terminal's foreground job takes Ctrl-C even when this run was started with SIGINT ignored
    # (a background job of a non-interactive shell): give the launcher the default disposition.
    proc = subprocess.Popen([*RINGPIPE, "launch", *args, str(script), str(tmp_path)], stdout=log,
                            stderr=subprocess.STDOUT, env=env(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, script


def kill_and_check(proc, script, tmp_path, ranks, target):
    try:
        wait_until(lambda: all((tmp_path / f"pid-{r}").exists() for r in ranks) or proc.poll() is not None,
                   120, "every rank started")
        assert proc.poll() is None, (tmp_path / f"{script.name}.log").read_text()[-3000:]
        pids = [int((tmp_path / f"pid-{r}").read_text()) for r in ranks]
        assert all(pid in [p for p, _ in alive(str(script))] for pid in pids)
        if target == "launcher":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_until(lambda: not alive(str(script)), 30, f"every process of the job ended: {alive(str(script))}")
    finally:
        for pid, _ in alive(str(script)):  # leave nothing behind even when the test fails
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("target", ["launcher", "group"])
@pytest.mark.parametrize("mode", MODES)
def test_no_rank_outlives_its_launcher(tmp_path, mode, target):
    """SIGKILL to the launcher (as a crash or the OOM killer does) or to its process group (as a
    batch scheduler or kill -9 -PGID does): every rank, and mpirun, end too."""
    proc, script = start(["-n", "2", *mode], tmp_path, "forever.py")
    kill_and_check(proc, script, tmp_path, [0, 1], target)


@pytest.mark.timeout(240)
def test_no_rank_outlives_its_launcher_on_two_nodes(tmp_path):
    """Two nodes (two launchers on this machine): killing node 1's launcher ends its rank; node 0's
    rank then loses its peer, fails, and node 0's launcher ends with nothing left."""
    endpoint = f"127.0.0.1:{free_port()}"
    script = tmp_path / "forever.py"
    script.write_text(FOREVER)
    procs = []
    for node in (0, 1):
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 - written while the test runs
        procs.append(subprocess.Popen(
            [*RINGPIPE, "launch", "-n", "1", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", endpoint,
             str(script), str(tmp_path)], stdout=log, stderr=subprocess.STDOUT, env=env(), start_new_session=True))
    try:
        wait_until(lambda: (tmp_path / "pid-0").exists() and (tmp_path / "pid-1").exists(), 150, "both ranks started")
        os.kill(procs[1].pid, signal.SIGKILL)
        assert procs[0].wait(timeout=90) != 0
        wait_until(lambda: not alive(str(script)), 30, f"every process ended: {alive(str(script))}")
        report = (tmp_path / "node0.log").read_text()
        assert "rank 0 failed" in report, report[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for pid, _ in alive(str(script)):
            os.kill(pid, signal.SIGKILL)


def check_exception_report(out, backend):
    err = out.stderr
    assert out.returncode == 1, err[-3000:]
    # The failed rank's own traceback, its lines prefixed once with its rank.
    assert "[1]:Traceback (most recent call last):" in err, err[-3000:]
    assert '[1]:    raise ValueError("boom from rank 1")' in err
    assert "[1]:ValueError: boom from rank 1" in err
    assert "[rank1]" not in err and "[1]:[1]" not in err
    # The launcher names it first, with its status and the exception.
    report = [line for line in err.splitlines() if line.startswith("ringpipe launch:")]
    assert report[0] == "ringpipe launch: rank 1 failed with exit code 1: ValueError: boom from rank 1", report
    assert all("rank 0" not in line or "losing its connection to rank 1" in line for line in report), report
    assert f"rank 0 on {backend}" in out.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_an_exception_on_one_rank_ends_the_job(tmp_path, mode):
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    out = subprocess.run([*RINGPIPE, "launch", "-n", "2", *mode, str(script)], capture_output=True, text=True,
                         timeout=90, env=env())
    raised = float(out.stdout.split("raising at ")[1].split()[0])
    print(f"job ended {time.time() - raised:.1f} s after the exception")  # a figure for the record, not a check
    check_exception_report(out, "mpi" if "mpi" in mode else "gloo")
    assert not alive(str(script))


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_an_exception_aborts_a_plain_mpirun_job(tmp_path):
    """Without ringpipe launch: init_world's MPI world prints the traceback and aborts the job
    (as python -m mpi4py does) instead of hanging in MPI's finalisation."""
    from ringpipe.launch import mpirun_command

    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    out = subprocess.run(mpirun_command(2, [sys.executable, str(script)]), capture_output=True, text=True,
                         timeout=90, env=env(RINGPIPE_BACKEND="mpi"))
    assert out.returncode != 0
    assert "ValueError: boom from rank 1" in out.stderr, out.stderr[-3000:]
    # Open MPI reports the abort (when rank 0's departure watchdog aborts at the same moment, its
    # help text can come out garbled as a show_help error; the job is aborted all the same)
    text = out.stderr + out.stdout
    assert "MPI_ABORT was invoked on rank" in text or "show_help" in text, text[-3000:]
    assert not alive(str(script))


RESTARTS = """
import os, signal
import torch
import ringpipe as rp
comm = rp.init_world()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
comm.barrier()
if attempt == 0 and comm.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
total = comm.allreduce(torch.tensor([float(comm.rank + 1)]))
print(f"finished attempt={attempt} rank={comm.rank} total={total.item():g}", flush=True)
"""


@pytest.mark.timeout(240)
def test_max_restarts_restarts_the_ranks_after_a_kill(tmp_path):
    script = tmp_path / "restarts.py"
    script.write_text(RESTARTS)
    out = subprocess.run([*RINGPIPE, "launch", "-n", "2", "--max-restarts", "2", str(script)], capture_output=True,
                         text=True, timeout=200, env=env())
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):  # 1 + 2, on the second attempt
        assert f"[{rank}]:finished attempt=1 rank={rank} total=3" in out.stdout, out.stdout
    assert "attempt=0" not in out.stdout
    # Without restarts the same kill ends the job, naming the killed rank.
    out = subprocess.run([*RINGPIPE, "launch", "-n", "2", str(script)], capture_output=True, text=True,
                         timeout=200, env=env())
    assert out.returncode == 128 + signal.SIGKILL
    assert "ringpipe launch: rank 1 failed with signal SIGKILL" in out.stderr, out.stderr[-3000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, mode):
    """SIGINT to the launcher's process group, as a terminal's Ctrl-C sends it: one line, status 130, nothing left."""
    proc, script = start(["-n", "2", *mode], tmp_path, "forever.py")
    try:
        wait_until(lambda: all((tmp_path / f"pid-{r}").exists() for r in (0, 1)) or proc.poll() is not None,
                   120, "every rank started")
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        wait_until(lambda: not alive(str(script)), 30, f"every process ended: {alive(str(script))}")
        log = (tmp_path / "forever.py.log").read_text()
        assert "ringpipe launch: interrupted by SIGINT; every rank was stopped" in log, log[-3000:]
        assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid, _ in alive(str(script)):
            os.kill(pid, signal.SIGKILL)
