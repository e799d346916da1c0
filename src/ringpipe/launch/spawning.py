"""Run a function on N local processes from inside Python (:func:`spawn`), and per-node ordering helpers.

:func:`spawn` starts the ranks with ``torch.multiprocessing``, each with the variables of a
torchrun rank and a world ready; a rank that raises or dies stops the others, and
:class:`WorkerFailed` names the rank that failed first (not one that merely lost its peer).
Every rank ends when the process that called :func:`spawn` ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.multiprocessing as tmp

from ringpipe.comm.base import Communicator
from ringpipe.comm.events import default_log
from ringpipe.comm.rendezvous import BACKENDS, init_world, shutdown_world
from ringpipe.launch.bootstrap import (
    VERBOSE,
    die_with_parent,
    failure_report,
    rank_environment,
    verbose_tracebacks,
)
from ringpipe.launch.relay import PEER_LOST
from ringpipe.ports import free_port

__all__ = ["spawn", "local_rank_zero_first", "WorkerFailed"]


class WorkerFailed(RuntimeError):
    """A worker process failed; the message names the rank and the cause.

    ``report`` is what the rank said about its exception (:func:`~ringpipe.launch.bootstrap.failure_report`:
    the user's frames, or Python's whole traceback where the rank's environment sets
    ``RINGPIPE_LAUNCH_VERBOSE``); "" where the rank died without one.
    """

    def __init__(self, rank: int, message: str, report: str = "") -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.report = rank, report


class _Report(str):
    """A failed rank's report, sent in its result's place."""


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
    launcher: int,
) -> None:
    die_with_parent(launcher)
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
    os.environ.update(rank_environment(os.environ))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # A forked rank starts with a copy of its parent's communication record: the rank's own
    # record (comm_stats, the profile, the timeline) begins here.
    default_log().clear()
    comm = init_world(backend)
    try:
        out = fn(comm, *args)
        # Plain pickle bytes: torch's queue would share tensors through file descriptors that
        # die with this process.
        results.put(pickle.dumps((local_rank, out)))
    except BaseException as exc:
        report = failure_report(exc, verbose_tracebacks(), hint=f"frames of ringpipe and the libraries left out; "
                                f"-v or {VERBOSE}=1 shows them")
        results.put(pickle.dumps((local_rank, _Report(report))))
        raise
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
    picklable, module-level ``fn``; ``fork`` starts faster and is the default on a host without
    GPUs. With NCCL, or once CUDA is initialised here, the default is ``spawn`` (a forked child
    cannot use CUDA); on a host with GPUs it is ``spawn`` too whenever ``fn`` and ``args`` can be
    pickled, because ``torch.cuda.is_available()`` alone (a test's skip condition, say) already
    makes CUDA unusable in forked children, and no call says whether that has happened.
    """
    if start_method is None:
        cuda = backend == "nccl" or torch.cuda.is_initialized()
        gpus = torch.cuda.device_count() > 0  # NVML's count: does not itself initialise CUDA
        start_method = "spawn" if cuda or (gpus and _picklable(fn, args)) or sys.platform != "linux" else "fork"
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

    # torch says "Terminating process N via signal SIGTERM" for each rank it stops after a
    # failure; WorkerFailed names the rank that failed and why.
    quiet = logging.getLogger("torch.multiprocessing.spawn")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        ctx_ = tmp.start_processes(
            _worker,
            args=(fn, nprocs, backend, port, tuple(args), results, dict(env or {}), os.getpid()),
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
        drain()
        report = out[rank] if isinstance(out[rank], _Report) else ""
        raise WorkerFailed(rank, cause, str(report)) from exc
    finally:
        quiet.setLevel(level)
    drain()
    return out



def _picklable(fn: Callable[..., Any], args: Sequence[Any]) -> bool:
    """Whether a ``spawn`` child can receive ``fn`` and ``args`` (module-level functions, plain data)."""
    try:
        pickle.dumps((fn, tuple(args)))
    except Exception:  # noqa: BLE001 - any pickling failure means: start by fork instead
        return False
    return True


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
    failures.sort(key=lambda f: (any(p in f[1].lower() for p in PEER_LOST), f[0] != first, f[0]))
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
