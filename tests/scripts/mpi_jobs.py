"""Several ``mpirun`` rank programs of the tests in one job: the interpreter's, torch's and MPI's start-up paid once per rank.

Run as ``mpi_jobs.py SPEC`` under ``mpirun``, where ``SPEC`` is a JSON file (written by
``tests/mpi_ranks.py``'s :class:`~mpi_ranks.MPIJobs`) listing programs, each with a ``name``, an
``argv`` as ``python`` would take it (a script's path and its arguments, or ``-c CODE``), the
environment variables it ran with and its folder. They run in turn, in this one process: the
script as ``__main__`` (its folder first on ``sys.path``) with its ``sys.argv`` and environment,
what it prints on stdout going to ``FOLDER/stdout.rank<R>``. Between two programs the job leaves
what a fresh interpreter would find: ringpipe's Horovod face and its world shut down (a program
that does not shut them down itself) and the environment as before. MPI itself stays up (it
finalises at exit, once). A program that fails ends the job with a line naming it on stderr.
"""

import json
import os
import runpy
import sys


def fresh() -> None:
    """What the next program would find in a new interpreter: no ringpipe world, no Horovod state."""
    import ringpipe as hvd
    from ringpipe.comm import shutdown_world

    if hvd.is_initialized():
        hvd.shutdown()
    shutdown_world()


def run(argv: list[str]) -> None:
    """``python ARGV`` in this process: a script as ``__main__`` or ``-c CODE``."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:  # sys.exit(0) / sys.exit() end a program successfully, as they would alone
        if e.code not in (None, 0):
            raise
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def main(spec_file: str) -> None:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    with open(spec_file) as f:
        programs = json.load(f)
    for p in programs:
        env = dict(os.environ)
        os.environ.update(p["env"])
        sys.stdout.flush()
        saved = os.dup(1)
        with open(os.path.join(p["folder"], f"stdout.rank{rank}"), "w") as out:
            os.dup2(out.fileno(), 1)
            try:
                run(p["argv"])
                fresh()
            except BaseException:
                print(f"mpi_jobs: {p['name']} failed; the programs after it did not run", file=sys.stderr, flush=True)
                raise
            finally:
                sys.stdout.flush()
                os.dup2(saved, 1)
                os.close(saved)
        os.environ.clear()
        os.environ.update(env)
        print(f"mpi_jobs: {p['name']} done rank={rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
