"""Expected work: regions where a program declares that one rank does more than the others.

A trainer's rank 0 writes checkpoints, metrics and logs while the other ranks wait for it at
the next collective. That lateness is by design, not a fault, so the program marks it::

    with expected_work("checkpoint"):
        save_checkpoint(...)

The region is recorded as an event (op ``expected_work``, on its own timeline row) and the
doctor does not count the time spent in it as lateness.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from ringpipe.comm.events import EventLog, default_log

__all__ = ["expected_work", "EXPECTED_OP"]

EXPECTED_OP = "expected_work"


@contextlib.contextmanager
def expected_work(what: str, log: EventLog | None = None) -> Iterator[None]:
    """Mark the enclosed code as work this rank is expected to do alone (``what`` names it)."""
    t0 = time.perf_counter_ns()
    try:
        yield
    finally:
        (log or default_log()).record(EXPECTED_OP, 0, -1, t0, time.perf_counter_ns(), 0, "expected work", work=what)
