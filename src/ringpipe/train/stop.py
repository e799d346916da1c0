"""Ctrl-C during a run: the first SIGINT asks the loop to stop at its next agreed point, a later one stops at once."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

__all__ = ["REPEAT_S", "StopRequest"]


#: A second SIGINT within this many seconds of the first is the same Ctrl-C delivered twice (to the
#: process group by the terminal, and forwarded by the parent of spawned ranks); a later one stops at once.
REPEAT_S = 1.0


class StopRequest:
    """SIGINT handler: the first signal asks the loop to stop; a repeat after ``REPEAT_S`` seconds interrupts."""

    def __init__(self) -> None:
        self.at: float | None = None

    @property
    def requested(self) -> bool:
        return self.at is not None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.at is None:
            self.at = now
        elif now - self.at > REPEAT_S:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle SIGINT with this request inside the block (main thread only, unless SIGINT is ignored).

        A request already made to the handler it replaces is kept: a rank forked by a parent that
        was asked to stop (or asked while it started) stops too.
        """
        current = signal.getsignal(signal.SIGINT)
        if isinstance(current, StopRequest) and self.at is None:
            self.at = current.at
        if threading.current_thread() is not threading.main_thread() or current in (signal.SIG_IGN, None):
            yield self
            return
        previous = signal.signal(signal.SIGINT, self)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)
