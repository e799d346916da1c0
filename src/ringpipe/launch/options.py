"""``ringpipe launch``'s command line: the launcher's options, then the program, kept apart exactly.

Everything before the program belongs to the launcher and must be understood, or the launch is
refused before any process starts (an unknown option is never passed silently to the script).
The spellings users already type are accepted: torchrun's (``--nproc-per-node``,
``--nproc_per_node``, ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--master-addr``,
``--master-port``, ``--max-restarts``), horovodrun's and mpirun's (``-np``, ``-H localhost:2``).
The program is a script or ``-m module``, optionally after ``python``/``python3`` and the
interpreter's own options (``-u``, ``-X opt``, ``-W arg``, ...); its arguments reach it exactly
as given.
"""

from __future__ import annotations

import argparse
import difflib
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LaunchOptions", "parse_launch_args", "LaunchUsageError", "launch_help"]

BACKENDS = ("gloo", "nccl", "mpi")


class LaunchUsageError(ValueError):
    """The launch command line is not understood; the message says what and how to fix it."""


@dataclass
class LaunchOptions:
    nprocs: int | None = None
    backend: str = "gloo"
    mode: str = "agent"
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    hosts: str | None = None
    python: list[str] = field(default_factory=list)  # the interpreter's own options
    program: list[str] = field(default_factory=list)  # [script, *args] or ["-m", module, *args]

    @property
    def module(self) -> str | None:
        return self.program[1] if self.program[:1] == ["-m"] else None

    @property
    def script(self) -> str | None:
        return None if self.module or not self.program else self.program[0]


def _positive(name: str) -> Any:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise LaunchUsageError(f"{name} takes a whole number, got {text!r}") from None
        return value

    return convert


# (spellings, attribute, converter, metavar, help)
_OPTIONS: list[tuple[tuple[str, ...], str, Any, str | None, str]] = [
    (("-n", "-np", "--nprocs", "--nproc-per-node", "--nproc_per_node"), "nprocs", _positive("-n"), "N",
     "processes on this node (default 2, or the slots of -H)"),
    (("--backend",), "backend", str, "NAME", f"communication backend: {', '.join(BACKENDS)} (default gloo); "
     "exported as RINGPIPE_BACKEND, which ringpipe.init(), init_world(), bench and doctor follow"),
    (("--mode",), "mode", str, "MODE", "agent: torch's elastic agent (default; mpirun for --backend mpi); "
     "mp: Python multiprocessing"),
    (("--nnodes",), "nnodes", _positive("--nnodes"), "N", "number of nodes (run the launcher on each)"),
    (("--node-rank", "--node_rank"), "node_rank", _positive("--node-rank"), "I", "this node's index in [0, nnodes)"),
    (("--rdzv-endpoint", "--rdzv_endpoint"), "rdzv_endpoint", str, "HOST:PORT", "node 0's address and port, for --nnodes > 1"),
    (("--master-addr", "--master_addr"), "master_addr", str, "HOST",
     "node 0's address (with --master-port, instead of --rdzv-endpoint)"),
    (("--master-port", "--master_port"), "master_port", _positive("--master-port"), "PORT",
     "rendezvous port (default: a free one on one node)"),
    (("--max-restarts", "--max_restarts"), "max_restarts", _positive("--max-restarts"), "N",
     "restart every rank up to N times when one fails (torch's elastic agent; default 0)"),
    (("-H", "--hosts"), "hosts", str, "HOST:SLOTS,...", "horovodrun/mpirun host list; only this machine's "
     "names (localhost:2) are accepted"),
]
_BY_NAME = {name: spec for spec in _OPTIONS for name in spec[0]}

# The interpreter's options: flags, and options that take a value.
_PY_FLAGS = {"-u", "-B", "-E", "-s", "-S", "-I", "-O", "-OO", "-b", "-bb", "-q", "-v", "-d", "-P", "-R"}
_PY_VALUED = {"-X", "-W"}


