"""The launchers with real processes: ringpipe launch (agent, mp, mpi), torchrun, mpirun; failures."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringpipe.ports import free_port

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CHECKS = str(SCRIPTS / "comm_checks.py")
HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None
RINGPIPE = [sys.executable, "-m", "ringpipe.cli"]


def run(cmd, timeout=90, **env):
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    full_env.pop("RINGPIPE_BACKEND", None)
    full_env.update(env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


def assert_ok(out, n, launcher):
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("comm-checks ok") == n, out.stdout
    assert out.stdout.count(f"launcher={launcher}") == n


@pytest.mark.timeout(120)
def test_ringpipe_launch_agent_prefixes_ranks(tmp_path):
    out = run([*RINGPIPE, "launch", "-n", "3", CHECKS])
    assert_ok(out, 3, "torchrun")
    for r in range(3):
        assert f"[{r}]:comm-checks ok rank={r} size=3" in out.stdout


@pytest.mark.timeout(120)
def test_ringpipe_launch_writes_nothing_in_the_working_directory(tmp_path):
    """The agent's log files live in the system temporary folder while the ranks run, then go."""
    work, temp = tmp_path / "work", tmp_path / "temp"
    work.mkdir()
    temp.mkdir()
    script = tmp_path / "list_cwd.py"
    script.write_text("import os\nprint('cwd-holds', sorted(os.listdir('.')))\n")
    out = subprocess.run([*RINGPIPE, "launch", "-n", "2", str(script)], cwd=work, capture_output=True,
                         text=True, timeout=90, env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(temp)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("cwd-holds []") == 2, out.stdout
    assert list(work.iterdir()) == [] and list(temp.iterdir()) == []


@pytest.mark.timeout(120)
def test_ringpipe_launch_module():
    out = subprocess.run([*RINGPIPE, "launch", "-n", "2", "-m", "scripts.comm_checks", "--flag-for-script"],
                         capture_output=True, text=True, timeout=90, cwd=SCRIPTS.parent,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert_ok(out, 2, "torchrun")


@pytest.mark.timeout(120)
def test_ringpipe_launch_mp_mode():
    out = run([*RINGPIPE, "launch", "-n", "2", "--mode", "mp", CHECKS])
    assert_ok(out, 2, "ringpipe-mp")  # torchrun's variables, but not started by torchrun
    assert "[1]:comm-checks ok rank=1" in out.stdout


@pytest.mark.timeout(120)
def test_torchrun():
    out = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}", CHECKS])
    assert_ok(out, 2, "torchrun")


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_mpirun_with_gloo_rendezvous_through_mpi():
    from ringpipe.launch import mpirun_command

    # No MASTER_ADDR: rank 0's address and a free port travel through mpi4py.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run(mpirun_command(2, [sys.executable, CHECKS]), capture_output=True, text=True,
                         timeout=110, env=dict(env, RINGPIPE_BACKEND="gloo"))
    assert_ok(out, 2, "openmpi")


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_ringpipe_launch_mpi_backend():
    out = run([*RINGPIPE, "launch", "-n", "2", "--backend", "mpi", CHECKS])
    assert_ok(out, 2, "openmpi")


