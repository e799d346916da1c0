"""The per-process event buffer that every communication operation writes to.

Recording is always on, so it must be cheap: an event is a small list appended to a bounded
deque, with times from ``time.perf_counter_ns``. The timeline, the communication table and the
doctor read these events; nothing patches the code paths it observes.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Event", "EventLog", "default_log", "comm_stats", "add_blocked", "blocked_ns", "human_bytes", "named",
           "name_next", "take_next_name", "internal", "negotiating", "split_internal"]

# Field positions inside the raw event list (kept as a list so that ``end`` can be filled in
# when an asynchronous operation completes without allocating a second object).
OP, NBYTES, PEER, START, END, TAG, COMM, DETAIL = range(8)

# The name of the tensor the calling thread is communicating (``name=`` of an API call), if any.
_NAMING = threading.local()


@contextlib.contextmanager
def named(name: str | None) -> Iterator[None]:
    """Events this thread records inside the block carry ``name`` (their ``detail["name"]``)."""
    before = getattr(_NAMING, "name", None)
    _NAMING.name = name
    try:
        yield
    finally:
        _NAMING.name = before


@contextlib.contextmanager
def _flagged(flag: str) -> Iterator[None]:
    """Set the thread's ``flag`` (read by :meth:`EventLog.begin` / :meth:`EventLog.record`) inside the block."""
    before = getattr(_NAMING, flag, False)
    setattr(_NAMING, flag, True)
    try:
        yield
    finally:
        setattr(_NAMING, flag, before)


def internal() -> contextlib.AbstractContextManager[None]:
    """Events this thread begins inside the block are ringpipe's own bookkeeping, not the program's calls.

    They carry ``detail["internal"]`` and are shown apart (:func:`comm_stats`, the profile):
    the hostname exchange at start-up, the announcements of Horovod-style calls.
    """
    return _flagged("internal")


def negotiating() -> contextlib.AbstractContextManager[None]:
    """Events this thread begins inside the block also carry the ranks' agreement on the call.

    An announcement whose message holds the call's data as well (a small allreduce riding in it,
    :mod:`ringpipe.check.announcement`) is the program's reduction, so it is not :func:`internal`; it
    carries ``detail["negotiated"]`` so that the timeline still shows it as Horovod's negotiation.
    """
    return _flagged("negotiating")


def name_next(name: str | None) -> None:
    """Name the next operation this thread queues (an API call sets it; the engine takes it)."""
    _NAMING.next = name


def take_next_name() -> str | None:
    """The name set by :func:`name_next` on this thread, once (None when there is none)."""
    name = getattr(_NAMING, "next", None)
    if name is not None:
        _NAMING.next = None
    return name


@dataclass(frozen=True)
class Event:
    """One communication operation as seen by this process."""

    op: str
    nbytes: int
    peer: int
    start_ns: int
    end_ns: int
    tag: int
    comm: str
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


