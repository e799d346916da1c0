"""Start N processes on this machine (or one node of many): torchrun's agent, mpirun, or multiprocessing.

``ringpipe launch`` is a thin layer over existing process managers, never a home-made one:
torch's elastic agent (``torch.distributed.run``) for gloo/NCCL, ``mpirun`` for MPI, and
``torch.multiprocessing`` for ``--mode mp`` and for :func:`spawn` inside Python. Each of them
stops the other ranks when one dies; ringpipe adds the rank prefix on output lines and a
closing message naming the failed rank.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.multiprocessing as tmp

from ringpipe.comm.base import Communicator
from ringpipe.comm.world import BACKENDS, free_port, init_world, shutdown_world

__all__ = ["spawn", "launch_main", "local_rank_zero_first", "WorkerFailed", "mpirun_command"]


class WorkerFailed(RuntimeError):
    """A worker process failed; the message names the rank and the cause."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


# ----------------------------------------------------------------------------- in-Python spawn


def _worker(
    local_rank: int,
    fn: Callable[..., Any],
    nprocs: int,
    backend: str,
    port: int,
    args: tuple[Any, ...],
    results: Any,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
    )
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    comm = init_world(backend)
    try:
        out = fn(comm, *args)
        # Plain pickle bytes: torch's queue would share tensors through file descriptors that
        # die with this process.
        results.put(pickle.dumps((local_rank, out)))
    finally:
        shutdown_world()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    backend: str = "gloo",
    args: Sequence[Any] = (),
    start_method: str | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``nprocs`` real processes; return the per-rank results.

    Processes are started by ``torch.multiprocessing`` with the standard torch variables set,
    so ``fn`` sees a world as under torchrun. If a rank raises or dies, the others are
    terminated and :class:`WorkerFailed` names the rank. ``start_method='spawn'`` needs a
    picklable, module-level ``fn``; ``fork`` starts faster and is the default unless the
    backend is NCCL or CUDA is already initialised here (CUDA cannot be used after fork).
    """
    if start_method is None:
        cuda = backend == "nccl" or torch.cuda.is_initialized()
        start_method = "spawn" if cuda or sys.platform != "linux" else "fork"
    if backend not in BACKENDS or backend == "mpi":
        raise ValueError(f"spawn supports backends gloo and nccl; got {backend!r} (use mpirun for mpi)")
    ctx = tmp.get_context(start_method)
    results = ctx.SimpleQueue()
    port = free_port("127.0.0.1")
    out: list[Any] = [None] * nprocs

    def drain() -> None:
        while not results.empty():
            rank, value = pickle.loads(results.get())
            out[rank] = value

    try:
        ctx_ = tmp.start_processes(
            _worker,
            args=(fn, nprocs, backend, port, tuple(args), results, dict(env or {})),
            nprocs=nprocs,
            join=False,
            start_method=start_method,
        )
        assert ctx_ is not None
        # Read results while joining: a large result blocks its writer until it is read.
        while not ctx_.join(timeout=0.05):
            drain()
    except (tmp.ProcessRaisedException, tmp.ProcessExitedException) as exc:
        rank, cause = _root_cause(ctx_, exc.error_index)
        raise WorkerFailed(rank, cause) from exc
    drain()
    return out


# Messages of a rank that failed only because another rank went away first.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "remote worker crashing", "broken pipe")


def _root_cause(ctx: Any, first: int) -> tuple[int, str]:
    """The failed worker to blame and its cause: one that did not merely lose a peer.

    When a rank dies, the ranks talking to it fail a moment later with "connection closed by
    peer"; whichever failure ``join`` noticed first, the report names the rank that died.
    """
    failures: list[tuple[int, str]] = []
    for rank, proc in enumerate(ctx.processes):
        proc.join(timeout=1.0)
        code = proc.exitcode
        if code in (None, 0) or (rank != first and code == -signal.SIGTERM):
            continue  # still alive, succeeded, or stopped by join after the first failure
        cause = ""
        path = ctx.error_files[rank]
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, "rb") as fh:
                cause = str(pickle.load(fh)).strip().splitlines()[-1]
        if not cause:
            cause = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        failures.append((rank, cause))
    failures.sort(key=lambda f: (any(p in f[1].lower() for p in _PEER_LOST), f[0] != first, f[0]))
    return failures[0] if failures else (first, "failed")


@contextlib.contextmanager
def local_rank_zero_first(comm: Communicator) -> Iterator[None]:
    """Let local rank 0 of each node run the body first (e.g. one dataset download per node)."""
    node = comm.node_comm() if comm.size > 1 else None
    first = node is None or node.rank == 0
    if not first and node is not None:
        node.barrier()
    yield
    if first and node is not None:
        node.barrier()


# ----------------------------------------------------------------------------- command line


def mpirun_command(nprocs: int, argv: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """The ``mpirun`` line for ``nprocs`` local ranks (Open MPI flags where it is Open MPI)."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise FileNotFoundError(
            "mpirun/mpiexec not found: install Open MPI (apt-get install openmpi-bin libopenmpi-dev) or MPICH"
        )
    cmd = [mpirun, "-n", str(nprocs)]
    if _is_open_mpi(mpirun):
        cmd += ["--tag-output"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd += ["--allow-run-as-root"]
        if nprocs > (os.cpu_count() or 1):
            cmd += ["--oversubscribe"]
        cmd += ["--bind-to", "none", "--map-by", "slot"]
    else:
        cmd += ["-prepend-rank"]
    return cmd + list(extra) + list(argv)


def _is_open_mpi(mpirun: str) -> bool:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in (out.stdout + out.stderr) or "OpenRTE" in (out.stdout + out.stderr)


def _module_args(args: Any) -> list[str]:
    # With -m, argparse takes the first script argument as the (unused) script positional.
    return ([args.script] if args.script else []) + list(args.args)


def _script_argv(args: Any) -> list[str]:
    if args.module:
        return ["-m", args.module, *_module_args(args)]
    if not args.script:
        raise SystemExit("ringpipe launch: give a script (or -m module) to run")
    return [args.script, *args.args]


def _run_mpi(args: Any) -> int:
    argv = [sys.executable, *_script_argv(args)]
    env = dict(os.environ, RINGPIPE_BACKEND="mpi")
    cmd = mpirun_command(args.nprocs, argv)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        print(f"ringpipe launch: mpirun exited with code {proc.returncode} (see the rank-tagged output above)",
              file=sys.stderr)
    return proc.returncode


def _run_torchrun(args: Any) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    cmd = [
        f"--nproc-per-node={args.nprocs}",
        f"--nnodes={args.nnodes}",
        f"--node-rank={args.node_rank}",
        "--tee=3",
        "--monitor-interval=0.5",
    ]
    if args.nnodes > 1:
        if not args.rdzv_endpoint:
            raise SystemExit("ringpipe launch: --nnodes > 1 needs --rdzv-endpoint HOST:PORT (rank 0's host)")
        host, _, port = args.rdzv_endpoint.rpartition(":")
        cmd += [f"--master-addr={host}", f"--master-port={port}"]
        # gloo binds to the address its hostname resolves to, which on many clusters is not the
        # interface that reaches the other nodes: pick the interface of the route to node 0.
        ifname = _route_interface(host)
        if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    else:
        cmd += ["--master-addr=127.0.0.1", f"--master-port={args.master_port or free_port('127.0.0.1')}"]
    if args.module:
        cmd += ["-m", args.module, *_module_args(args)]
    else:
        cmd += _script_argv(args)
    os.environ["RINGPIPE_BACKEND"] = args.backend
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}]:")
    # torchrun tees worker output through log files: put them in a directory of the system's
    # temporary folder (never the working directory) that is removed when the run ends.
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ringpipe-launch-") as logdir:
        cmd = [f"--log-dir={logdir}", *cmd]
        try:
            torchrun.main(cmd)
        except ChildFailedError as exc:
            # The agent SIGTERMs the survivors after the first failure: report the real causes.
            causes = {r: f.exitcode for r, f in exc.failures.items() if f.exitcode != -signal.SIGTERM}
            causes = causes or {r: f.exitcode for r, f in exc.failures.items()}
            # Ranks that failed only because a peer went away first come after the real causes.
            lost = {r for r in causes if _lost_peer(logdir, r)}
            if lost == set(causes):
                lost = set()
            for rank, code in sorted(causes.items(), key=lambda rc: (rc[0] in lost, rc[0])):
                what = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                why = " after losing its connection to a failed rank" if rank in lost else ""
                print(f"ringpipe launch: rank {rank} failed with {what}{why}; the other ranks were stopped",
                      file=sys.stderr)
            # The failed rank's status, as mpirun gives it (a signal as 128 + its number).
            code = causes[min(set(causes) - lost)]
            return code if code > 0 else 128 - code if code < 0 else 1
    return 0


