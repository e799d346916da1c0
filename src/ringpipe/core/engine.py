"""The background engine: one thread per communicator that runs queued collectives in submission order.

Why a thread: gradient buckets are handed over from autograd hooks while backward is still
running; the engine thread performs their collectives while the main thread keeps computing
(the role of Horovod's background thread and of DDP's reducer). Because every rank submits
its collectives in the same order and the engine runs them strictly in that order, ranks never
disagree about which collective comes next. With MPI, only the engine thread calls MPI: every
data-parallel operation of ringpipe on a communicator goes through its engine.

A task is a callable run on the engine thread. If it returns a :class:`~ringpipe.comm.Work`
(an operation still in flight on a thread-safe backend such as gloo or NCCL), the engine moves
on to the next task and the waiter completes the work; on MPI the engine completes it before
the next task, so MPI is entered from one thread only.

Named operations match by name, as Horovod's do: a task may carry a ``key`` (Horovod's tensor
name, such as ``allreduce.grad_w`` or ``barrier``). When the ranks' announced calls differ and
each rank's current task has a key, the ranks compare their current and queued keys
(:meth:`Engine.keys`); the first key that every rank has is run first, out of submission order
(:meth:`Engine.run_queued`), and the others are announced again after it. So a rank that
posted ``allreduce_async(name="a")`` and then waits in a barrier meets a rank that reached the
barrier first. Unnamed operations keep their order, as Horovod's (named by a per-process
counter) do.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ringpipe.check.call import InvalidCallError, MismatchError
from ringpipe.comm.base import Communicator, Work
from ringpipe.comm.events import add_blocked, named, take_next_name
from ringpipe.core.errors import EngineError, EngineInvalidCallError, EngineMismatchError

__all__ = ["Engine", "Handle"]

log = logging.getLogger(__name__)


_UNSET = object()


def _run_named(tensor: str, task: Callable[[], Any]) -> Any:
    with named(tensor):
        return task()


class Handle:
    """The result of a submitted task: ``wait()`` returns it, ``done()`` polls without blocking."""

    __slots__ = ("_event", "_value", "_error", "_then", "_finished", "_lock", "_waited", "name", "key")

    def __init__(self, then: Callable[[Any], Any] | None = None, name: str = "", key: str | None = None) -> None:
        self._event = threading.Event()
        self._value: Any = _UNSET
        self._error: BaseException | None = None
        self._then = then
        self._finished = False
        self._waited = False  # wait() was called: returned or raised
        self._lock = threading.Lock()
        self.name = name
        self.key = key  # the name it matches by across ranks (None: by its place in the order)

    def __repr__(self) -> str:
        return f"<Handle {self.name or '?'} done={self.done()}>"

    # called by the engine thread
    def _set(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error = value, error
        self._event.set()

    def _complete(self) -> Any:
        """Finish the in-flight work and run ``then`` exactly once (thread-safe)."""
        with self._lock:
            if not self._finished:
                error = self._error
                if isinstance(error, EngineError):
                    raise error  # already names the collective and the fix
                if isinstance(error, InvalidCallError):
                    raise EngineInvalidCallError(str(error)) from error  # names the ranks and the fix
                if isinstance(error, MismatchError):
                    raise EngineMismatchError(str(error)) from error
                if self._error is not None:
                    raise EngineError(f"collective {self.name!r} failed: {self._error}") from self._error
                value = self._value
                if isinstance(value, Work):
                    value = value.wait()
                if self._then is not None:
                    value = self._then(value)
                self._value, self._finished = value, True
            return self._value

    def wait(self) -> Any:
        try:
            if not self._event.is_set():
                t0 = time.perf_counter_ns()
                self._event.wait()
                add_blocked(time.perf_counter_ns() - t0)
            return self._complete()
        finally:
            self._waited = True

    def synchronized(self) -> bool:
        """Whether the caller waited for it (``synchronize``): until then its name stays in flight.

        Not ``done()``: whether the operation finished before a rank posts the same name again
        depends on timing, and every rank must refuse (or accept) that post alike.
        """
        return self._waited

    def done(self) -> bool:
        if not self._event.is_set():
            return False
        if self._error is not None or self._finished:
            return True
        value = self._value
        return not isinstance(value, Work) or value.is_completed()


class Engine:
    """Runs the collectives of one communicator on a background thread, in submission order.

    Use :meth:`Engine.of` to get the engine of a communicator (one per communicator, created
    on first use); :meth:`submit` queues a task and returns a :class:`Handle`; :meth:`run`
    runs one synchronously (inline when already on the engine thread).
    """

    _engines: weakref.WeakKeyDictionary[Communicator, Engine] = weakref.WeakKeyDictionary()
    _engines_lock = threading.Lock()

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        # MPI must only be entered from this thread, so its works finish here before the next task.
        self.complete_in_engine = comm.backend == "mpi"
        # Tasks not started yet, in submission order; the engine thread may take a named one out of
        # order (run_queued). None stops the thread.
        self._queue: collections.deque[tuple[Callable[[], Any], Handle] | None] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._current: list[str | None] = []  # keys of the tasks executing (nested: innermost last)
        self._thread = threading.Thread(target=self._loop, name=f"ringpipe-engine-{comm.name}", daemon=True)
        self._closed = False
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        #: Elements after the header in every announcement on this communicator
        #: (:mod:`ringpipe.check.announcement`); set on this thread, in order, by optimizers with join support.
        self.ride = 0
        # Tasks submitted and not yet executed, and the lock held while one executes: a task
        # may run inline on the caller's thread only while the engine has nothing before it.
        self._pending = 0
        self._count_lock = threading.Lock()
        self._exec_lock = threading.Lock()
        self._thread.start()

    @classmethod
    def of(cls, comm: Communicator) -> Engine:
        """The engine of ``comm`` (created on first use)."""
        with cls._engines_lock:
            engine = cls._engines.get(comm)
            if engine is None or engine._closed:
                engine = cls(comm)
                cls._engines[comm] = engine
            return engine

    @property
    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(
        self, task: Callable[[], Any], then: Callable[[Any], Any] | None = None, name: str = "",
        inline: bool = False, key: str | None = None,
    ) -> Handle:
        """Queue ``task``; ``then(result)`` runs once when the result is complete.

        ``key``: the name the task matches by across ranks (see the module docstring).

        ``inline``: when nothing submitted earlier is still waiting or running, run ``task`` on
        the calling thread instead (the order of collectives is the same), which saves two
        thread hand-offs; for the last bucket of a step, when the caller has nothing left to
        overlap with. Never with MPI, which only the engine thread may enter.
        """
        if self._closed:
            raise EngineError(f"the engine of {self.comm.name} was shut down; call ringpipe.init() again")
        tensor = take_next_name()  # the name= of the API call that queues it: its events carry it
        if tensor is not None:
            task = functools.partial(_run_named, tensor, task)
        handle = Handle(then, name, key)
        if self.on_engine_thread:
            self._execute(task, handle)
            return handle
        with self._count_lock:
            here = inline and not self.complete_in_engine and self._pending == 0
            self._pending += 1
        if not here:
            self._put((task, handle))
            return handle
        try:
            with self._exec_lock:  # tasks submitted meanwhile by other threads run after this one
                self._execute(task, handle)
        finally:
            with self._count_lock:
                self._pending -= 1
        return handle

    def run(self, task: Callable[[], Any], name: str = "", key: str | None = None) -> Any:
        """Run ``task`` on the engine thread after everything queued before it; return its result."""
        return self.submit(task, name=name, key=key).wait()

    def _put(self, item: tuple[Callable[[], Any], Handle] | None) -> None:
        with self._ready:
            self._queue.append(item)
            self._ready.notify()

    def keys(self) -> list[str]:
        """The key of the executing task, then those of the queued tasks (empty if the executing one has none).

        Called on the engine thread while a task's announcement finds the ranks' calls different.
        """
        current = self._current[-1] if self._current else None
        if current is None:
            return []
        with self._ready:
            queued = [item[1].key for item in self._queue if item is not None and item[1].key is not None]
        return [current, *queued]

    def run_queued(self, key: str) -> None:
        """Run now, on this thread, the first queued task with ``key`` (nothing if the executing one has it).

        The ranks chose ``key`` together (:meth:`keys`); the executing task then announces itself again.
        """
        if self._current and self._current[-1] == key:
            return
        with self._ready:
            index = next(i for i, item in enumerate(self._queue) if item is not None and item[1].key == key)
            task, handle = self._queue[index]  # type: ignore[misc]
            del self._queue[index]
        try:
            self._execute(task, handle)
        finally:
            with self._count_lock:
                self._pending -= 1

    def _execute(self, task: Callable[[], Any], handle: Handle) -> None:
        # a task run from inside another (a collective's own steps) is part of that operation
        outer = self._current[-1] if self._current else None
        self._current.append(handle.key if handle.key is not None else outer)
        try:
            # Engine tasks agreed on their calls already: each data-parallel collective is
            # announced with a fingerprint of its arguments (ringpipe.check.announcement), and the
            # optimizer's buckets were compared at construction.
            with self.comm.unchecked():
                value = task()
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
            log.debug("engine task %s failed", handle.name, exc_info=True)
            handle._set(None, exc)
            return
        finally:
            self._current.pop()
        handle._set(value, None)
        if self.complete_in_engine and (isinstance(value, Work) or handle._then is not None):
            # A failure is raised again to the waiter through the handle.
            with contextlib.suppress(BaseException):
                handle._complete()

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                item = self._queue.popleft()
            if item is None:
                return
            try:
                with self._exec_lock:
                    self._execute(*item)
            finally:
                with self._count_lock:
                    self._pending -= 1

    def shutdown(self) -> None:
        """Finish the queued tasks and stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._put(None)
        if not self.on_engine_thread:
            self._thread.join(timeout=60)
        with self._engines_lock:
            if self._engines.get(self.comm) is self:
                del self._engines[self.comm]
