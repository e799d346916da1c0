"""``horovodrun`` on ringpipe: Horovod's launcher command line mapped onto ``ringpipe launch``.

Installed as the console script ``ringpipe-horovodrun``; ``ringpipe-horovodrun --install-alias``
adds ``horovodrun`` itself, opt-in, so that it never shadows a real Horovod's
(:mod:`ringpipe.launch.horovodrun_alias`). Options map as horovodrun defines them (horovod/runner/launch.py,
horovod/runner/common/util/config_parser.py): ``-np``, ``-H``, ``--hostfile``, ``-p``/``--ssh-port``,
``-i``/``--ssh-identity-file``, ``--start-timeout``, ``--network-interface(s)`` and ``--gloo`` /
``--mpi`` become the launch's own options; the tuning, timeline, stall and logging options become
the ``HOROVOD_*`` variables every rank reads (see :mod:`ringpipe.launch.horovod_env`). An option
with no ringpipe equivalent is refused by name before anything starts.

Horovod's elastic arguments (``--host-discovery-script``, ``--min-np``/``--min-num-proc``,
``--max-np``/``--max-num-proc``, ``--slots-per-host``, ``--elastic-timeout``, ``--reset-limit``,
``--blacklist-cooldown-range A B``) make an elastic job, run by the elastic driver
(:mod:`ringpipe.launch.elastic_driver`) on Gloo; ``--mpi`` with them is refused, as Horovod's
elastic mode is Gloo-only.

As in Horovod, without ``--gloo`` or ``--mpi`` the job runs on MPI when MPI can be used here
(``mpirun`` on the PATH and mpi4py importable), else on gloo; and with several hosts every
variable of this environment reaches every rank (Horovod's ``env`` / ``mpirun -x``), except
those naming this shell, this machine or another launcher's ranks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from types import SimpleNamespace

from ringpipe.launch.bootstrap import VERBOSE
from ringpipe.launch.speaker import HOROVODRUN, speak_as

__all__ = ["main", "check_build", "translate", "HorovodrunUsageError", "exportable", "mpi_usable"]


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
    "--gloo-timeout-seconds": ("HOROVOD_GLOO_TIMEOUT_SECONDS", str),
}

# Options that become options of ringpipe launch (value taken).
_TO_LAUNCH = {"-np": "-np", "--num-proc": "-np", "-H": "-H", "--hosts": "-H", "--hostfile": "--hostfile",
              "-hostfile": "--hostfile", "-p": "--ssh-port", "--ssh-port": "--ssh-port", "-i": "--ssh-identity-file",
              "--ssh-identity-file": "--ssh-identity-file", "--start-timeout": "--start-timeout",
              "--network-interface": "--network-interface", "--network-interfaces": "--network-interface",
              "--output-filename": "--output-filename",
              # elastic arguments (Horovod's elastic mode)
              "--host-discovery-script": "--host-discovery-script", "--min-np": "--min-np",
              "--min-num-proc": "--min-np", "--max-np": "--max-np", "--max-num-proc": "--max-np",
              "--slots-per-host": "--slots-per-host", "--elastic-timeout": "--elastic-timeout",
              "--reset-limit": "--reset-limit"}

_UNSUPPORTED = {
    "--autotune": "ringpipe has no autotuner: set --fusion-threshold-mb yourself",
    "--autotune-log-file": "ringpipe has no autotuner",
    "--hierarchical-allgather": "ringpipe's allgather has no hierarchical form",
    "--torus-allreduce": "ringpipe has no torus allreduce",
    "--num-nccl-streams": "ringpipe uses one NCCL stream per communicator",
    "--thread-affinity": "bind threads with taskset / numactl in the command instead",
    "--config-file": "give the options on the command line",
    "--mpi-args": "run mpirun yourself with its arguments",
    "--binding-args": "run mpirun yourself with its binding arguments",
    "--jsrun": "jsrun is not supported", "--ray": "Ray is not supported",
}

# Flags: --gloo and --mpi choose the backend; --verbose (-v) shows a failed rank's whole traceback;
# the others are accepted with nothing to do: ringpipe checks the hosts on every launch (no cache to
# disable) and its gloo and MPI traffic is TCP already.
_FLAGS = {"--gloo", "--mpi", "--verbose", "-v", "--disable-cache", "--tcp"}

# Variables not sent to other hosts: this shell's and this machine's, and another launcher's ranks'.
_LOCAL_ONLY = ("HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "DISPLAY", "CUDA_VISIBLE_DEVICES", "RANK",
               "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
_LOCAL_PREFIXES = ("SSH_", "BASH_FUNC_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "RINGPIPE_LAUNCH_", "XDG_")


def exportable(name: str) -> bool:
    """Whether horovodrun sends ``name`` to the other hosts (Horovod sends all but a few)."""
    return (name not in _LOCAL_ONLY and not name.startswith(_LOCAL_PREFIXES)
            and name.replace("_", "a").isalnum() and not name[:1].isdigit())


def mpi_usable() -> bool:
    """Horovod's default controller test, for ringpipe: MPI when mpirun and mpi4py are both here."""
    import importlib.util
    import shutil

    return (shutil.which("mpirun") or shutil.which("mpiexec")) is not None and \
        importlib.util.find_spec("mpi4py") is not None


