"""The launcher's side of a job's output and failures: per-rank pipes, whole prefixed lines, a report.

Every rank writes its standard output and error into two named pipes of a private directory
(see :mod:`ringpipe.launch.bootstrap`); one thread of the launcher reads them all and writes
each complete line once, prefixed ``[rank]:``, to the launcher's own stream. Lines of two ranks
never mix, mpirun's tags and torch's ``[rankN]:`` prefix are not doubled, and the launcher keeps
the end of every rank's error output to say why a job failed. A rank that fails leaves a small
record in the same directory, so the report can name the rank that failed first and, after it,
the ranks that failed only because they lost their connection to it.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import glob
import json
import os
import re
import selectors
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ringpipe.launch.speaker import label

__all__ = ["OutputRelay", "Failure", "order_failures", "report_failures", "PEER_LOST"]

#: Messages of a rank that failed only because another rank went away first.
PEER_LOST = ("connection closed by peer", "connection reset by peer", "remote worker crashing", "broken pipe",
             "connection refused", "connection reset", "peer closed", "socket closed")


class OutputRelay:
    """Named pipes for ``slots`` ranks and the thread that relays their lines with a rank prefix.

    ``rank_of(slot)`` gives the global rank printed for a slot (a node's local rank under
    several nodes). The directory also receives the ranks' failure records and, for torch's
    agent, its log files; it is removed by :meth:`close`.
    """

    def __init__(self, slots: int, rank_of: Callable[[int], int] = lambda s: s, tail_lines: int = 60,
                 output_dir: str | None = None, world_size: int | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="ringpipe-launch-")
        self._files = _RankFiles(output_dir, world_size or slots) if output_dir else None
        self._rank_of = rank_of
        self._sel = selectors.DefaultSelector()
        self._keep: list[int] = []  # a writer of every pipe, so a rank's exit never ends the pipe
        self._partial: dict[int, bytes] = {}
        self.tails: dict[int, collections.deque[str]] = {}
        for slot in range(slots):
            rank = rank_of(slot)
            self.tails[rank] = collections.deque(maxlen=tail_lines)
            for name, out in (("out", 1), ("err", 2)):
                path = os.path.join(self.dir, f"{name}-{slot}")
                os.mkfifo(path, 0o600)
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                self._keep.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                self._sel.register(fd, selectors.EVENT_READ, (rank, out))
                self._partial[fd] = b""
        self._records: list[dict] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ringpipe-output-relay", daemon=True)
        self._thread.start()

    def _emit(self, rank: int, out: int, data: bytes, final: bool = False) -> bytes:
        """Write the complete lines of ``data`` prefixed; return the unfinished rest."""
        *lines, rest = data.split(b"\n")
        if final and rest:
            lines.append(rest)
            rest = b""
        if not lines:
            return rest
        prefix = f"[{rank}]:".encode()
        torch_prefix = f"[rank{rank}]:".encode()
        chunk = bytearray()
        for line in lines:
            if line.startswith(torch_prefix):  # torch's own rank prefix: one prefix is enough
                line = line[len(torch_prefix):].lstrip(b" ")
            chunk += prefix + line + b"\n"
            if out == 2:
                self.tails[rank].append(line.decode(errors="replace"))
        text = bytes(chunk)
        with self._lock:
            _write_all(out, text)
            if self._files is not None:
                self._files.write(rank, out, text)
        return rest

    def _read(self, fd: int, rank: int, out: int) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    return
                raise
            if not data:
                return
            self._partial[fd] = self._emit(rank, out, self._partial[fd] + data)

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.2):
                rank, out = key.data
                self._read(key.fd, rank, out)

    def close(self) -> None:
        """Relay what is left (the ranks have ended), then remove the pipes and the directory."""
        self._stop.set()
        self._thread.join(timeout=5)
        for key in list(self._sel.get_map().values()):
            rank, out = key.data
            self._read(key.fd, rank, out)
            self._emit(rank, out, self._partial[key.fd], final=True)
            self._sel.unregister(key.fd)
            os.close(key.fd)
        for fd in self._keep:
            os.close(fd)
        self._keep = []
        if self._files is not None:
            self._files.close()
        self._records = self.records()
        shutil.rmtree(self.dir, ignore_errors=True)

    def records(self) -> list[dict]:
        """The failure records the ranks left (exceptions and non-zero exits)."""
        if self._records is not None:
            return self._records
        out = []
        for path in glob.glob(os.path.join(self.dir, "failed-*.json")):
            try:
                with open(path) as fh:
                    out.append(json.load(fh))
            except (OSError, ValueError):
                continue
        return out


class _RankFiles:
    """``DIR/rank.<R>/stdout`` and ``stderr`` for every rank, R zero-padded to the width of the last
    rank (Horovod's layout for ``--output-filename``); lines as the launcher prints them."""

    def __init__(self, folder: str, world_size: int) -> None:
        self.folder = folder
        self.width = len(str(max(world_size - 1, 0)))
        self.open: dict[tuple[int, int], Any] = {}

    def write(self, rank: int, out: int, data: bytes) -> None:
        f = self.open.get((rank, out))
        if f is None:
            where = os.path.join(self.folder, f"rank.{str(rank).zfill(self.width)}")
            os.makedirs(where, exist_ok=True)
            f = self.open[(rank, out)] = open(os.path.join(where, "stdout" if out == 1 else "stderr"), "wb")  # noqa: SIM115
        f.write(data)
        f.flush()

    def close(self) -> None:
        for f in self.open.values():
            f.close()
        self.open.clear()


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(Exception):  # a closed stream: write below anyway
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            continue
        except OSError:  # the launcher's own output is gone (a closed pipe): drop the rest
            return
        view = view[n:]


@dataclass
class Failure:
    """One failed rank: its exit status, what it said last and whether it only lost a peer."""

    rank: int
    code: int  # exit status; negative: killed by that signal
    error: str = ""
    time: float = float("inf")
    lost_peer: bool = False

    def what(self) -> str:
        if self.code < 0:
            try:
                return f"signal {signal.Signals(-self.code).name}"
            except ValueError:
                return f"signal {-self.code}"
        return f"exit code {self.code}"


def order_failures(failures: Iterable[Failure]) -> list[Failure]:
    """The rank that failed first comes first; ranks that failed because a peer left come last."""
    failures = list(failures)
    if all(f.lost_peer for f in failures):
        for f in failures:
            f.lost_peer = False
    return sorted(failures, key=lambda f: (f.lost_peer, f.time, f.rank))


def lost_peer(lines: Iterable[str]) -> bool:
    """Whether a rank's last error lines say it failed because a peer went away."""
    text = "\n".join(lines).lower()
    return any(p in text for p in PEER_LOST)


def last_error(lines: Iterable[str]) -> str:
    """The exception line of the last Python traceback in a rank's error output, or ''."""
    lines = list(lines)
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    found = ""
    for line in lines[starts[-1] + 1:] if starts else []:
        if line and not line[0].isspace() and re.match(r"^[A-Za-z_][\w.]*(:|$)", line):
            found = line
    return found


def report_failures(failures: list[Failure]) -> int:
    """Print who failed, first cause first; return the status the launcher exits with."""
    ordered = order_failures(failures)
    if not ordered:
        return 1
    first = ordered[0]
    for i, f in enumerate(ordered):
        detail = f": {f.error}" if f.error else ""
        if i == 0:
            line = f"rank {f.rank} failed with {f.what()}{detail}"
        elif f.lost_peer:
            line = f"rank {f.rank} then failed with {f.what()} after losing its connection to rank {first.rank}"
        elif f.error and f.error == first.error:  # its report above says it; once here is enough
            line = f"rank {f.rank} also failed with {f.what()}: the same error"
        else:
            line = f"rank {f.rank} also failed with {f.what()}{detail}"
        print(f"{label()}: {line}", file=sys.stderr)
    print(f"{label()}: the other ranks were stopped", file=sys.stderr)
    code = first.code
    return code if code > 0 else 128 - code if code < 0 else 1