def launch_help() -> str:
    """The help text of ``ringpipe launch``."""
    p = argparse.ArgumentParser(
        prog="ringpipe launch",
        usage="ringpipe launch [options] [python [python options]] (script.py | -m module) [args ...]",
        description=(
            "Start N ranks of a program with torch's elastic agent (gloo/nccl), mpirun (--backend mpi) or "
            "Python multiprocessing (--mode mp). Every mode exports RANK, WORLD_SIZE, LOCAL_RANK, "
            "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT and horovodrun's HOROVOD_RANK, "
            "HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE, "
            "so plain torch.distributed and Horovod programs run unchanged. Output lines are prefixed with "
            "the rank. When a rank fails (an uncaught exception, a non-zero exit, a signal) the others are "
            "stopped and the launcher names the rank that failed first, with its status. The ranks end "
            "with the launcher however it ends."
        ),
        epilog=(
            "Options before the program belong to the launcher and must be known; everything after the "
            "script or module goes to it unchanged. A leading `python`/`python3` runs this launcher's "
            "interpreter with the options given. OMP_NUM_THREADS defaults to 1 for every rank."
        ),
    )
    for names, _, _, metavar, text in _OPTIONS:
        p.add_argument(*names, metavar=metavar, help=text)
    p.add_argument("-m", metavar="MODULE", help="run a module (like python -m) instead of a script")
    from ringpipe.launch.horovod_env import settings_help

    return (p.format_help() + "\nHorovod's settings honoured by every rank (set them in the environment):\n"
            + settings_help() + "\n")


