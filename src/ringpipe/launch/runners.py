"""Run a parsed launch: torch's elastic agent, mpirun or Python multiprocessing, each rank through the bootstrap.

Every mode starts the same per-rank entry point (:mod:`ringpipe.launch.bootstrap`), so every mode
gets the same environment, the same death-with-the-launcher, the same output prefix and the
same failure report. The process managers are existing ones, never a home-made one: torch's
elastic agent (``torch.distributed.run``, in this process) for gloo/NCCL, ``mpirun`` for MPI and
``torch.multiprocessing`` for ``--mode mp``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

from ringpipe.env import MP_MARKER
from ringpipe.launch import bootstrap
from ringpipe.launch.options import LaunchOptions
from ringpipe.launch.relay import Failure, OutputRelay, last_error, lost_peer, report_failures
from ringpipe.launch.speaker import label
from ringpipe.ports import free_port

__all__ = ["mpirun_command", "run_agent", "run_mpi", "run_mp", "source_address"]

BOOTSTRAP = os.path.abspath(bootstrap.__file__)




def _rank_command(opts: LaunchOptions) -> list[str]:
    """The command every rank runs: this interpreter, its options, the bootstrap, the program."""
    return [sys.executable, *opts.python, "-u", BOOTSTRAP, *opts.program]


def _common_env(opts: LaunchOptions, relay: OutputRelay) -> dict[str, str]:
    return {
        "RINGPIPE_BACKEND": opts.backend,
        bootstrap.LAUNCH_DIR: relay.dir,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONUNBUFFERED": "1",
    }


def _failures(relay: OutputRelay, codes: dict[int, int], times: dict[int, float] | None = None) -> list[Failure]:
    """Combine exit statuses (rank -> status) with the ranks' records and last error lines."""
    records_ = [r for r in relay.records() if str(r.get("rank", "")).isdigit()]
    last = max((int(r.get("attempt", 0)) for r in records_), default=0)  # the last restart's failures
    records = {int(r["rank"]): r for r in records_ if int(r.get("attempt", 0)) == last}
    out = []
    for rank in sorted(set(codes) | set(records)):
        rec = records.get(rank, {})
        tail: Iterable[str] = relay.tails.get(rank, [])
        code = codes.get(rank, rec.get("code", 1))
        error = rec.get("error") or last_error(tail)
        when = rec.get("time", (times or {}).get(rank, float("inf")))
        out.append(Failure(rank, code, error, when, lost_peer(tail) or lost_peer([error])))
    return out


# ----------------------------------------------------------------------------- torch's elastic agent