REINIT = """
import torch, ringpipe as hvd
for round_ in range(3):
    hvd.init()
    t = torch.full((2,), float(hvd.rank() + 1))
    total = hvd.allreduce(t, op=hvd.Sum)
    names = hvd.allgather_object(hvd.rank())
    print(f"round {round_} rank {hvd.rank()} sum {total.tolist()} ranks {names}", flush=True)
    hvd.shutdown()
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["agent", "mp"])
def test_a_world_made_again_in_one_process_is_a_new_world(tmp_path, mode):
    """shutdown() then init(), as an elastic reset does: the new world must not read the old one's keys."""
    script = tmp_path / "reinit.py"
    script.write_text(REINIT)
    out = run([*RINGPIPE, "launch", "--mode", mode, "-n", "2", str(script)], timeout=200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for round_ in range(3):
        for r in range(2):
            assert f"round {round_} rank {r} sum [3.0, 3.0] ranks [0, 1]" in out.stdout, out.stdout


@pytest.mark.timeout(120)
def test_world_left_open_is_destroyed_at_exit():
    """A script that ends without shutdown_world: ringpipe's exit handler destroys the gloo group
    while the interpreter is intact (left to finalization, gloo's threads can abort the process)."""
    out = run([*RINGPIPE, "launch", "-n", "2", str(SCRIPTS / "exit_cleanup.py")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("group_alive=False") == 2, out.stdout


@pytest.mark.timeout(120)
def test_plain_ddp_script_runs_unchanged():
    out = run([*RINGPIPE, "launch", "-n", "2", str(SCRIPTS / "plain_ddp.py")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("plain-ddp ok") == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, signal_env, cause", [
    ("agent", {}, "rank 1 failed with exit code 3"),
    ("agent", {"DIE_SIGNAL": "1"}, "rank 1 failed with signal SIGKILL"),
    ("mp", {}, "rank 1 failed with exit code 3"),
])
def test_dead_rank_stops_the_job(mode, signal_env, cause):
    t0 = time.monotonic()
    out = run([*RINGPIPE, "launch", "-n", "3", "--mode", mode, str(SCRIPTS / "die.py")], **signal_env)
    assert out.returncode != 0
    if mode == "agent":  # the failed rank's status, as mpirun returns it
        assert out.returncode == (128 + 9 if signal_env else 3), out.stderr[-2000:]
    assert cause in out.stderr, out.stderr[-3000:]
    assert time.monotonic() - t0 < 60  # the survivors block in a barrier: they must be stopped, not awaited
    left = subprocess.run(["pgrep", "-f", str(SCRIPTS / "die.py")], capture_output=True, text=True)
    assert left.stdout.strip() == "", "orphan processes left behind"


@pytest.mark.timeout(240)  # five launcher start-ups, each refused before any rank starts
def test_bad_launch_arguments():
    out = run([*RINGPIPE, "launch", "--backend", "tcp", CHECKS])
    assert out.returncode != 0 and "valid: gloo, nccl, mpi" in out.stderr
    out = run([*RINGPIPE, "launch", "--nnodes", "2", "--node-rank", "2", CHECKS])
    assert out.returncode != 0 and "--node-rank 2 must be in" in out.stderr
    out = run([*RINGPIPE, "launch", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "nohostport", CHECKS])
    assert out.returncode != 0 and "--rdzv-endpoint 'nohostport' must be HOST:PORT" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "master-port" not in out.stderr
    out = run([*RINGPIPE, "launch", "--master-port", "99999", CHECKS])
    assert out.returncode != 0 and "--master-port 99999 is not a TCP port" in out.stderr
    assert "Traceback" not in out.stderr
    out = run([*RINGPIPE, "launch", "-n", "2", "no_such_script.py"])
    assert out.returncode != 0 and "no such script: no_such_script.py" in out.stderr
    assert "Traceback" not in out.stderr and "[0]" not in out.stderr  # refused before any rank started


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["agent", "mp", pytest.param("mpi", marks=pytest.mark.skipif(not HAVE_MPI,
                                                                                           reason="needs mpirun"))])
def test_output_filename_writes_each_ranks_lines_to_its_files_as_horovodrun(tmp_path, how):
    """horovodrun's --output-filename DIR: DIR/rank.<R>/stdout and stderr, R zero-padded to the
    last rank's width; the lines still reach the console, prefixed with the rank."""
    script = tmp_path / "talk.py"
    script.write_text("import os, sys\nr = os.environ['RANK']\nprint('out of', r)\n"
                      "print('err of', r, file=sys.stderr)\n")
    mode = {"agent": [], "mp": ["--mode", "mp"], "mpi": ["--backend", "mpi"]}[how]
    out = run([*RINGPIPE, "launch", "-n", "2", *mode, "--output-filename", str(tmp_path / "logs"), str(script)],
              timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(2):
        assert f"[{r}]:out of {r}" in out.stdout
        assert (tmp_path / "logs" / f"rank.{r}" / "stdout").read_text().splitlines() == [f"[{r}]:out of {r}"]
        assert f"[{r}]:err of {r}" in (tmp_path / "logs" / f"rank.{r}" / "stderr").read_text().splitlines()


def test_output_filename_pads_ranks_to_the_width_of_the_last():
    import tempfile

    from ringpipe.launch.relay import OutputRelay

    with tempfile.TemporaryDirectory() as d:
        relay = OutputRelay(1, rank_of=lambda slot: 7, output_dir=d, world_size=12)
        with open(os.path.join(relay.dir, "out-0"), "w") as pipe:
            pipe.write("hello\n")
        relay.close()
        assert Path(d, "rank.07", "stdout").read_text() == "[7]:hello\n"
