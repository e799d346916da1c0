"""``horovodrun`` on ringpipe: Horovod's launcher command line mapped onto ``ringpipe launch``.

Installed as a console script only with the opt-in extra (``pip install ringpipe[horovodrun]``),
so it never shadows a real Horovod. Options map as horovodrun defines them
(horovod/runner/launch.py, horovod/runner/common/util/config_parser.py): ``-np``, ``-H``,
``--gloo`` / ``--mpi`` become the launch's own options, the tuning, timeline, stall and logging
options become the ``HOROVOD_*`` variables every rank reads (see
:mod:`ringpipe.launch.horovod_env`). An option with no ringpipe equivalent is refused by name
before anything starts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from types import SimpleNamespace

__all__ = ["main", "translate", "HorovodrunUsageError"]


class HorovodrunUsageError(ValueError):
    """A horovodrun command line ringpipe cannot run as asked; the message says why."""


def _mb(v: str) -> str:
    try:
        return str(int(float(v) * 1024 * 1024))
    except ValueError:
        raise HorovodrunUsageError(f"--fusion-threshold-mb takes a number of MiB, got {v!r}") from None


# option -> (environment variable, value conversion); options taking no value have conversion None.
_TO_ENV: dict[str, tuple[str, Callable[[str], str] | None]] = {
    "--fusion-threshold-mb": ("HOROVOD_FUSION_THRESHOLD", _mb),
    "--cycle-time-ms": ("HOROVOD_CYCLE_TIME", str),
    "--cache-capacity": ("HOROVOD_CACHE_CAPACITY", str),
    "--hierarchical-allreduce": ("HOROVOD_HIERARCHICAL_ALLREDUCE", None),
    "--timeline-filename": ("HOROVOD_TIMELINE", str),
    "--timeline-mark-cycles": ("HOROVOD_TIMELINE_MARK_CYCLES", None),
    "--no-stall-check": ("HOROVOD_STALL_CHECK_DISABLE", None),
    "--stall-check-warning-time-seconds": ("HOROVOD_STALL_CHECK_TIME_SECONDS", str),
    "--stall-check-shutdown-time-seconds": ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str),
    "--log-level": ("HOROVOD_LOG_LEVEL", str.lower),
}

# Options that become options of ringpipe launch (value taken).
_TO_LAUNCH = {"-np": "-np", "--num-proc": "-np", "-H": "-H", "--hosts": "-H"}

_UNSUPPORTED = {
    "--autotune": "ringpipe has no autotuner: set --fusion-threshold-mb yourself",
    "--autotune-log-file": "ringpipe has no autotuner",
    "--hierarchical-allgather": "ringpipe's allgather has no hierarchical form",
    "--torus-allreduce": "ringpipe has no torus allreduce",
    "--num-nccl-streams": "ringpipe uses one NCCL stream per communicator",
    "--thread-affinity": "bind threads with taskset / numactl in the command instead",
    "--gloo-timeout-seconds": "not configurable in ringpipe",
    "--elastic": "elastic Horovod (min/max ranks, host discovery) is not supported",
    "--min-np": "elastic Horovod is not supported", "--max-np": "elastic Horovod is not supported",
    "--host-discovery-script": "elastic Horovod is not supported",
    "--hostfile": "give the hosts with -H HOST:SLOTS,...",
    "-p": "ssh options are not supported: ringpipe launch starts ranks on this machine",
    "--ssh-port": "ssh options are not supported: ringpipe launch starts ranks on this machine",
    "-i": "ssh options are not supported: ringpipe launch starts ranks on this machine",
    "--ssh-identity-file": "ssh options are not supported: ringpipe launch starts ranks on this machine",
    "--network-interface": "set GLOO_SOCKET_IFNAME instead",
    "--output-filename": "ringpipe launch prints every rank's lines, prefixed with the rank",
    "--config-file": "give the options on the command line",
    "--mpi-args": "run mpirun yourself with its arguments",
    "--binding-args": "run mpirun yourself with its binding arguments",
    "--jsrun": "jsrun is not supported", "--ray": "Ray is not supported",
    "--tcp": "ringpipe's gloo and MPI backends use TCP already",
    "--disable-cache": "ringpipe caches nothing between launches",
    "--start-timeout": "not configurable in ringpipe",
    "--check-build": "use ringpipe --version",
}

_FLAGS = {"--gloo", "--mpi", "--verbose", "-v"}


def translate(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``horovodrun`` arguments -> (``ringpipe launch`` arguments, environment to add)."""
    args: list[str] = []
    env: dict[str, str] = {}
    backend: str | None = None
    argv = list(argv)
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("-"):
            break
        if tok in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        name, eq, value = tok.partition("=")
        if name in _UNSUPPORTED or any(name.startswith(p) for p in ("--autotune-",)):
            why = _UNSUPPORTED.get(name, "ringpipe has no autotuner")
            raise HorovodrunUsageError(f"horovodrun option {name} is not supported by ringpipe: {why}")
        if name in _FLAGS and not eq:
            if name in ("--gloo", "--mpi"):
                want = name[2:]
                if backend and backend != want:
                    raise HorovodrunUsageError("give one of --gloo and --mpi")
                backend = want
            i += 1
            continue
        known = name in _TO_LAUNCH or name in _TO_ENV
        if not known:
            raise HorovodrunUsageError(
                f"unknown horovodrun option {name!r}: ringpipe's horovodrun understands "
                f"{', '.join(sorted([*_TO_LAUNCH, *_TO_ENV, *_FLAGS]))}"
            )
        convert = _TO_ENV[name][1] if name in _TO_ENV else str
        if convert is None:  # a flag
            env[_TO_ENV[name][0]] = "1"
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise HorovodrunUsageError(f"horovodrun option {name} needs a value")
            value = argv[i + 1]
            i += 1
        if name in _TO_LAUNCH:
            args += [_TO_LAUNCH[name], value]
        else:
            env[_TO_ENV[name][0]] = convert(value)
        i += 1
    command = argv[i:]
    if not command:
        raise HorovodrunUsageError("give the command to run: horovodrun -np 2 python train.py")
    if backend:
        args += ["--backend", backend]
    return [*args, *command], env


def main(argv: Sequence[str] | None = None) -> int:
    """The ``horovodrun`` console script."""
    from ringpipe.launch import launch_main

    try:
        args, env = translate(sys.argv[1:] if argv is None else argv)
    except HorovodrunUsageError as exc:
        print(f"horovodrun (ringpipe): {exc}", file=sys.stderr)
        return 2
    os.environ.update(env)
    return int(launch_main(SimpleNamespace(argv=args)))


if __name__ == "__main__":
    sys.exit(main())