def run_agent(opts: LaunchOptions) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    nproc = int(opts.nprocs or 1)
    # A host of a several-host launch is told its first rank (hosts may hold different counts).
    first = int(os.environ.pop("RINGPIPE_LAUNCH_FIRST_RANK", opts.node_rank * nproc))
    relay = OutputRelay(nproc, rank_of=lambda slot: first + slot, output_dir=opts.output_filename,
                        world_size=nproc * opts.nnodes)
    cmd = [
        f"--nproc-per-node={nproc}",
        f"--nnodes={opts.nnodes}",
        f"--node-rank={opts.node_rank}",
        f"--max-restarts={opts.max_restarts}",
        "--monitor-interval=0.1",
        f"--log-dir={os.path.join(relay.dir, 'agent')}",
        "--no-python",
    ]
    if opts.nnodes > 1:
        assert opts.rdzv_endpoint is not None
        host, _, port = opts.rdzv_endpoint.rpartition(":")
        cmd += [f"--master-addr={host}", f"--master-port={port}"]
        # gloo binds to the address its hostname resolves to, which on many clusters is not the
        # interface that reaches the other nodes: pick the interface of the route to node 0.
        ifname = _route_interface(host)
        if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    else:
        addr = opts.master_addr or "127.0.0.1"
        cmd += [f"--master-addr={addr}", f"--master-port={opts.master_port or free_port()}"]
    cmd += _rank_command(opts)
    os.environ.update(_common_env(opts, relay))
    os.environ["RINGPIPE_LAUNCH_SLOTS"] = "local"
    # The agent's own log lines repeat what the report says (-v on ringpipe shows them); a restart
    # is announced in one line.
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)
        agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
        agent_log.setLevel(logging.INFO)
        agent_log.addFilter(_RestartNote(opts.max_restarts))
    try:
        torchrun.main(cmd)
    except ChildFailedError as exc:
        codes = {r: f.exitcode for r, f in exc.failures.items()}
        times = {r: float(f.timestamp) for r, f in exc.failures.items()}
        # The agent stops the survivors with SIGTERM after the first failure: they are not causes.
        stopped = {r for r, c in codes.items() if c == -signal.SIGTERM}
        if stopped != set(codes):
            for r in stopped:
                codes.pop(r)
        relay.close()
        return report_failures(_failures(relay, codes, times))
    except (SignalException, KeyboardInterrupt) as exc:  # the agent stopped every rank first
        relay.close()
        sig = int(getattr(exc, "sigval", signal.SIGINT))
        if not opts.host_of_many:  # a host stopped by a several-host launcher: that launcher says why
            print(f"{label()}: interrupted by {signal.Signals(sig).name}; every rank was stopped",
                  file=sys.stderr)
        return 128 + sig
    except Exception as exc:  # noqa: BLE001 - the agent itself failed (rendezvous, ...): say so in one line
        relay.close()
        print(f"{label()}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    relay.close()
    return 0


class _RestartNote(logging.Filter):
    """Replace the agent's log lines by one line per restart."""

    def __init__(self, max_restarts: int) -> None:
        super().__init__()
        self.max_restarts, self.done = max_restarts, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "will restart worker group" in str(record.msg) and "attempts left" in str(record.msg):
            self.done += 1
            print(f"{label()}: a rank failed; restarting every rank (restart {self.done} of "
                  f"{self.max_restarts})", file=sys.stderr, flush=True)
        return False


def _route(host: str) -> tuple[str, list[str]] | None:
    """(address, words of ``ip -o route get``) for ``host``, or None if unknown."""
    import socket

    try:
        addr = socket.gethostbyname(host)
        out = subprocess.run(["ip", "-o", "route", "get", addr], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return addr, out.stdout.split()


def _route_interface(host: str) -> str | None:
    """The network interface of the route to ``host`` (``ip route get``), or None if unknown.

    When ``host`` is this machine (node 0 itself), the interface that holds its address.
    """
    found = _route(host)
    if found is None:
        return None
    addr, words = found
    dev = words[words.index("dev") + 1] if "dev" in words else None
    if dev == "lo" and not addr.startswith("127."):
        try:
            out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[3].split("/")[0] == addr:
                return None if parts[1] == "lo" else parts[1]
    return None if dev == "lo" else dev


def source_address(host: str) -> str | None:
    """This machine's address on the route to ``host`` (``ip route get``'s ``src``), or None."""
    found = _route(host)
    if found is None or "src" not in found[1]:
        return None
    return found[1][found[1].index("src") + 1]


# ----------------------------------------------------------------------------- mpirun


def mpirun_command(nprocs: int, argv: list[str] | tuple[str, ...], extra: list[str] | tuple[str, ...] = (),
                   tag_output: bool = True) -> list[str]:
    """The ``mpirun`` line for ``nprocs`` local ranks (Open MPI flags where it is Open MPI)."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise FileNotFoundError(
            "mpirun/mpiexec not found: install Open MPI (apt-get install openmpi-bin libopenmpi-dev) or MPICH"
        )
    cmd = [mpirun, "-n", str(nprocs)]
    if _is_open_mpi(mpirun):
        if tag_output:
            cmd += ["--tag-output"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd += ["--allow-run-as-root"]
        if nprocs > (os.cpu_count() or 1):
            cmd += ["--oversubscribe"]
        cmd += ["--bind-to", "none", "--map-by", "slot"]
    elif tag_output:
        cmd += ["-prepend-rank"]
    return cmd + list(extra) + list(argv)


def _is_open_mpi(mpirun: str) -> bool:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in (out.stdout + out.stderr) or "OpenRTE" in (out.stdout + out.stderr)


def _die_with_launcher(launcher: int) -> Any:
    def setup() -> None:  # in the child, before exec: mpirun ends (and stops its ranks) with us
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != launcher:
            os._exit(1)

    return setup


_MPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_MPI_EXIT = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]\s+Exit code:\s+(\d+)")
_MPI_ABORT = re.compile(r"MPI_ABORT was invoked on rank (\d+) in communicator \S+ with errorcode (\d+)")


def run_mpi(opts: LaunchOptions) -> int:
    nproc = int(opts.nprocs or 1)
    relay = OutputRelay(nproc, output_dir=opts.output_filename)
    env = dict(os.environ, **_common_env(opts, relay))
    env["MASTER_ADDR"] = opts.master_addr or "127.0.0.1"
    env["MASTER_PORT"] = str(opts.master_port or free_port())
    cmd = mpirun_command(nproc, _rank_command(opts), tag_output=False)
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_launcher(os.getpid()))
    except BaseException:
        relay.close()
        raise
    assert proc.stdout is not None
    try:
        text = proc.stdout.read().decode(errors="replace")
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        relay.close()
        print(f"{label()}: interrupted by SIGINT; every rank was stopped", file=sys.stderr)
        return 130
    relay.close()
    if code == 0:
        if text.strip():
            sys.stderr.write(text)
        return 0
    codes: dict[int, int] = {}
    for rank, sig in _MPI_SIGNAL.findall(text):
        codes[int(rank)] = -int(sig)
    for rank, status in _MPI_EXIT.findall(text) + _MPI_ABORT.findall(text):
        codes.setdefault(int(rank), int(status))
    failures = _failures(relay, codes)
    if not failures:
        sys.stderr.write(text)
        print(f"{label()}: mpirun exited with code {code}", file=sys.stderr)
        return code
    if os.environ.get("RINGPIPE_LAUNCH_VERBOSE"):
        sys.stderr.write(text)
    return report_failures(failures)


# ----------------------------------------------------------------------------- multiprocessing


def _mp_rank(local_rank: int, opts: LaunchOptions, env: dict[str, str], launcher: int) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank)})
    bootstrap.die_with_parent(launcher)
    os.environ.update(bootstrap.rank_environment(os.environ))
    bootstrap.redirect_output(env[bootstrap.LAUNCH_DIR], local_rank)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the rank's new descriptors
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    for name in opts.python:  # the interpreter's options cannot change after fork: say so
        if name not in ("-u",):
            print(f"{label()}: --mode mp ignores the python option {name}", file=sys.stderr)
            break
    code = bootstrap.run_program(opts.program)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)


def run_mp(opts: LaunchOptions) -> int:
    """``--mode mp``: Python multiprocessing; each rank runs the program as ``__main__``."""
    import torch.multiprocessing as tmp

    nproc = int(opts.nprocs or 1)
    relay = OutputRelay(nproc, output_dir=opts.output_filename)
    env = _common_env(opts, relay)
    env.update({"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", MP_MARKER: "1",
                "MASTER_ADDR": opts.master_addr or "127.0.0.1",
                "MASTER_PORT": str(opts.master_port or free_port())})
    start = "fork" if sys.platform == "linux" else "spawn"
    ctx = tmp.start_processes(_mp_rank, args=(opts, env, os.getpid()), nprocs=nproc, join=False,
                              start_method=start)
    assert ctx is not None
    try:
        while not ctx.join(timeout=0.2):
            pass
    except KeyboardInterrupt:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        relay.close()
        print(f"{label()}: interrupted by SIGINT; every rank was stopped", file=sys.stderr)
        return 130
    except (tmp.ProcessRaisedException, tmp.ProcessExitedException):
        codes = {}
        for rank, p in enumerate(ctx.processes):
            p.join(timeout=5)
            if p.exitcode not in (None, 0, -signal.SIGTERM, -signal.SIGKILL) or rank == _first_failed(ctx):
                codes[rank] = p.exitcode if p.exitcode is not None else 1
        relay.close()
        return report_failures(_failures(relay, codes))
    relay.close()
    return 0


def _first_failed(ctx: Any) -> int | None:
    for rank, p in enumerate(ctx.processes):
        if p.exitcode not in (None, 0, -signal.SIGTERM):
            return rank
    return None
