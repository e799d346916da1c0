"""Two ranks of a pipeline benchmark over gloo (``spawn``) or over ringpipe's MPI backend (``mpirun``).

``--backend gloo`` (the default) starts the worker on 2 processes with :func:`ringpipe.launch.spawn`,
as before. ``--backend mpi`` starts the same worker under ``mpirun -n 2`` on ringpipe's MPI
communicator (mpi4py over Open MPI): its messages progress in the calling thread, so there is
no I/O thread beside the compute (gloo has one, ``gloo_tcp_loop``). Open MPI busy-polls while a
rank waits (it spins its core in ``MPI_Wait``); ``--mca mpi_yield_when_idle=1`` makes the
polling loop yield the core to other runnable threads (it still polls). The parameters travel
to the ranks pickled in a file; each rank runs ``worker(comm, *args)`` and rank 0 writes every
rank's result back, as ``spawn`` returns them.

Run as a script, this module is what each rank runs under ``mpirun``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["add_backend_args", "backend_line", "check_backend_args", "run_two_ranks"]

ENV = {"OMP_NUM_THREADS": "1"}
BENCHMARKS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_backend_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--backend", choices=("gloo", "mpi"), default="gloo",
                    help="ringpipe's transport: gloo (2 processes by spawn) or mpi (mpi4py under mpirun -n 2)")
    ap.add_argument("--mca", action="append", default=[], metavar="KEY=VALUE",
                    help="an Open MPI parameter for --backend mpi, e.g. mpi_yield_when_idle=1 (repeatable)")


def check_backend_args(args: argparse.Namespace) -> list[str]:
    """The ``mpirun`` options that ``--mca`` asks for; a clear error for options that do not fit."""
    if args.backend != "mpi":
        if args.mca:
            raise SystemExit("--mca applies to --backend mpi only")
        return []
    extra: list[str] = []
    for kv in args.mca:
        key, eq, value = kv.partition("=")
        if not eq or not key:
            raise SystemExit(f"--mca {kv!r}: give KEY=VALUE, e.g. mpi_yield_when_idle=1")
        extra += ["--mca", key, value]
    return extra


def backend_line(args: argparse.Namespace) -> str:
    """The transport of the run, in words, for the report's header."""
    if getattr(args, "backend", "gloo") != "mpi":
        return "gloo (2 processes, spawn)"
    mca = ", ".join(args.mca) if args.mca else "Open MPI defaults (busy-polling waits)"
    return f"MPI (mpi4py, mpirun -n 2; MCA: {mca})"


def run_two_ranks(args: argparse.Namespace, worker: Callable[..., Any], wargs: tuple[Any, ...]) -> list[Any]:
    """``worker(comm, *wargs)`` on 2 ranks over ``args.backend``; the per-rank results, rank 0 first."""
    extra = check_backend_args(args)
    if args.backend != "mpi":
        from ringpipe.launch import spawn

        return spawn(worker, 2, args=wargs, env=ENV)
    from ringpipe.launch import mpirun_command

    try:
        cmd_head = mpirun_command(2, [], extra=extra, tag_output=False)
    except FileNotFoundError as exc:
        raise SystemExit(f"--backend mpi: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="ringpipe-bench-") as tmp:
        job, out = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "out.pkl")
        module = worker.__module__
        if module == "__main__":  # a worker of the script that was run: import it by its file's name
            module = os.path.splitext(os.path.basename(sys.modules["__main__"].__file__ or ""))[0]
        with open(job, "wb") as f:
            pickle.dump((module, worker.__name__, wargs), f)
        # benchmarks/ (lib and the entry scripts) and the script's own folder, for the ranks to import the worker
        here = [BENCHMARKS, os.path.dirname(os.path.abspath(sys.modules["__main__"].__file__ or BENCHMARKS))]
        env = dict(os.environ, RINGPIPE_BACKEND="mpi", **ENV)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*here, env.get("PYTHONPATH")]))
        run = subprocess.run([*cmd_head, sys.executable, os.path.abspath(__file__), job, out], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if run.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"--backend mpi: mpirun exited with {run.returncode}:\n{run.stdout[-6000:]}")
        if run.stdout.strip():
            print(run.stdout.rstrip(), file=sys.stderr)
        with open(out, "rb") as f:
            return pickle.load(f)


def _rank_main(job: str, out: str) -> None:
    from ringpipe.comm import init_world, shutdown_world

    with open(job, "rb") as f:
        module, name, wargs = pickle.load(f)
    worker = getattr(importlib.import_module(module), name)
    comm = init_world("mpi")
    if comm.backend != "mpi" or comm.size != 2:
        raise SystemExit(f"expected 2 ranks over mpi, got {comm.size} over {comm.backend}")
    result = worker(comm, *wargs)
    results = comm.allgather_object(result)
    if comm.rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)
    comm.barrier()
    shutdown_world()


if __name__ == "__main__":
    sys.path.insert(0, BENCHMARKS)
    _rank_main(sys.argv[1], sys.argv[2])
