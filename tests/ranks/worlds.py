"""Worlds of real ranks started once per session and reused by many checks, as torch's own tests do.

A :class:`World` forks ``size`` rank processes the first time a check needs that size and keeps
them. Each check is a plain function ``fn(comm, *args)``, sent to every rank by ``cloudpickle``
(a module-level function travels by name, a closure by value); the rank runs it on a fresh
communicator (``init_world`` over a new rendezvous port, as :func:`ringpipe.launch.spawn`
gives) in the test process's environment of the moment (a ``monkeypatch.setenv`` reaches the
ranks, as it reaches a forked rank), then shuts down what the check left (``hvd.shutdown()``,
the world), and sends back the result or its traceback. What a fresh process alone gives stays
with :func:`ringpipe.launch.spawn`: output read with ``capfd`` (a kept rank writes to the file
descriptors of the test that started it), module state a check changes for good. :meth:`World.spawn` has
:func:`ringpipe.launch.spawn`'s signature and results, so that a test moves onto a kept world by
calling ``worlds.spawn`` instead of ``spawn``.

A check that fails raises :class:`RankFailed` (a :class:`~ringpipe.launch.WorkerFailed`): it
names the rank that failed first, not one that merely lost its peer, and carries every failed
rank's traceback. A check that does not finish within its timeout raises :class:`CheckTimeout`
naming the ranks still running; the world is then stopped, and the next check starts a fresh
one, as it does after a rank died or a check was interrupted (pytest-timeout, Ctrl-C).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from ringpipe.launch import WorkerFailed
from ringpipe.launch.relay import PEER_LOST

__all__ = ["World", "Worlds", "RankFailed", "CheckTimeout"]

#: Seconds a check may run when its caller sets no timeout (below pytest's default 300 s, so
#: that this message, naming the ranks still running, is the one a hung check ends with).
DEFAULT_TIMEOUT = 280.0
#: Seconds the other ranks get to finish once one rank failed (a lost peer ends them sooner).
GRACE = 20.0


class RankFailed(WorkerFailed):
    """A check failed on a rank: the first line names it, the tracebacks of every failed rank follow."""

    def __init__(self, rank: int, cause: str, tracebacks: dict[int, str]) -> None:
        super().__init__(rank, cause)
        self.tracebacks = tracebacks
        self.cause = cause
        self.hung: list[int] = []  # ranks still running the check when it was given up

    def __str__(self) -> str:
        head = super().__str__()
        tails = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(self.tracebacks.items()))
        return f"{head}\n{tails}"


class CheckTimeout(TimeoutError):
    """A check did not finish on every rank in time; the world that ran it has been stopped."""


def _serve(rank: int, size: int, conn: Any, parent: int) -> None:
    """A rank's loop: run each check it is sent on a fresh communicator, answer, repeat."""
    from ringpipe.launch.bootstrap import die_with_parent

    die_with_parent(parent)
    os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    base = dict(os.environ)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not message:
            return
        reply = _run_check(rank, size, base, message)
        try:
            conn.send_bytes(reply)
        except (BrokenPipeError, OSError):
            return


