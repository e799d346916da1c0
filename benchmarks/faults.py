"""Fault injection: how long each rank takes to fail, and whether anything hangs or is left behind.

Each case starts 2 ranks under ``ringpipe launch`` (gloo, and ``--backend mpi`` where mpirun and
mpi4py exist) running a program in which rank 1 misbehaves after one good collective: another
shape, dtype, op or collective than rank 0, exits, raises, or is killed with SIGKILL. Every rank
prints when it saw its error; the table gives, per case, the time from the fault to the error
on each rank (``-``: the rank did not report one: it was stopped by the launcher or aborted),
whether the job hung (still running after ``--hang-s``), orphans (processes of the case left
after the launcher ended) and whether a wrong result was returned silently ("data lost").

    python benchmarks/faults.py [--repeats 1] [--hang-s 60] [--backends gloo,mpi]
    python benchmarks/faults.py --quick      # seconds: the shape mismatch over gloo
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import report  # noqa: E402

__all__ = ["main", "run_case"]

PROGRAM = r"""
import os, signal, sys, time
import torch
import ringpipe as rp
case = sys.argv[1]
comm = rp.init_world()
comm.allreduce(torch.ones(8))
r = comm.rank
t = torch.ones(1024)
fault = time.time()
print(f"FAULT {fault:.6f}", flush=True)
try:
    if r == 1 and case == "exit":
        sys.exit(0)
    if r == 1 and case == "exception":
        raise ValueError("injected")
    if r == 1 and case == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if case == "shape":
        out = comm.allreduce(torch.ones(1024 if r == 0 else 1000))
    elif case == "dtype":
        out = comm.allreduce(torch.ones(1024, dtype=torch.float32 if r == 0 else torch.float64))
    elif case == "op":
        out = comm.allreduce(torch.full((1024,), float(r + 1)), op="sum" if r == 0 else "max")
    elif case == "collective":
        out = comm.allreduce(t) if r == 0 else comm.allgather(t)
    else:
        out = comm.allreduce(t)
    print(f"RESULT rank {r} returned", flush=True)
except BaseException as exc:
    if isinstance(exc, SystemExit):
        raise
    print(f"ERROR rank {r} {time.time():.6f} {type(exc).__name__}", flush=True)
    raise
"""

CASES = ["shape", "dtype", "op", "collective", "exit", "exception", "sigkill"]


def run_case(case: str, backend: str, hang_s: float, workdir: Path) -> dict[str, str]:
    script = workdir / "fault_prog.py"
    script.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
    env.update(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2",
           *(["--backend", "mpi"] if backend == "mpi" else []), str(script), case]
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    hung = False
    try:
        out, _ = proc.communicate(timeout=hang_s)
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
    ended = time.time()
    time.sleep(1.0)
    orphans = _alive(str(script))
    fault = min([float(line.split()[1]) for line in out.splitlines() if "FAULT" in line] or [start])
    errors = {}
    for line in out.splitlines():
        if "ERROR rank" in line:
            parts = line.split("ERROR rank", 1)[1].split()
            errors[int(parts[0])] = (float(parts[1]) - fault, parts[2])
    returned = [line for line in out.splitlines() if "RESULT rank" in line]
    cells = {}
    for r in (0, 1):
        cells[f"rank {r}"] = f"{errors[r][0]:.2f} s {errors[r][1]}" if r in errors else "-"
    cells["job ends"] = "hang" if hung else f"{ended - fault:.1f} s, rc {proc.returncode}"
    cells["orphans"] = str(len(orphans))
    cells["data lost"] = "yes" if returned and case in ("shape", "dtype", "op", "collective") else "no"
    return cells


def _alive(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--hang-s", type=float, default=60.0)
    parser.add_argument("--backends", default="gloo,mpi")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--quick", action="store_true", help="seconds: the shape mismatch over gloo, once")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.backends, args.cases = 1, "gloo", "shape"
    report.header("faults", argv)
    backends = [b for b in args.backends.split(",") if b != "mpi" or shutil.which("mpirun")]
    print("| case | backend | rank 0 error | rank 1 error | job ends | orphans | data lost |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="ringpipe-faults-") as tmp:
        for case in args.cases.split(","):
            for backend in backends:
                for _ in range(args.repeats):
                    c = run_case(case, backend, args.hang_s, Path(tmp))
                    print(f"| {case} | {backend} | {c['rank 0']} | {c['rank 1']} | {c['job ends']} | "
                          f"{c['orphans']} | {c['data lost']} |", flush=True)
    report.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
