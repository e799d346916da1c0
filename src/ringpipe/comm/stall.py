"""The stall inspector: a communication that waits too long is reported with what the other ranks do.

A collective that one rank never calls does not fail: the others wait in it (for gloo, until the
process group's timeout, 30 minutes by default). Like Horovod's stall inspector, a thread on
every rank looks at the operations in flight at the choke point; when one has waited
``seconds``, the rank publishes what it waits for in the job's key-value store (the c10d store of
the process group) and reads what the other ranks published, then logs one warning such as::

    rank 0 has waited 61 s in allreduce (4.0 MiB) on world; waiting too: rank 1 in allreduce on
    world (61 s); not in any communication: rank 2 for 75 s (still computing, stuck outside
    ringpipe, or it took another code path)

A rank publishes how long it has been out of communication (since its last operation ended)
once that passes half the threshold, so the warning gives each idle rank's real idle time.

Ranks that wait in different operations are named as such: the program calls collectives in a
different order on different ranks. ``RINGPIPE_STALL_CHECK_SECONDS`` sets the threshold (60 by
default, 0 turns the inspector off). Under MPI, which has no c10d store, rank 0 serves one for
the inspector (:func:`ringpipe.comm.rendezvous.init_world`); where no store can be reached, the
warning says what this rank waits for only.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from typing import Any

from ringpipe.comm.events import COMM, END, NBYTES, OP, PEER, START, EventLog, human_bytes
from ringpipe.comm.kvstore import LazyStore

__all__ = ["StallInspector", "describe"]

log = logging.getLogger(__name__)


def _unreachable(exc: Exception) -> None:
    log.warning("stall inspector: cannot reach the job's key-value store (%s); stall warnings "
                "name this rank's wait only", exc)


_TAIL = 4096  # in-flight operations are among the most recent events


def _what(state: dict[str, Any]) -> str:
    peer = f" with rank {state['peer']}" if state.get("peer", -1) >= 0 else ""
    return f"{state['op']} ({human_bytes(int(state['bytes']))}) on {state['comm']}{peer}"


def _seconds(x: float) -> str:
    return f"{x:.1f} s" if x < 10 else f"{x:.0f} s"


def describe(rank: int, mine: dict[str, Any], others: dict[int, dict[str, Any] | None], seconds: float,
             now: float | None = None) -> str:
    """The warning for ``rank`` waiting in ``mine``, given what each other rank published (None: nothing).

    An idle rank publishes ``{"state": "idle", "since": UNIX_TIME}`` (when its last operation
    ended); ``now`` (default: the current time) gives its idle time.
    """
    now = time.time() if now is None else now
    parts = [f"rank {rank} has waited {mine['waiting_s']:.0f} s in {_what(mine)}"]
    waiting = {r: s for r, s in others.items() if s and s.get("state") == "waiting"}
    idle = sorted(r for r, s in others.items() if not s or s.get("state") != "waiting")
    if waiting:
        parts.append("waiting too: " + ", ".join(
            f"rank {r} in {_what(s)} ({s['waiting_s']:.0f} s)" for r, s in sorted(waiting.items())))
    if idle:
        def how_long(r: int) -> str:
            s = others.get(r)
            if s and s.get("state") == "idle" and "since" in s:
                return f"rank {r} for {_seconds(max(0.0, now - float(s['since'])))}"
            return f"rank {r} for less than {_seconds(seconds / 2)}" if s else f"rank {r} (no report from it)"
        parts.append("not in any communication: " + ", ".join(how_long(r) for r in idle)
                     + " (still computing, stuck outside ringpipe, or it took another code path)")
    ops = {(s["op"], s["comm"]) for s in [mine, *waiting.values()] if s.get("peer", -1) < 0}
    if len(ops) > 1:
        parts.append("the ranks wait in different collectives: the program calls them in a different "
                     "order on different ranks")
    return "; ".join(parts)


class StallInspector:
    """Watches this rank's operations in flight; see the module docstring."""

    def __init__(self, rank: int, size: int, log_: EventLog, seconds: float, store: Any = None,
                 prefix: str = "ringpipe/stall", interval: float | None = None) -> None:
        self.rank, self.size, self.events, self.seconds = rank, size, log_, seconds
        # ``store``: a key-value store (``set``/``get``/``check``), or a function that opens one
        # when a stall first needs it.
        self._store, self.prefix = LazyStore(store, _unreachable), prefix
        self.interval = interval or min(5.0, max(0.1, seconds / 4))
        self.reports: list[str] = []
        #: End this process once an operation has waited this long (0: never), after calling
        #: each of ``on_shutdown`` (Horovod's ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``).
        self.shutdown_seconds = 0.0
        self.on_shutdown: list[Any] = []
        self._published: Any = False  # what this rank last published: False, True (waiting), ("idle", since)
        self._started = time.perf_counter_ns()
        self._reported: dict[int, float] = {}  # id of the waiting event -> when last reported
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StallInspector:
        self._thread = threading.Thread(target=self._loop, name="ringpipe-stall-inspector", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # the inspector must never take the job down
                log.debug("stall inspection failed", exc_info=True)

    def _oldest_in_flight(self, now: int) -> list[Any] | None:
        tail = list(itertools.islice(reversed(self.events._events), _TAIL))  # atomic under the GIL
        pending = [ev for ev in tail if ev[END] == 0]
        return min(pending, key=lambda ev: ev[START]) if pending else None

    def check(self) -> str | None:
        """One inspection: publish this rank's state; return (and log) a warning when it stalls."""
        now = time.perf_counter_ns()
        ev = self._oldest_in_flight(now)
        waited = (now - ev[START]) / 1e9 if ev is not None else 0.0
        if ev is not None and self.shutdown_seconds and waited >= self.shutdown_seconds:
            self._shut_down(ev, waited)
        if ev is None:
            # Out of communication since the last operation ended: say since when, once it matters.
            since = self._last_end()
            if (now - since) / 1e9 >= self.seconds / 2:
                if self._published != ("idle", since):
                    self._publish({"state": "idle", "since": time.time() - (now - since) / 1e9})
                    self._published = ("idle", since)
            elif self._published:
                self._publish({"state": "ok"})
                self._published = False
            return None
        if waited < self.seconds / 2:
            if self._published:
                self._publish({"state": "ok"})
                self._published = False
            return None
        mine = {"state": "waiting", "op": ev[OP], "bytes": ev[NBYTES], "peer": ev[PEER], "comm": ev[COMM],
                "waiting_s": waited}
        self._publish(mine)
        self._published = True
        last = self._reported.get(id(ev))
        if waited < self.seconds or (last is not None and now - last < self.seconds * 1e9):
            return None
        self._reported = {id(ev): now}
        message = describe(self.rank, mine, self._read_others(), self.seconds, time.time())
        log.warning("stall: %s", message)
        self.reports.append(message)
        return message

    def _shut_down(self, ev: list[Any], waited: float) -> None:
        import os

        what = _what({"op": ev[OP], "bytes": ev[NBYTES], "peer": ev[PEER], "comm": ev[COMM]})
        log.error("stall: rank %d has waited %.0f s in %s, past the stall shutdown time of %g s: ending this "
                  "rank", self.rank, waited, what, self.shutdown_seconds)
        for fn in self.on_shutdown:
            try:
                fn()
            except Exception:  # ending anyway
                log.debug("stall shutdown hook failed", exc_info=True)
        os._exit(1)

    def _last_end(self) -> int:
        """When this rank's last operation ended (when the inspector started, before any)."""
        tail = list(itertools.islice(reversed(self.events._events), _TAIL))
        ends = [ev[END] for ev in tail if ev[END]]
        return max([self._started, *ends])

    @property
    def store(self) -> Any:
        """The key-value store, opened on first use; None without one (or when it cannot be reached)."""
        return self._store.get()

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _publish(self, state: dict[str, Any]) -> None:
        if self.store is not None:
            self.store.set(self._key(self.rank), json.dumps(state))

    def _read_others(self) -> dict[int, dict[str, Any] | None]:
        out: dict[int, dict[str, Any] | None] = {}
        if self.store is None:
            return out
        for r in range(self.size):
            if r == self.rank:
                continue
            key = self._key(r)
            out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return out