class EventLog:
    """A bounded, thread-safe buffer of raw events (oldest dropped first)."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        self._events: collections.deque[list[Any]] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.origin_ns = time.perf_counter_ns()

    def begin(self, op: str, nbytes: int, peer: int, tag: int, comm: str) -> list[Any]:
        """Start an event; the caller fills in ``end`` with :meth:`end`."""
        name = getattr(_NAMING, "name", None)
        detail = {"name": name} if name else None
        if getattr(_NAMING, "internal", False):
            detail = {**(detail or {}), "internal": True}
        elif getattr(_NAMING, "negotiating", False):
            detail = {**(detail or {}), "negotiated": True}
        ev = [op, nbytes, peer, time.perf_counter_ns(), 0, tag, comm, detail]
        self._events.append(ev)  # deque.append is atomic under the GIL
        return ev

    @staticmethod
    def end(ev: list[Any]) -> None:
        if ev[END] == 0:
            ev[END] = time.perf_counter_ns()

    def record(
        self,
        op: str,
        nbytes: int,
        peer: int,
        start_ns: int,
        end_ns: int,
        tag: int = 0,
        comm: str = "",
        **detail: Any,
    ) -> dict[str, Any]:
        """Record an event whose times are already known (e.g. one step of a collective); returns its
        detail, stored as given (a caller may add to it later, e.g. a device time read afterwards)."""
        name = getattr(_NAMING, "name", None)
        if name and "name" not in detail:
            detail["name"] = name
        if getattr(_NAMING, "internal", False):
            detail["internal"] = True
        self._events.append([op, nbytes, peer, start_ns, end_ns, tag, comm, detail or None])
        return detail

    def events(self) -> list[Event]:
        with self._lock:
            raw = list(self._events)
        return [
            Event(e[OP], e[NBYTES], e[PEER], e[START], e[END] or e[START], e[TAG], e[COMM], e[DETAIL] or {})
            for e in raw
        ]

    def clear(self) -> None:
        self._events.clear()

    def __len__(self) -> int:
        return len(self._events)


_P2P = ("send", "recv", "isend", "irecv")


def split_internal(events: Iterable[Event]) -> tuple[list[Event], list[Event]]:
    """(the program's own calls, ringpipe's internal ones), each in recorded order.

    Internal: events marked by :func:`internal`; parts of a call (``allreduce.header``, the
    consistency check; ``allreduce.step``, an algorithm's step); and the messages an algorithm
    of :mod:`ringpipe.collectives` sends for a call: point-to-point operations that begin inside
    a synchronous algorithm-run collective on the same communicator.
    """
    events = list(events)
    runs: dict[str, list[tuple[int, int]]] = {}
    for e in events:
        if "." not in e.op and e.detail.get("algorithm") and not e.op.startswith("i") and e.op not in _P2P:
            runs.setdefault(e.comm, []).append((e.start_ns, e.end_ns))
    mine: list[Event] = []
    theirs: list[Event] = []
    for e in events:
        inside = e.op in _P2P and any(a <= e.start_ns <= b for a, b in runs.get(e.comm, ()))
        (theirs if e.detail.get("internal") or "." in e.op or inside else mine).append(e)
    return mine, theirs


def summarize(events: Iterable[Event]) -> dict[str, dict[str, float]]:
    """Count, bytes and total/mean time per operation name."""
    table: dict[str, dict[str, float]] = {}
    for ev in events:
        row = table.setdefault(ev.op, {"calls": 0, "bytes": 0, "time_s": 0.0})
        row["calls"] += 1
        row["bytes"] += ev.nbytes
        row["time_s"] += ev.duration_s
    for row in table.values():
        row["mean_us"] = 1e6 * row["time_s"] / row["calls"] if row["calls"] else 0.0
    return table


_DEFAULT = EventLog()


def default_log() -> EventLog:
    """The process-wide event buffer that communicators record into unless given another."""
    return _DEFAULT


def comm_stats(log: EventLog | None = None, internal: bool = False) -> dict[str, dict[str, float]]:
    """Per-operation summary (calls, bytes, time) of the program's calls recorded so far.

    ``internal=True``: of ringpipe's own calls instead (see :func:`split_internal`: the
    consistency headers, start-up's hostname exchange, announcements, algorithms' messages).
    """
    mine, theirs = split_internal((log or _DEFAULT).events())
    return summarize(theirs if internal else mine)


# Nanoseconds each thread spent blocked waiting for communication (a synchronous operation, or
# the wait for an asynchronous one): the communication a thread could not overlap with work.
_BLOCKED: collections.defaultdict[int, int] = collections.defaultdict(int)


def add_blocked(ns: int) -> None:
    """Count ``ns`` nanoseconds of waiting for communication against the calling thread."""
    _BLOCKED[threading.get_ident()] += ns  # each thread updates only its own key


def blocked_ns(thread: int | None = None) -> int:
    """Nanoseconds ``thread`` (default: the calling one) has spent blocked on communication so far."""
    return _BLOCKED.get(threading.get_ident() if thread is None else thread, 0)


def human_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``4.0 KiB``, ``1.5 MiB``, ``2.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
