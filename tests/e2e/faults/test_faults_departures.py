"""A rank that leaves is named, with real processes: the waiting rank's error says who left, how and what it last did.

Rank 1 makes one broadcast with rank 0 and then leaves (exits, raises, shuts its world down or
is killed) without making the allreduce rank 0 waits in. Rank 0 must fail — never hang — with an
error naming rank 1, the allreduce it waits in and rank 1's last call (the broadcast): a
``PeerDeparted`` on gloo, the same message before the MPI job is aborted under MPI (a rank
blocked in MPI cannot be interrupted). Under the Horovod-style API the error is a
``HorovodInternalError``, which ``hvd.elastic.run`` retries.
"""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from ringpipe.ports import free_port

HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None
RINGPIPE = [sys.executable, "-m", "ringpipe.cli"]

PROGRAM = """
import os, signal, sys, time
import torch
import ringpipe as rp
how = sys.argv[1]
comm = rp.init_world()
t = torch.ones(4)
comm.broadcast(t, 0)
if comm.rank == 1:
    time.sleep(0.5)
    if how == "exit":
        sys.exit(0)
    if how == "raise":
        raise ValueError("boom from rank 1")
    if how == "shutdown":
        rp.shutdown_world()
        time.sleep(30)
        sys.exit(0)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
t0 = time.monotonic()
try:
    comm.allreduce(t)
except rp.comm.departures.PeerDeparted as exc:
    print(f"rank 0 got {type(exc).__name__} after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
    print(f"departed={exc.rank}", flush=True)
    sys.exit(3)
print("rank 0 allreduce returned", flush=True)
"""

HOROVOD = """
import sys, time
import torch
import ringpipe as hvd
hvd.init()
t = hvd.broadcast(torch.ones(4), 0)
if hvd.rank() == 1:
    time.sleep(0.5)
    sys.exit(0)
try:
    hvd.allreduce(t)
except hvd.HorovodInternalError as exc:
    print(f"rank 0 got HorovodInternalError: {exc}", flush=True)
    sys.exit(3)
"""


def run(tmp_path, program, args, backend="gloo", timeout=150):
    script = tmp_path / "prog.py"
    script.write_text(program)
    env = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
    env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="")
    cmd = [*RINGPIPE, "launch", "-n", "2", *(["--backend", "mpi"] if backend == "mpi" else []), str(script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("how, said", [
    ("exit", "rank 1 exited"),
    ("raise", "rank 1 raised an uncaught ValueError: boom from rank 1"),
    ("shutdown", "rank 1 shut its world down"),
])
def test_gloo_waiting_rank_names_the_rank_that_left(tmp_path, how, said):
    code, out = run(tmp_path, PROGRAM, [how])
    assert code != 0, out
    assert "rank 0 allreduce returned" not in out
    assert "rank 0 got PeerDeparted" in out, out
    assert "rank 1 left the job while rank 0 waited in allreduce (16 B) on world" in out, out
    assert said in out, out
    assert "its last call was broadcast (16 B) on world" in out, out
    assert "departed=1" in out, out


def test_gloo_a_killed_rank_is_named_after_it_stops_beating(tmp_path):
    """SIGKILL leaves no word: the waiting rank names the rank whose record stopped changing.

    Started without a launcher (which would stop rank 0 as soon as rank 1 dies).
    """
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
        env.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, str(script), "kill"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        out0 = procs[0].communicate(timeout=150)[0]
        procs[1].wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == 3, out0
    assert "rank 1 left the job while rank 0 waited in allreduce (16 B) on world" in out0, out0
    assert "rank 1 stopped without a word (killed or crashed" in out0, out0
    assert "its last call was broadcast (16 B) on world" in out0, out0


@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
@pytest.mark.parametrize("how, said", [("exit", "rank 1 exited"), ("shutdown", "rank 1 shut its world down")])
def test_mpi_job_is_aborted_naming_the_rank_that_left(tmp_path, how, said):
    code, out = run(tmp_path, PROGRAM, [how], backend="mpi")
    assert code != 0, out
    assert "rank 0 allreduce returned" not in out
    assert "PeerDeparted: rank 1 left the job while rank 0 waited in allreduce (16 B) on world" in out, out
    assert said in out, out
    assert "its last call was broadcast (16 B) on world" in out, out
    assert "aborting the MPI job" in out, out


def test_horovod_api_raises_horovod_internal_error_naming_the_rank(tmp_path):
    code, out = run(tmp_path, HOROVOD, [])
    assert code != 0, out
    assert "rank 0 got HorovodInternalError" in out, out
    assert "rank 1 left the job while rank 0 waited in" in out and "rank 1 exited" in out, out


def test_a_normal_end_is_not_a_departure(tmp_path):
    """Ranks that finish at different times (one leaves while the other still computes) end cleanly."""
    program = """
import time
import torch
import ringpipe as rp
comm = rp.init_world()
comm.allreduce(torch.ones(2))
comm.barrier()
if comm.rank == 0:  # still computing when rank 1 has left: its departure record says it exited
    records = rp.comm.departures.current()
    deadline = time.monotonic() + 30
    while records.records().get(1, {}).get("state", "running") == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"rank 1 left: {records.records()[1]['state']}", flush=True)
    time.sleep(0.5)  # and its process ends (under MPI it waits in MPI_Finalize for this rank)
print(f"rank {comm.rank} done", flush=True)
"""
    for backend in ["gloo", *(["mpi"] if HAVE_MPI else [])]:
        code, out = run(tmp_path, program, [], backend=backend)
        assert code == 0, out
        assert "rank 1 left: exited" in out, out
        assert "PeerDeparted" not in out, out
