"""``ringpipe launch``'s command line: the launcher's options, then the program, kept apart exactly.

Everything before the program belongs to the launcher and must be understood, or the launch is
refused before any process starts (an unknown option is never passed silently to the script).
The spellings users already type are accepted: torchrun's (``--nproc-per-node``,
``--nproc_per_node``, ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--master-addr``,
``--master-port``, ``--max-restarts``), horovodrun's and mpirun's (``-np``, ``-H host:slots,...``,
``--hostfile``, ``-x NAME``, ``-p``/``--ssh-port``, ``-i``/``--ssh-identity-file``,
``--start-timeout``, ``--network-interface``).
The program is a script or ``-m module``, optionally after ``python``/``python3`` and the
interpreter's own options (``-u``, ``-X opt``, ``-W arg``, ...); its arguments reach it exactly
as given.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ringpipe.launch.hosts import (
    HostsError,
    Placement,
    is_local,
    parse_host_list,
    place,
    read_hostfile,
)

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
    hostfile: str | None = None
    exports: list[str] = field(default_factory=list)  # -x NAME[=VALUE], repeated
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_command: str | None = None
    start_timeout: int | None = None
    network_interface: str | None = None
    output_filename: str | None = None  # also write each rank's output under this folder
    # elastic (Horovod's elastic arguments): a discovery script or --min-np makes the job elastic
    host_discovery_script: str | None = None
    min_np: int | None = None
    max_np: int | None = None
    slots_per_host: int | None = None
    elastic_timeout: int | None = None
    reset_limit: int | None = None
    blacklist_cooldown_range: tuple[int, int] | None = None
    placement: Placement | None = None  # set by validate() when hosts other than this machine are named
    host_of_many: bool = False  # this launcher runs one host's ranks for a several-host launch
    python: list[str] = field(default_factory=list)  # the interpreter's own options
    program: list[str] = field(default_factory=list)  # [script, *args] or ["-m", module, *args]

    @property
    def elastic(self) -> bool:
        """Horovod's rule: a discovery script or a minimum number of processes makes the job elastic."""
        return self.host_discovery_script is not None or self.min_np is not None

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
     "number of ranks (default 2, or every slot of -H / --hostfile); per node with --nnodes"),
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
    (("-H", "--hosts", "--host"), "hosts", str, "HOST:SLOTS,...", "horovodrun/mpirun host list: ranks fill "
     "the slots host after host; other hosts are started over ssh"),
    (("--hostfile", "-hostfile", "--machinefile"), "hostfile", str, "FILE", "hosts, one a line: `host slots=N "
     "[max_slots=M]` (Open MPI) or `host:N` (horovodrun)"),
    (("-x",), "exports", str, "NAME[=VALUE]", "send this variable to every host's ranks (repeatable; "
     "RINGPIPE_*, HOROVOD_*, NCCL_*, GLOO_*, TORCH_*, OMP_*, MKL_*, PYTHONPATH go anyway)"),
    (("--ssh-port", "-p"), "ssh_port", _positive("--ssh-port"), "PORT", "ssh port on every host"),
    (("--ssh-identity-file", "-i"), "ssh_identity_file", str, "FILE", "ssh private key to reach the hosts"),
    (("--ssh-command",), "ssh_command", str, "CMD", "how to reach a host instead of ssh, run "
     "as `CMD [ssh options] HOST COMMAND` (as Open MPI's plm_rsh_agent; default: RINGPIPE_SSH_COMMAND, else ssh)"),
    (("--start-timeout",), "start_timeout", _positive("--start-timeout"), "S", "seconds for every host to answer "
     "before anything starts (default 30, or HOROVOD_START_TIMEOUT)"),
    (("--output-filename",), "output_filename", str, "DIR", "also write each rank's output to "
     "DIR/rank.<R>/stdout and DIR/rank.<R>/stderr, R zero-padded (horovodrun's --output-filename)"),
    (("--host-discovery-script",), "host_discovery_script", str, "SCRIPT", "elastic job: an executable printing "
     "the available hosts, one a line (`host` or `host:slots`); run every second"),
    (("--min-np", "--min-num-proc"), "min_np", _positive("--min-np"), "N", "elastic job: fewest ranks to train "
     "with (default -n); below it the job waits up to --elastic-timeout for more"),
    (("--max-np", "--max-num-proc"), "max_np", _positive("--max-np"), "N", "elastic job: most ranks (default: "
     "every discovered slot)"),
    (("--slots-per-host", "--slots"), "slots_per_host", _positive("--slots-per-host"), "N",
     "elastic job: slots of a discovered host printed without `:slots` (default 1)"),
    (("--elastic-timeout",), "elastic_timeout", _positive("--elastic-timeout"), "S", "elastic job: seconds to "
     "wait for --min-np slots (default 600, or HOROVOD_ELASTIC_TIMEOUT)"),
    (("--reset-limit",), "reset_limit", _positive("--reset-limit"), "N", "elastic job: fail once the world "
     "has been re-formed more than N times"),
    (("--blacklist-cooldown-range",), "blacklist_cooldown_range", str, "A B", "elastic job: a failed host may "
     "return after a random, exponentially growing cooldown between A and B seconds (default: never)"),
    (("--network-interface", "--network-interfaces"), "network_interface", str, "NIC", "interface the ranks talk "
     "over (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME; Open MPI's btl/oob_tcp_if_include)"),
]
_BY_NAME = {name: spec for spec in _OPTIONS for name in spec[0]}

