"""The timeline written while the job runs (``HOROVOD_TIMELINE``, ``hvd.start_timeline``), readable however it ends.

Horovod's timeline is one Chrome-trace file that rank 0 writes as the job runs, each write
leaving the file valid JSON. ringpipe records events on every rank, so every rank appends its
own to the one file: rank 0 creates it (``{"otherData": {...}, "traceEvents": [`` then ``]}``),
and a rank appends by taking the file's lock (``flock``), writing its new records over the final
``]}`` and closing the array again, in one write. The file is therefore valid JSON between any
two writes: after a SIGKILL it holds everything flushed before it (a flush every 50 ms), and a
normal exit, an uncaught exception, SIGINT and SIGTERM flush the rest first.

Rows: one process per rank (``rank R @ host``), one thread row per tensor name (the ``name=`` of
an API call, as ``allreduce.avg_loss``, Horovod's row per tensor), per communicator for unnamed
operations, and apart from them the steps of ringpipe's own algorithms and its bookkeeping
("training", "expected work"). Instants: ``start_timeline`` and ``stop_timeline`` where the
recording starts and stops, and, when cycles are marked (``HOROVOD_TIMELINE_MARK_CYCLES=1``),
``CYCLE_START`` where each collective starts: Horovod's background thread starts the operations
ready at each cycle (every ``HOROVOD_CYCLE_TIME`` ms), ringpipe's engine starts each operation
as soon as it is queued, so every collective starts a cycle of its own. Times are microseconds since rank 0 created the
file, from each host's wall clock (hosts on one time service line up to its accuracy).

Ranks whose host does not see rank 0's file (no shared file system) write nothing, as only
rank 0 writes Horovod's timeline; ``ringpipe trace`` merges the events saved at ``shutdown()``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from ringpipe.comm.events import (
    COMM,
    DETAIL,
    END,
    NBYTES,
    OP,
    PEER,
    START,
    TAG,
    EventLog,
    default_log,
)
from ringpipe.observe.timeline import row_of, span_name

__all__ = ["LiveTimeline", "active", "create_file", "start", "stop"]

log = logging.getLogger(__name__)

CLOSE = b"]}"
_ORIGIN = re.compile(rb'"start_time_since_epoch_in_micros":\s*(\d+)')
FLUSH_SECONDS = 0.05  # Horovod's writer thread writes as events come; a rank's flush with nothing new costs nothing
_BOOKKEEPING = ("training", "expected work")  # rows of ringpipe's own records, not operations


def create_file(path: str | Path) -> Path:
    """Create (or empty) the timeline file: a valid, empty trace whose header holds the time origin."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    origin = time.time_ns() // 1000
    head = {"ringpipe_timeline": 1, "start_time_since_epoch_in_micros": origin}
    with open(path, "wb") as fh:
        fh.write(b'{"displayTimeUnit": "ms", "otherData": ' + json.dumps(head).encode() + b', "traceEvents": [\n')
        fh.write(CLOSE)
    return path