def _lost_peer(logdir: str, rank: int) -> bool:
    """Whether rank ``rank``'s error output (torchrun's log files) says it lost a peer."""
    import glob

    for path in glob.glob(os.path.join(logdir, "**", str(rank), "stderr.log"), recursive=True):
        try:
            with open(path, errors="replace") as fh:
                text = fh.read()[-20000:].lower()
        except OSError:
            continue
        if any(p in text for p in _PEER_LOST):
            return True
    return False


def _route_interface(host: str) -> str | None:
    """The network interface of the route to ``host`` (``ip route get``), or None if unknown."""
    import socket

    try:
        addr = socket.gethostbyname(host)
        out = subprocess.run(["ip", "-o", "route", "get", addr], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = out.stdout.split()
    if "dev" in words:
        dev = words[words.index("dev") + 1]
        return None if dev == "lo" else dev
    return None


def _run_mp(args: Any) -> int:
    """``--mode mp``: python multiprocessing, each rank runs the script's ``__main__``."""
    import runpy

    argv = _script_argv(args)

    def run_script(comm: Communicator) -> None:
        shutdown_world()  # the script calls ringpipe.init()/init_world itself
        sys.stdout = _Prefixed(sys.stdout, f"[{comm.rank}]:")
        sys.stderr = _Prefixed(sys.stderr, f"[{comm.rank}]:")
        sys.argv = argv[1:] if argv[0] == "-m" else argv
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")

    os.environ["RINGPIPE_BACKEND"] = args.backend
    try:
        spawn(run_script, args.nprocs, backend=args.backend)
    except WorkerFailed as exc:
        print(f"ringpipe launch: {exc}; the other ranks were stopped", file=sys.stderr)
        return 1
    return 0


class _Prefixed:
    """A text stream that prefixes every line with the rank (for --mode mp output)."""

    def __init__(self, stream: Any, prefix: str) -> None:
        self._stream, self._prefix, self._at_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for line in text.splitlines(keepends=True):
            if self._at_start:
                out.append(self._prefix)
            out.append(line)
            self._at_start = line.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "launch",
        help="start N processes of a script on this machine (or one node of several)",
        description=(
            "Start N ranks of a script with torch's elastic agent (gloo/nccl), mpirun (mpi) or "
            "Python multiprocessing (--mode mp). Sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ... "
            "so plain torch.distributed scripts run unchanged. Output lines are prefixed with the rank; "
            "if a rank dies the others are stopped and the launcher exits non-zero naming it."
        ),
    )
    p.add_argument("-n", "--nprocs", type=int, default=2, help="processes on this node (default 2)")
    p.add_argument("--backend", default="gloo", help=f"communication backend: {', '.join(BACKENDS)}")
    p.add_argument("--mode", choices=["agent", "mp"], default="agent",
                   help="agent: torchrun's elastic agent / mpirun (default); mp: Python multiprocessing")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (run the launcher on each)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index in [0, nnodes)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0, for --nnodes > 1")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port on one node (default: a free one)")
    p.add_argument("-m", "--module", default=None, help="run a module (like python -m) instead of a script")
    p.add_argument("script", nargs="?", help="the Python script to run")
    p.add_argument("args", nargs="...", help="arguments for the script")
    p.set_defaults(func=launch_main)