# The interpreter's options: flags, and options that take a value.
_PY_FLAGS = {"-u", "-B", "-E", "-s", "-S", "-I", "-O", "-OO", "-b", "-bb", "-q", "-v", "-d", "-P", "-R"}
_PY_VALUED = {"-X", "-W"}


def _cooldown(text: str) -> tuple[int, int]:
    parts = text.replace(",", " ").split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[1]):
        raise LaunchUsageError(f"--blacklist-cooldown-range takes two whole numbers of seconds 1 <= A <= B "
                               f"(A B or A,B), got {text!r}")
    return int(parts[0]), int(parts[1])


def launch_help() -> str:
    """The help text of ``ringpipe launch``."""
    p = argparse.ArgumentParser(
        prog="ringpipe launch",
        usage="ringpipe launch [options] [python [python options]] (script.py | -m module) [args ...]",
        description=(
            "Start N ranks of a program with torch's elastic agent (gloo/nccl), mpirun (--backend mpi) or "
            "Python multiprocessing (--mode mp), on this machine or, with -H/--hostfile naming other hosts, on "
            "every host at once over ssh (each host checked first, within --start-timeout). Every mode exports RANK, WORLD_SIZE, LOCAL_RANK, "
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
        if spec[1] == "exports":
            opts.exports.append(value)
        elif spec[1] == "blacklist_cooldown_range":
            if not eq and i + 1 < len(argv) and argv[i + 1].isdigit():  # `A B` as Horovod takes it
                value = f"{value},{argv[i + 1]}"
                i += 1
            opts.blacklist_cooldown_range = _cooldown(value)
        else:
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


def _placement(opts: LaunchOptions) -> None:
    """Read -H / --hostfile: all on this machine -> -n; other hosts too -> ``opts.placement``."""
    if opts.hosts is not None and opts.hostfile is not None:
        raise LaunchUsageError("give the hosts once: -H HOST:SLOTS,... or --hostfile FILE, not both")
    try:
        if opts.hostfile is not None:
            hosts, source = read_hostfile(opts.hostfile), f"--hostfile {opts.hostfile}"
        else:
            assert opts.hosts is not None
            hosts, source = parse_host_list(opts.hosts), f"-H {opts.hosts}"
        placement = place(hosts, opts.nprocs, source)
    except HostsError as exc:
        raise LaunchUsageError(str(exc)) from None
    opts.nprocs = placement.size
    if all(is_local(h) for h, _ in placement.hosts):
        return
    opts.placement = placement
    if opts.nnodes > 1 or opts.rdzv_endpoint:
        raise LaunchUsageError(f"{source} starts every host from this one command: drop --nnodes, --node-rank "
                               "and --rdzv-endpoint (they are for running the launcher on each node yourself)")
    if opts.mode == "mp":
        raise LaunchUsageError("--mode mp runs on one machine; drop it to start ranks on several hosts")
    if opts.max_restarts:
        raise LaunchUsageError("--max-restarts is not supported across hosts started with -H / --hostfile")


def _elastic(opts: LaunchOptions) -> None:
    """Check an elastic job's options (Horovod's rules); fill in -n, --min-np and --elastic-timeout."""
    if opts.backend == "mpi":
        raise LaunchUsageError("elastic jobs (--host-discovery-script / --min-np) run on Gloo only, as Horovod's "
                               "elastic mode does: drop --mpi / --backend mpi (use --gloo)")
    if opts.mode != "agent" or opts.nnodes > 1 or opts.rdzv_endpoint or opts.max_restarts:
        raise LaunchUsageError("an elastic job is started from this one command by its driver: drop --mode, "
                               "--nnodes, --rdzv-endpoint and --max-restarts")
    if opts.output_filename is not None:
        raise LaunchUsageError("--output-filename is not supported for elastic jobs yet; drop it")
    fixed = opts.hosts is not None or opts.hostfile is not None
    if opts.host_discovery_script is not None and fixed:
        raise LaunchUsageError("give the hosts once: --host-discovery-script, or a fixed set (-H / --hostfile)")
    if opts.host_discovery_script is None and not fixed:
        raise LaunchUsageError("an elastic job (--min-np) needs its hosts: --host-discovery-script SCRIPT, or a "
                               "fixed set with -H HOST:SLOTS,... / --hostfile FILE")
    if opts.host_discovery_script is not None and not os.access(opts.host_discovery_script, os.X_OK):
        raise LaunchUsageError(f"--host-discovery-script {opts.host_discovery_script}: not an executable file "
                               "(chmod +x it)")
    if fixed:
        if opts.hosts is not None and opts.hostfile is not None:
            raise LaunchUsageError("give the hosts once: -H HOST:SLOTS,... or --hostfile FILE, not both")
        try:
            hosts = read_hostfile(opts.hostfile) if opts.hostfile else parse_host_list(str(opts.hosts))
        except HostsError as exc:
            raise LaunchUsageError(str(exc)) from None
        if len(hosts) < 2:
            raise LaunchUsageError("an elastic job on a fixed host set needs at least 2 hosts (Horovod: cannot "
                                   "run in fault tolerance mode with fewer than 2 hosts)")
    if opts.nprocs is None:
        opts.nprocs = opts.min_np or 1
    if opts.min_np is None:
        opts.min_np = opts.nprocs
    if opts.min_np < 1 or (opts.max_np is not None and opts.max_np < 1):
        raise LaunchUsageError("--min-np and --max-np must be >= 1")
    if not opts.min_np <= opts.nprocs <= (opts.max_np or opts.nprocs):
        raise LaunchUsageError(f"-np {opts.nprocs} must lie between --min-np {opts.min_np} and --max-np "
                               f"{opts.max_np}")
    if opts.elastic_timeout is None:
        raw = os.environ.get("HOROVOD_ELASTIC_TIMEOUT", "600").strip() or "600"
        if not raw.isdigit():
            raise LaunchUsageError(f"HOROVOD_ELASTIC_TIMEOUT={raw!r} must be a whole number of seconds")
        opts.elastic_timeout = int(raw)
    if opts.reset_limit is not None and opts.reset_limit < 0:
        raise LaunchUsageError(f"--reset-limit must be >= 0, got {opts.reset_limit}")


def validate(opts: LaunchOptions) -> None:
    """Check the options together; raise LaunchUsageError naming the wrong one and the fix."""
    if opts.backend not in BACKENDS:
        raise LaunchUsageError(f"unknown backend {opts.backend!r}; valid: {', '.join(BACKENDS)}")
    if opts.mode not in ("agent", "mp"):
        raise LaunchUsageError(f"unknown --mode {opts.mode!r}; valid: agent, mp")
    if opts.elastic:
        _elastic(opts)
    elif opts.hosts is not None or opts.hostfile is not None:
        _placement(opts)
    if opts.start_timeout is None:
        raw = os.environ.get("HOROVOD_START_TIMEOUT", "30").strip() or "30"
        if not raw.isdigit() or int(raw) < 1:
            raise LaunchUsageError(f"HOROVOD_START_TIMEOUT={raw!r} must be a whole number of seconds >= 1")
        opts.start_timeout = int(raw)
    if opts.start_timeout < 1:
        raise LaunchUsageError(f"--start-timeout must be >= 1 second, got {opts.start_timeout}")
    if opts.ssh_command is None and os.environ.get("RINGPIPE_SSH_COMMAND", "").strip():
        opts.ssh_command = os.environ["RINGPIPE_SSH_COMMAND"].strip()
    if opts.ssh_identity_file and not os.path.isfile(opts.ssh_identity_file):
        raise LaunchUsageError(f"--ssh-identity-file {opts.ssh_identity_file}: no such file")
    for item in opts.exports:
        name = item.partition("=")[0]
        if not name or not (name[0].isalpha() or name[0] == "_") or not name.replace("_", "a").isalnum():
            raise LaunchUsageError(f"-x {item!r}: give a variable name, or NAME=VALUE")
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
        raise LaunchUsageError("for MPI across nodes give the hosts to this launcher (-H HOST:SLOTS,... or "
                               "--hostfile FILE): they go to mpirun")
    if opts.output_filename is not None and opts.placement is not None:
        raise LaunchUsageError("--output-filename writes the files where the ranks' launcher runs: with other hosts "
                               "(-H / --hostfile) start each host with ringpipe launch --nnodes instead, or drop it")
    if opts.mode == "mp" and opts.nnodes > 1:
        raise LaunchUsageError("--mode mp runs on one node; use the default agent for --nnodes > 1")
