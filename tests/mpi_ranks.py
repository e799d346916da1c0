"""The ``mpirun`` rank programs of the MPI tests, run in few jobs: one ``mpirun`` per world size.

Each test (or module fixture) marked ``mpi`` under ``tests/ranks`` and ``tests/e2e/pipeline`` launched a program of its own on ``mpirun`` (10-25 s
each, mostly the interpreter's, torch's and MPI's start-up). :data:`PROGRAMS` names those programs
(the argv and environment each test gave it), :data:`JOBS` folds them into one job per world size,
and :class:`MPIJobs` (the session fixture ``mpi_jobs`` of ``tests/conftest.py``) launches a job the first
time a test asks for one of its programs, running them in turn in each rank
(``tests/scripts/mpi_jobs.py``, which shuts ringpipe down between them). A test then asserts on
its own program's stdout and folder as it did on its own launch's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

TESTS = Path(__file__).resolve().parent
EXAMPLE = TESTS.parent / "examples" / "horovod_mnist_style.py"
HAVE_MPI = shutil.which("mpirun") is not None and find_spec("mpi4py") is not None
#: Where a program's argv or environment names its folder (its results, the test's ``tmp_path`` before).
OUT = "{out}"

#: name -> (ranks, argv after ``python``, environment): each what its test launched on its own before.
PROGRAMS: dict[str, tuple[int, tuple[str, ...], dict[str, str]]] = {
    **{f"collectives-{n}": (n, (str(TESTS / "ranks/collectives/test_collectives.py"),), {}) for n in (2, 3, 4)},
    "adasum": (4, (str(TESTS / "ranks/collectives/test_adasum.py"),), {}),
    "comm_dtypes": (2, (str(TESTS / "ranks/comm/test_comm_dtypes.py"),), {}),
    **{f"comm-{n}": (n, (str(TESTS / "scripts/comm_checks.py"),), {"RINGPIPE_BACKEND": "mpi"}) for n in (2, 3)},
    "consistency": (2, (str(TESTS / "scripts/consistency_cases.py"),), {"RINGPIPE_BACKEND": "mpi", "CASES_DIR": OUT}),
    "api": (2, ("-c", "import ranks.api.test_api as t; t.mpi_main()"), {}),
    "example": (2, (str(EXAMPLE), "--epochs", "2", "--fp16-allreduce"),
                {"RINGPIPE_BACKEND": "mpi", "RINGPIPE_TIMELINE": f"{OUT}/timeline.json"}),
    "dp_features": (2, ("-c", f"import ranks.dp.test_dp_features as t; t.mpi_broadcasts({OUT!r})"), {}),
    "dp_join": (2, ("-c", f"import ranks.dp.test_dp_join as t; t.mpi_main({OUT!r})"), {}),
    "dp_optimizer": (2, ("-c", f"import ranks.dp.test_dp_optimizer as t; t.mpi_main({OUT!r})"), {}),
    "hvd_dtypes": (3, (str(TESTS / "scripts/hvd_dtypes.py"),), {"RINGPIPE_BACKEND": "mpi", "CASES_DIR": OUT}),
    "hvd_mpi_comm": (3, (str(TESTS / "scripts/hvd_mpi_comm.py"), OUT), {"RINGPIPE_BACKEND": "mpi"}),
    "pipeline": (2, (str(TESTS / "e2e/pipeline/test_pipeline_mpi.py"), f"{OUT}/weights.pt"), {"RINGPIPE_BACKEND": "mpi"}),
    "stall": (3, (str(TESTS / "scripts/stall_late_rank.py"),),
              {"RINGPIPE_BACKEND": "mpi", "RINGPIPE_STALL_CHECK_SECONDS": "1"}),
}
#: The programs that share one ``mpirun``, by world size (each was a launch of its own before).
JOBS: dict[int, tuple[str, ...]] = {}
for _name, (_n, _argv, _env) in PROGRAMS.items():
    JOBS[_n] = (*JOBS.get(_n, ()), _name)
#: Seconds a job may run: under the timeout of the tests whose fixture launches it.
JOB_TIMEOUT = 580


@dataclass(frozen=True)
class Run:
    """What one program of a job printed on stdout (every rank's, in rank order) and its folder."""

    stdout: str
    folder: Path


class MPIJobs:
    """Each :data:`JOBS` entry launched once, the first time a test asks for one of its programs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.jobs: dict[int, subprocess.CompletedProcess[str]] = {}

    def folder(self, name: str) -> Path:
        return self.root / name

    def _launch(self, n: int) -> subprocess.CompletedProcess[str]:
        from ringpipe.launch import mpirun_command

        programs = []
        for name in JOBS[n]:
            _, argv, env = PROGRAMS[name]
            out = str(self.folder(name))
            self.folder(name).mkdir(parents=True)
            programs.append({"name": name, "folder": out, "argv": [a.replace(OUT, out) for a in argv],
                             "env": {k: v.replace(OUT, out) for k, v in env.items()}})
        spec = self.root / f"job{n}.json"
        spec.write_text(json.dumps(programs))
        # the caller's PYTHONPATH first (a worktree's src), then the tests' folders the programs import from
        path = [p for p in (os.environ.get("PYTHONPATH", ""), str(TESTS), str(TESTS / "ranks")) if p]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
        cmd = mpirun_command(n, [sys.executable, str(TESTS / "scripts" / "mpi_jobs.py"), str(spec)])
        try:
            return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired as e:  # kept as a failed job: the job's other tests do not launch it again
            said = [b.decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (e.stdout, e.stderr)]
            return subprocess.CompletedProcess(cmd, -9, said[0], said[1] + f"\nmpi_jobs: the job ran past {JOB_TIMEOUT} s")

    def run(self, name: str) -> Run:
        """``name``'s run in its job (launched now if no test asked for its job yet); fails naming it if it failed."""
        n = PROGRAMS[name][0]
        if n not in self.jobs:
            self.jobs[n] = self._launch(n)
        proc = self.jobs[n]
        folder = self.folder(name)
        said = proc.stdout + proc.stderr
        # a failed job fails the program it names and those after it (they did not finish); a failure
        # that names no program fails every program of the job
        failed = proc.returncode != 0 and (f"mpi_jobs: {name} failed" in said or "mpi_jobs: " not in said
                                           or said.count(f"mpi_jobs: {name} done") < n)
        assert not failed, (f"{name} failed in its job ({', '.join(JOBS[n])}; exit {proc.returncode}):\n"
                            + self.stdout(name)[-3000:] + proc.stdout[-3000:] + proc.stderr[-3000:])
        return Run(self.stdout(name), folder)

    def stdout(self, name: str) -> str:
        files = [self.folder(name) / f"stdout.rank{r}" for r in range(PROGRAMS[name][0])]
        return "".join(f.read_text() for f in files if f.exists())