def _run_check(rank: int, size: int, base: dict[str, str], message: bytes) -> bytes:
    """One check on this rank, between a fresh world and a clean shutdown: pickled (ok, value)."""
    from ringpipe.comm.events import default_log
    from ringpipe.comm.rendezvous import init_world, shutdown_world
    from ringpipe.launch.bootstrap import rank_environment

    port, backend, environ, env, payload = pickle.loads(message)
    os.environ.clear()
    os.environ.update(environ)  # the test process's environment now, as a forked rank would have it
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size),
                       "LOCAL_WORLD_SIZE": str(size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    os.environ.update(rank_environment(os.environ))
    default_log().clear()
    try:
        fn, args = cloudpickle.loads(payload)
        comm = init_world(backend)
        try:
            value = fn(comm, *args)
        finally:
            _release()
            shutdown_world()
        return pickle.dumps((True, value))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the test with its traceback
        last = (traceback.format_exception_only(type(exc), exc)[-1].strip() or type(exc).__name__)
        return pickle.dumps((False, (last, traceback.format_exc())))
    finally:
        os.environ.clear()
        os.environ.update(base)


def _release() -> None:
    """Stop what a check left running: the Horovod-style state (engines, timeline) if initialised."""
    import ringpipe

    if ringpipe.is_initialized():
        ringpipe.shutdown()


class World:
    """``size`` kept rank processes (forked on first use) that run one check at a time."""

    def __init__(self, size: int, backend: str = "gloo") -> None:
        self.size = size
        self.backend = backend
        self.procs: list[multiprocessing.Process] = []
        self.conns: list[Any] = []
        self.starts = 0  # how many times the ranks were started (1 unless a check broke them)

    def _start(self) -> None:
        # Every rank that steps a torch optimizer imports torch._dynamo (about 1 s of CPU, at the
        # first step): imported here once, each forked rank has it already.
        import torch._dynamo  # noqa: F401

        ctx = multiprocessing.get_context("fork")
        for rank in range(self.size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, self.size, theirs, os.getpid()),
                               name=f"world{self.size}-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
        self.starts += 1

    def ready(self) -> World:
        """This world with every rank running: (re)started here if a rank is missing.

        A check that starts threads of its own in the test process calls it first, so that no rank
        is forked while those threads run.
        """
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.stop()
            self._start()
        return self

    def stop(self) -> None:
        """End the ranks (a clean goodbye, then SIGKILL for any that do not go)."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"")
        deadline = time.monotonic() + 2.0
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def run(self, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None,
            timeout: float | None = None) -> list[Any]:
        """``fn(comm, *args)`` on every rank; the results in rank order, or :class:`RankFailed`."""
        from ringpipe.ports import free_port

        self.ready()
        payload = cloudpickle.dumps((fn, tuple(args)))
        message = pickle.dumps((free_port("127.0.0.1"), self.backend, dict(os.environ), dict(env or {}), payload))
        done = False
        try:
            for conn in self.conns:
                conn.send_bytes(message)
            out = self._gather(getattr(fn, "__qualname__", repr(fn)), timeout or DEFAULT_TIMEOUT)
            done = True
            return out
        except RankFailed as exc:
            done = not exc.hung and all(p.is_alive() for p in self.procs)  # every rank answered
            raise
        finally:
            if not done:  # a rank died or hung, a timeout or an interruption: fresh ranks next time
                self.stop()

    def _gather(self, name: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, tuple[str, str]] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.conns))
        while pending:
            wait = deadline - time.monotonic()
            if failures:
                wait = min(wait, GRACE)
            ready = multiprocessing.connection.wait(list(pending.values()), timeout=max(0.0, wait))
            if not ready:
                break
            for conn in ready:
                rank = self.conns.index(conn)
                del pending[rank]
                try:
                    ok, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    code = self.procs[rank].exitcode
                    failures[rank] = (f"the rank process died (exit code {code})", "")
                    continue
                if ok:
                    results[rank] = value
                else:
                    failures[rank] = value
        if failures:
            raise self._failed(failures, sorted(pending))
        if pending:
            raise CheckTimeout(f"check {name} did not finish within {timeout:.0f} s on rank(s) "
                               f"{sorted(pending)} of a {self.size}-rank world; the world is restarted")
        return [results[r] for r in range(self.size)]

    def _failed(self, failures: dict[int, tuple[str, str]], hung: list[int]) -> RankFailed:
        def lost_peer(cause: str) -> bool:
            return any(p in cause.lower() for p in PEER_LOST)

        first = min(failures, key=lambda r: (lost_peer(failures[r][0]), r))
        tracebacks = {r: tb or cause for r, (cause, tb) in failures.items()}
        for r in hung:
            tracebacks[r] = "(still running when the check was given up)"
        failed = RankFailed(first, failures[first][0], tracebacks)
        failed.hung = hung
        return failed


class Worlds:
    """One kept :class:`World` per size, started when a check first needs it."""

    #: A check's limit where its call sets none (tests/ranks/conftest.py sets it for each test).
    timeout: float = DEFAULT_TIMEOUT

    def __init__(self) -> None:
        self.worlds: dict[tuple[int, str], World] = {}

    def world(self, size: int, backend: str = "gloo") -> World:
        key = (size, backend)
        if key not in self.worlds:
            self.worlds[key] = World(size, backend)
        return self.worlds[key]

    def spawn(self, fn: Callable[..., Any], nprocs: int, backend: str = "gloo", args: Sequence[Any] = (),
              env: dict[str, str] | None = None, timeout: float | None = None) -> list[Any]:
        """:func:`ringpipe.launch.spawn` on a kept world: ``fn(comm, *args)`` per rank, in rank order."""
        if backend != "gloo":
            from ringpipe.launch import spawn

            return spawn(fn, nprocs, backend=backend, args=args, env=env)
        return self.world(nprocs, backend).run(fn, *args, env=env, timeout=timeout or self.timeout)

    def stop(self) -> None:
        for world in self.worlds.values():
            world.stop()