class LiveTimeline:
    """This rank's writer: appends its events (those starting after ``start``) to the shared file."""

    def __init__(self, path: str | Path, rank: int, mark_cycles: bool = False, log_: EventLog | None = None,
                 interval: float = FLUSH_SECONDS) -> None:
        self.path = Path(path)
        self.rank = rank
        self.mark_cycles = mark_cycles
        self.events = log_ or default_log()
        self.interval = interval
        self.start_ns = time.perf_counter_ns()
        self._wall = time.time_ns() - self.start_ns  # perf_counter -> Unix time
        self._lock = threading.Lock()
        self._last: list[Any] | None = None  # the newest raw event already taken from the log
        self._pending: list[list[Any]] = []  # taken, still in flight
        self._marks: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}
        self._fd: int | None = None
        self._origin_us: int | None = None
        self._head_len = 0
        self._named = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.closed = False

    # ------------------------------------------------------------------ life

    def begin(self) -> LiveTimeline:
        self.mark("start_timeline")
        self._thread = threading.Thread(target=self._loop, name="ringpipe-timeline", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Mark the end, write everything recorded so far, and stop writing."""
        if self.closed:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.mark("stop_timeline")
        self.flush(final=True)
        self.closed = True
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception:  # the timeline must never take the job down
                log.debug("timeline flush failed", exc_info=True)

    # ------------------------------------------------------------------ records

    def mark(self, name: str) -> None:
        """An instant on this rank's row (``CYCLE_START``, ``start_timeline``, ``stop_timeline``)."""
        self._marks.append({"ph": "i", "name": name, "s": "p", "pid": self.rank, "tid": 0,
                            "ns": time.perf_counter_ns()})

    def _take(self, final: bool) -> list[list[Any]]:
        """Events finished since the last flush (all of them, finished or not, when ``final``)."""
        log_ = self.events._events
        if not final and not self._pending and (not log_ or log_[-1] is self._last):
            return []  # nothing new: no copy of the log
        raw = list(log_)  # atomic under the GIL
        new: list[list[Any]] = []
        for ev in reversed(raw):
            if ev is self._last:
                break
            new.append(ev)
        new.reverse()
        if raw:
            self._last = raw[-1]
        self._pending.extend(ev for ev in new if ev[START] >= self.start_ns)
        done = [ev for ev in self._pending if ev[END] or final]
        self._pending = [ev for ev in self._pending if not (ev[END] or final)]
        return done

    def _us(self, ns: int) -> float:
        assert self._origin_us is not None
        return round((ns + self._wall) / 1e3 - self._origin_us, 3)

    def _records(self, events: list[list[Any]], marks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self._named:
            self._named = True
            out.append({"ph": "M", "name": "process_name", "pid": self.rank, "tid": 0,
                        "args": {"name": f"rank {self.rank} @ {socket.gethostname()}"}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": self.rank, "tid": 0,
                        "args": {"sort_index": self.rank}})
        for ev in events:
            detail = ev[DETAIL] or {}
            row = row_of(ev[OP], ev[COMM], detail.get("name"))
            tid = self._tids.get(row)
            if tid is None:
                tid = self._tids[row] = len(self._tids) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid, "args": {"name": row}})
            args: dict[str, Any] = {"bytes": ev[NBYTES]}
            if ev[PEER] >= 0:
                args["peer"] = ev[PEER]
            if ev[TAG]:
                args["tag"] = ev[TAG]
            args.update({k: v for k, v in detail.items() if isinstance(v, (int, float, str, bool))})
            if not ev[END]:
                args["unfinished"] = True
            end = ev[END] or time.perf_counter_ns()
            out.append({"ph": "X", "name": span_name(ev[OP], detail), "cat": "comm", "pid": self.rank, "tid": tid,
                        "ts": self._us(ev[START]), "dur": round(max(0, end - ev[START]) / 1e3, 3), "args": args})
            if self.mark_cycles and ev[PEER] < 0 and "." not in ev[OP] and ev[COMM] not in _BOOKKEEPING:
                out.append({"ph": "i", "name": "CYCLE_START", "s": "p", "pid": self.rank, "tid": 0,
                            "ts": self._us(ev[START])})
        for m in marks:
            rec = dict(m)
            rec["ts"] = self._us(rec.pop("ns"))
            out.append(rec)
        return out

    # ------------------------------------------------------------------ file

    def _open(self) -> bool:
        """Open the file rank 0 created; False while it does not exist (or is not a timeline)."""
        if self._fd is not None:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return False
        head = os.pread(fd, 4096, 0)
        found = _ORIGIN.search(head)
        newline = head.find(b"\n")
        if found is None or newline < 0:
            os.close(fd)
            return False
        self._fd, self._origin_us, self._head_len = fd, int(found.group(1)), newline + 1
        return True

    def flush(self, final: bool = False) -> bool:
        """Append what is new; True when written (False: nothing new, or no file to write to)."""
        if self.closed or not self._lock.acquire(timeout=2):
            return False
        try:
            if not self._open():
                return False
            events = self._take(final)
            marks, self._marks = self._marks, []
            if not events and not marks:
                return False
            body = ",\n".join(json.dumps(r, separators=(",", ":")) for r in self._records(events, marks))
            return self._append(body.encode())
        finally:
            self._lock.release()

    def _append(self, body: bytes) -> bool:
        import fcntl

        fd = self._fd
        assert fd is not None
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(fd).st_size
            if size >= self._head_len + len(CLOSE) and os.pread(fd, len(CLOSE), size - len(CLOSE)) == CLOSE:
                at = size - len(CLOSE)
                sep = b"" if at == self._head_len else b",\n"
            else:  # a writer died in the middle of a write: keep what is there, start a new line
                at, sep = size, b",\n"
            os.pwrite(fd, sep + body + CLOSE, at)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return True


# ---------------------------------------------------------------------- the process's timeline

_ACTIVE: LiveTimeline | None = None
_HOOKED = False


def active() -> LiveTimeline | None:
    """The timeline this process writes now (None: none)."""
    return _ACTIVE


def start(path: str | Path, rank: int, mark_cycles: bool = False, create: bool | None = None,
          interval: float = FLUSH_SECONDS) -> LiveTimeline:
    """Start writing this rank's events to ``path`` (rank 0, or ``create``, creates the file first).

    A timeline already being written to another file is closed first; the same file again only
    changes ``mark_cycles`` (as Horovod's ``start_timeline``).
    """
    global _ACTIVE
    path = Path(path)
    current = _ACTIVE
    if current is not None and not current.closed:
        if current.path.resolve() == path.resolve():
            current.mark_cycles = mark_cycles
            return current
        stop()
    if create if create is not None else rank == 0:
        create_file(path)
    _ACTIVE = LiveTimeline(path, rank, mark_cycles, interval=interval).begin()
    _hook_exit()
    return _ACTIVE


def stop() -> None:
    """Mark the end, write the rest and close the timeline (nothing if none is written)."""
    global _ACTIVE
    tl, _ACTIVE = _ACTIVE, None
    if tl is not None:
        tl.close()


def _hook_exit() -> None:
    """Flush at interpreter exit and on SIGTERM (whose default action skips ``atexit``)."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    atexit.register(stop)
    if threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    tl = _ACTIVE
    if tl is not None:
        with contextlib.suppress(Exception):
            tl.mark("SIGTERM")
            tl.flush(final=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
