"""What every ranks sees under ringpipe launch, in every mode, with real processes.

The same variables (torch's and horovodrun's), the backend the launcher was given, output in
whole lines each prefixed once with its rank, the program's arguments exactly as typed, and the
launch spellings of torchrun, horovodrun and mpirun.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None
RINGPIPE = [sys.executable, "-m", "ringpipe.cli"]
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
MODES = [
    pytest.param([], id="agent"),
    pytest.param(["--mode", "mp"], id="mp"),
    pytest.param(["--backend", "mpi"], id="mpi", marks=pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")),
]

CONTRACT = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
            "HOROVOD_CROSS_SIZE", "RINGPIPE_BACKEND"]

SHOW = f"""
import json, os, sys
import ringpipe as rp
env = {{k: os.environ.get(k) for k in {CONTRACT!r}}}
comm = rp.init_world()
for i in range(40):  # lines written in pieces, unbuffered, by every rank at once
    sys.stdout.write("ab")
    sys.stdout.write("cd" * 50)
    sys.stdout.write("\\n")
print("contract " + json.dumps(dict(env, backend=comm.backend, argv=sys.argv[1:])), flush=True)
rp.shutdown_world()
"""


def run(cmd, timeout=120, **kw):
    env = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


def contracts(stdout):
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"^\[(\d+)\]:contract (.*)$", line)
        if m:
            out[int(m.group(1))] = json.loads(m.group(2))
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_same_environment_and_whole_prefixed_lines(tmp_path, mode):
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    out = run([*RINGPIPE, "launch", "-n", "2", *mode, str(script), "-q", "-p", "x y"])
    assert out.returncode == 0, out.stderr[-3000:]
    backend = "mpi" if "mpi" in mode else "gloo"
    seen = contracts(out.stdout)
    assert sorted(seen) == [0, 1], out.stdout[-3000:]
    for rank, env in seen.items():
        assert env["argv"] == ["-q", "-p", "x y"]
        assert env["backend"] == backend and env["RINGPIPE_BACKEND"] == backend  # init_world() follows the launcher
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(rank), "2", str(rank), "2")
        assert env["GROUP_RANK"] == "0" and env["MASTER_ADDR"] and env["MASTER_PORT"].isdigit()
        assert (env["HOROVOD_RANK"], env["HOROVOD_SIZE"], env["HOROVOD_LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"],
                env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == (str(rank), "2", str(rank), "2", "0", "1")
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"]
    # Every line is whole and carries one prefix, the rank's, in the same style in every mode.
    pieces = [line for line in out.stdout.splitlines() if "contract" not in line]
    assert len(pieces) == 80, out.stdout[-2000:]
    for line in pieces:
        assert re.fullmatch(r"\[[01]\]:ab(cd){50}", line), line


@pytest.mark.timeout(150)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_plain_torch_distributed_program_runs_under_mpi():
    """A torch.distributed program reading RANK/WORLD_SIZE/MASTER_* (env://) runs under --backend mpi too."""
    out = run([*RINGPIPE, "launch", "-n", "2", "--backend", "mpi", str(SCRIPTS / "plain_ddp.py")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("plain-ddp ok") == 2


@pytest.mark.timeout(150)
def test_horovodrun_and_mpirun_spellings(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    out = run([*RINGPIPE, "launch", "-np", "2", "-H", "localhost:2", "python", "-u", "-X", "dev", str(script), "z"])
    assert out.returncode == 0, out.stderr[-3000:]
    seen = contracts(out.stdout)
    assert sorted(seen) == [0, 1] and seen[0]["argv"] == ["z"]


@pytest.mark.timeout(60)
def test_unknown_option_is_refused_before_any_rank_starts(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    out = run([*RINGPIPE, "launch", "--nproc_per_nod=3", str(script)])
    assert out.returncode == 2
    assert "unknown launcher option '--nproc_per_nod'; did you mean --nproc_per_node?" in out.stderr
    assert "[0]" not in out.stdout + out.stderr and "Traceback" not in out.stderr


@pytest.mark.timeout(150)
def test_module_arguments_reach_the_module_exactly(tmp_path):
    """`-m pytest -q -p no:cacheprovider FILE`: pytest gets its options in order (-p keeps its value)."""
    (tmp_path / "test_x.py").write_text(
        "import os\n\ndef test_rank():\n    assert os.environ['WORLD_SIZE'] == '2'\n")
    out = run([*RINGPIPE, "launch", "-n", "2", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_x.py"],
              cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("1 passed") == 2
    assert not (tmp_path / ".pytest_cache").exists()  # -p no:cacheprovider reached pytest