def launch_main(args: Any) -> int:
    if args.backend not in BACKENDS:
        raise SystemExit(f"ringpipe launch: unknown backend {args.backend!r}; valid: {', '.join(BACKENDS)}")
    if args.nprocs < 1:
        raise SystemExit(f"ringpipe launch: -n must be >= 1, got {args.nprocs}")
    if not 0 <= args.node_rank < args.nnodes:
        raise SystemExit(f"ringpipe launch: --node-rank {args.node_rank} must be in [0, --nnodes={args.nnodes})")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise SystemExit(f"ringpipe launch: --master-port {args.master_port} is not a TCP port (1-65535)")
    if args.rdzv_endpoint is not None:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SystemExit(f"ringpipe launch: --rdzv-endpoint {args.rdzv_endpoint!r} must be HOST:PORT "
                             "(node 0's address and a free port on it, e.g. 10.0.0.1:29500)")
    if not args.module and args.script and not os.path.isfile(args.script):
        raise SystemExit(f"ringpipe launch: no such script: {args.script} (give a Python file, or -m module)")
    if args.backend == "mpi":
        if args.nnodes > 1:
            raise SystemExit("ringpipe launch: for MPI across nodes use mpirun with a hostfile directly")
        return _run_mpi(args)
    if args.mode == "mp":
        if args.nnodes > 1:
            raise SystemExit("ringpipe launch: --mode mp runs on one node; use the default agent for --nnodes > 1")
        return _run_mp(args)
    try:
        return _run_torchrun(args)
    except Exception:  # noqa: BLE001 - report, then fail
        traceback.print_exc()
        return 1