def _unknown(token: str) -> LaunchUsageError:
    name = token.split("=", 1)[0]
    close = difflib.get_close_matches(name, list(_BY_NAME) + ["-m"], n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return LaunchUsageError(
        f"unknown launcher option {name!r}{hint} (options before the script belong to ringpipe launch; "
        "put the script's own options after the script: see ringpipe launch --help)"
    )


def parse_launch_args(argv: Sequence[str]) -> LaunchOptions:
    """Split and read ``argv`` (everything after ``ringpipe launch``); raise LaunchUsageError.

    ``-h``/``--help`` before the program prints the help and exits.
    """
    opts = LaunchOptions()
    argv = list(argv)
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            i += 1
            break
        if tok in ("-h", "--help"):
            print(launch_help())
            raise SystemExit(0)
        if tok == "-m" or (tok.startswith("-m") and not tok.startswith("--") and tok not in _BY_NAME):
            break
        if not tok.startswith("-") or tok == "-":
            break
        name, eq, value = tok.partition("=")
        if name not in _BY_NAME and not name.startswith("--") and name[:2] in ("-n", "-H") and not eq:
            name, value, eq = name[:2], name[2:], "="  # -n2, -Hlocalhost:2
        spec = _BY_NAME.get(name)
        if spec is None:
            raise _unknown(tok)
        if not eq:
            if i + 1 >= len(argv):
                raise LaunchUsageError(f"{name} needs a value ({spec[3]})")
            value = argv[i + 1]
            i += 1
        setattr(opts, spec[1], spec[2](value))
        i += 1
    _read_program(opts, argv[i:])
    return opts


def _is_python(token: str) -> bool:
    base = os.path.basename(token)
    return base in ("python", "python3") or (base.startswith("python3.") and base[8:].isdigit())


def _read_program(opts: LaunchOptions, rest: list[str]) -> None:
    if rest and _is_python(rest[0]):
        if os.path.basename(rest[0]) != rest[0]:  # a path names a particular interpreter
            raise LaunchUsageError(
                f"ringpipe launch runs its own interpreter ({sys.executable}); give `python` or drop it, "
                f"not the path {rest[0]!r} (start ringpipe launch with that interpreter instead)"
            )
        rest = rest[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m" and not rest[0].startswith("-m"):
            tok = rest[0]
            if tok in _PY_FLAGS:
                opts.python.append(tok)
                rest = rest[1:]
            elif tok in _PY_VALUED and len(rest) > 1:
                opts.python += rest[:2]
                rest = rest[2:]
            elif tok[:2] in _PY_VALUED and len(tok) > 2:
                opts.python.append(tok)
                rest = rest[1:]
            elif tok == "-c":
                raise LaunchUsageError("python -c is not supported: put the code in a script (or use -m module)")
            else:
                raise LaunchUsageError(
                    f"unknown python option {tok!r} before the script (supported: "
                    f"{' '.join(sorted(_PY_FLAGS | _PY_VALUED))})"
                )
    if rest and rest[0].startswith("-m"):
        module = rest[0][2:] or (rest[1] if len(rest) > 1 else "")
        if not module:
            raise LaunchUsageError("-m needs a module name (like python -m)")
        args = rest[1:] if rest[0][2:] else rest[2:]
        opts.program = ["-m", module, *args]
    elif rest:
        if rest[0].startswith("-"):
            raise _unknown(rest[0])
        opts.program = list(rest)
    else:
        raise LaunchUsageError("give a script (or -m module) to run: ringpipe launch -n 2 train.py")


def local_slots(hosts: str) -> int:
    """Total slots of a ``-H host:slots,...`` list whose hosts are all this machine."""
    mine = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    total = 0
    others = []
    for item in hosts.split(","):
        host, _, slots = item.strip().partition(":")
        if not host:
            raise LaunchUsageError(f"-H {hosts!r}: an empty host name; write HOST:SLOTS,... (localhost:2)")
        try:
            count = int(slots) if slots else 1
        except ValueError:
            raise LaunchUsageError(f"-H {hosts!r}: slots of {host!r} must be a whole number, got {slots!r}") from None
        if count < 1:
            raise LaunchUsageError(f"-H {hosts!r}: {host} has {count} slots; give at least 1")
        if host not in mine and not host.startswith("127."):
            others.append(host)
        total += count
    if others:
        raise LaunchUsageError(
            f"-H names other machines ({', '.join(others)}): ringpipe launch starts ranks on this machine; "
            "run it on every node with --nnodes N --node-rank I --rdzv-endpoint HOST:PORT, or use mpirun -H "
            "for MPI across hosts"
        )
    return total


def validate(opts: LaunchOptions) -> None:
    """Check the options together; raise LaunchUsageError naming the wrong one and the fix."""
    if opts.backend not in BACKENDS:
        raise LaunchUsageError(f"unknown backend {opts.backend!r}; valid: {', '.join(BACKENDS)}")
    if opts.mode not in ("agent", "mp"):
        raise LaunchUsageError(f"unknown --mode {opts.mode!r}; valid: agent, mp")
    if opts.hosts is not None:
        slots = local_slots(opts.hosts)
        if opts.nprocs is None:
            opts.nprocs = slots
        elif opts.nprocs > slots:
            raise LaunchUsageError(f"-n {opts.nprocs} is more than the {slots} slots of -H {opts.hosts}")
    if opts.nprocs is None:
        opts.nprocs = 2
    if opts.nprocs < 1:
        raise LaunchUsageError(f"-n must be >= 1, got {opts.nprocs}")
    if opts.nnodes < 1:
        raise LaunchUsageError(f"--nnodes must be >= 1, got {opts.nnodes}")
    if not 0 <= opts.node_rank < opts.nnodes:
        raise LaunchUsageError(f"--node-rank {opts.node_rank} must be in [0, --nnodes={opts.nnodes})")
    if opts.max_restarts < 0:
        raise LaunchUsageError(f"--max-restarts must be >= 0, got {opts.max_restarts}")
    if opts.master_port is not None and not 0 < opts.master_port < 65536:
        raise LaunchUsageError(f"--master-port {opts.master_port} is not a TCP port (1-65535)")
    if opts.rdzv_endpoint is not None:
        host, _, port = opts.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchUsageError(f"--rdzv-endpoint {opts.rdzv_endpoint!r} must be HOST:PORT "
                                   "(node 0's address and a free port on it, e.g. 10.0.0.1:29500)")
    elif opts.nnodes > 1:
        if opts.master_addr and opts.master_port:
            opts.rdzv_endpoint = f"{opts.master_addr}:{opts.master_port}"
        else:
            raise LaunchUsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (or --master-addr and "
                                   "--master-port): node 0's address and a free port on it")
    if opts.script and not os.path.isfile(opts.script):
        raise LaunchUsageError(f"no such script: {opts.script} (give a Python file, or -m module)")
    if opts.max_restarts and (opts.mode == "mp" or opts.backend == "mpi"):
        raise LaunchUsageError("--max-restarts needs torch's elastic agent: drop --mode mp / --backend mpi")
    if opts.backend == "mpi" and opts.nnodes > 1:
        raise LaunchUsageError("for MPI across nodes use mpirun with a hostfile directly")
    if opts.mode == "mp" and opts.nnodes > 1:
        raise LaunchUsageError("--mode mp runs on one node; use the default agent for --nnodes > 1")