def _other_hosts(args: list[str]) -> bool:
    """Whether the launch arguments name, or may name, a host other than this machine (unreadable lists: no)."""
    from ringpipe.launch.hosts import HostsError, is_local, parse_host_list, read_hostfile

    for flag, value in zip(args, args[1:], strict=False):
        try:
            if flag == "--host-discovery-script":  # it may name other hosts at any time
                return True
            if flag == "-H":
                return any(not is_local(h.host) for h in parse_host_list(value))
            if flag == "--hostfile":
                return any(not is_local(h.host) for h in read_hostfile(value))
        except HostsError:  # ringpipe launch reports it
            return False
    return False


def check_build() -> str:
    """``horovodrun --check-build``: what this installation can run, in Horovod's table."""
    import importlib.util

    import torch.distributed as dist

    from ringpipe.version import __version__

    def mark(value: bool) -> str:
        return "X" if value else " "

    gloo = dist.is_available() and dist.is_gloo_available()
    nccl = dist.is_available() and dist.is_nccl_available()
    mpi = mpi_usable()
    return "\n".join([
        f"ringpipe v{__version__} (Horovod's API):",
        "",
        "Available Frameworks:",
        f"    [{mark(importlib.util.find_spec('tensorflow') is not None)}] TensorFlow",
        "    [X] PyTorch",
        "    [ ] MXNet",
        "",
        "Available Controllers:",
        f"    [{mark(mpi)}] MPI",
        f"    [{mark(gloo)}] Gloo",
        "",
        "Available Tensor Operations:",
        f"    [{mark(nccl)}] NCCL",
        "    [ ] DDL",
        "    [ ] CCL",
        f"    [{mark(mpi)}] MPI",
        f"    [{mark(gloo)}] Gloo",
    ])


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
        if tok in ("-cb", "--check-build"):
            print(check_build())
            raise SystemExit(0)
        name, eq, value = tok.partition("=")
        if name == "--blacklist-cooldown-range":  # Horovod's two values: A B
            values = value.split(",") if eq else argv[i + 1:i + 3]
            if len(values) != 2 or not all(v.strip().isdigit() for v in values):
                raise HorovodrunUsageError("--blacklist-cooldown-range takes two values: A B (seconds)")
            args += ["--blacklist-cooldown-range", ",".join(v.strip() for v in values)]
            i += 1 if eq else 3
            continue
        if name in _UNSUPPORTED or any(name.startswith(p) for p in ("--autotune-",)):
            why = _UNSUPPORTED.get(name, "ringpipe has no autotuner")
            raise HorovodrunUsageError(f"horovodrun option {name} is not supported by ringpipe: {why}")
        if name in _FLAGS and not eq:
            if name in ("--gloo", "--mpi"):
                want = name[2:]
                if backend and backend != want:
                    raise HorovodrunUsageError("give one of --gloo and --mpi")
                backend = want
            elif name in ("--verbose", "-v"):
                env[VERBOSE] = "1"
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
    elastic = "--host-discovery-script" in args or "--min-np" in args
    if elastic and backend == "mpi":
        raise HorovodrunUsageError("elastic mode (--host-discovery-script / --min-np) runs on Gloo only, as "
                                   "Horovod's does: drop --mpi (or give --gloo)")
    args += ["--backend", backend or ("gloo" if elastic else "mpi" if mpi_usable() else "gloo")]
    if _other_hosts(args):
        for name in sorted(os.environ):
            if exportable(name):
                args += ["-x", name]
    return [*args, *command], env


def main(argv: Sequence[str] | None = None) -> int:
    """The ``horovodrun`` console script."""
    from ringpipe.launch import launch_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--install-alias", "--remove-alias"):
        return _alias(argv)
    try:
        args, env = translate(argv)
    except HorovodrunUsageError as exc:
        print(f"{HOROVODRUN}: {exc}", file=sys.stderr)
        return 2
    os.environ.update(env)
    speak_as(HOROVODRUN)  # the launcher's own lines carry the name of the command the user ran
    return int(launch_main(SimpleNamespace(argv=args)))


def _alias(argv: list[str]) -> int:
    """``--install-alias [--force] [--bin-dir DIR]`` / ``--remove-alias [--bin-dir DIR]``."""
    from ringpipe.launch.horovodrun_alias import AliasError, install_alias, remove_alias

    rest, force, bin_dir = argv[1:], False, None
    while rest:
        tok = rest.pop(0)
        if tok == "--force" and argv[0] == "--install-alias":
            force = True
        elif tok == "--bin-dir" and rest:
            bin_dir = rest.pop(0)
        else:
            print(f"{HOROVODRUN}: {argv[0]} does not take {tok!r} "
                  f"(usage: ringpipe-horovodrun {argv[0]}{' [--force]' if argv[0] == '--install-alias' else ''} "
                  "[--bin-dir DIR])", file=sys.stderr)
            return 2
    try:
        if argv[0] == "--install-alias":
            print(f"{HOROVODRUN}: wrote {install_alias(bin_dir, force)}")
        else:
            print(f"{HOROVODRUN}: removed {remove_alias(bin_dir)}")
    except AliasError as exc:
        print(f"{HOROVODRUN}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
