"""Departures: a rank that leaves says so, and a rank waiting for it is told who left and why.

Why: a backend reports a lost peer badly. Over gloo the waiting rank fails with "Connection
closed by peer" and no rank number, so the job's report names the rank that *waited*; under MPI
a rank blocked in a collective whose peer exited waits forever. So every rank keeps a small
record in the job's key-value store (the c10d store of the process group; under MPI the store
rank 0 serves for the stall inspector)::

    ringpipe/rank/<r> = {"state": "running", "beat": n, "last": "allreduce (4 B) on world"}

A thread refreshes it about once a second (``beat`` grows) and within a quarter second of a new
call (``last`` is the newest call in the communication log, so recording costs nothing on the
hot path). When the rank shuts its world
down, exits, or raises an uncaught exception, it writes its final state (``shutdown``,
``exited``, ``exception: ValueError: ...``) and the order of its departure before its sockets
close. A rank that dies without a word (SIGKILL, a crash) stops beating.

* gloo: the backend's error (connection closed or reset) reaches the choke point of
  :class:`~ringpipe.comm.base.Communicator`, which asks :func:`translate` to turn it into a
  :class:`PeerDeparted` naming the departed rank, the call this rank waits in and what the
  departed rank last did (a rank that stopped beating is named after a short wait).
* MPI: a rank blocked in a collective cannot be interrupted from another thread, so the beating
  thread is also a watchdog: when this rank has waited in a call for ``GRACE_S`` after a peer
  wrote its departure, it prints the same message and aborts the MPI job (as an uncaught
  exception does). A rank killed by a signal is reported by ``mpirun`` itself.

``RINGPIPE_DEPARTURES=0`` turns the records off (the backend's own errors then stand).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from ringpipe.comm.base import CommError
from ringpipe.comm.events import COMM, END, NBYTES, OP, PEER, START, human_bytes
from ringpipe.comm.kvstore import LazyStore

__all__ = ["PeerDeparted", "Departures", "start", "leave", "translate", "current", "is_peer_loss"]

log = logging.getLogger(__name__)

BEAT_S = 1.0  # how often a rank refreshes its record
LOOK_S = 0.25  # how often it looks for a new last call to publish
GRACE_S = 2.0  # under MPI: how long a call may still wait after a peer left before the job is aborted
SILENT_S = 3.5  # a rank whose beat has not changed for this long (and wrote nothing) is taken for dead
LINGER_S = 1.0  # rank 0, which usually serves the store, waits this long at most for the others' departures
PREFIX = "ringpipe/rank"
ORDER_KEY = "ringpipe/departures"

# Messages by which gloo (and the TCP transport under it) reports a peer that went away.
_PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
              "end of file", "socket closed", "read error", "pair closed")


class PeerDeparted(CommError):
    """A rank this one was communicating with left the job (exited, shut down, raised or died).

    ``rank`` is the departed rank (None when no rank could be named), ``call`` the call this rank
    was waiting in, ``last`` what the departed rank last did.
    """

    def __init__(self, message: str, rank: int | None = None, call: str = "", last: str = "") -> None:
        super().__init__(message)
        self.rank, self.call, self.last = rank, call, last
        self.gone: list[tuple[int, dict[str, Any]]] | None = None
        self.cause = ""


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` is a backend's report of a lost peer (not a ringpipe error)."""
    if isinstance(exc, CommError) or not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(p in text for p in _PEER_LOSS)


def _describe(ev: list[Any] | None) -> str:
    if ev is None:
        return "no communication yet"
    peer = f" with rank {ev[PEER]}" if ev[PEER] >= 0 and ev[OP] in ("send", "recv", "isend", "irecv") else ""
    state = "" if ev[END] else ", still waiting in it"
    return f"{ev[OP]} ({human_bytes(int(ev[NBYTES]))}) on {ev[COMM]}{peer}{state}"


class Departures:
    """This rank's record in the job's store and the watchdog over the others' (module docstring)."""

    def __init__(self, rank: int, size: int, events: Any, store: Any, backend: str,
                 abort: Any = None) -> None:
        self.rank, self.size, self.events, self.backend = rank, size, events, backend
        # a store, or a function that opens one (MPI ranks other than 0)
        self._store = LazyStore(store, lambda exc: log.debug("departures: the job's store is not reachable (%s)", exc))
        self._abort = abort  # under MPI: a function that aborts the job
        self._beat = 0
        self._left = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beat, when it last changed)

    # ---------------------------------------------------------------- this rank

    @property
    def store(self) -> Any:
        """The job's store, opened on first use; None without one (the backend's errors then stand)."""
        return self._store.get()

    def last_call(self) -> str:
        """What this rank last did: the newest event of its communication log."""
        tail = itertools.islice(reversed(self.events._events), 64)  # the newest call, not its inner steps
        ev = next((e for e in list(tail) if "." not in e[OP]), None)
        return _describe(ev)

    def _write(self, state: str) -> None:
        store = self.store
        if store is None:
            return
        with self._lock:
            self._beat += 1
            record = {"state": state, "beat": self._beat, "last": self.last_call(), "time": time.time()}
            if state != "running":
                record["order"] = int(store.add(ORDER_KEY, 1))
            store.set(f"{PREFIX}/{self.rank}", json.dumps(record))

    def leave(self, how: str) -> None:
        """Write this rank's departure (once): ``shutdown``, ``exited`` or ``exception: ...``."""
        if self._left:
            return
        self._left = True
        self.stop()
        try:
            self._write(how)
        except Exception:  # noqa: BLE001 - the store may be gone already (rank 0 left first)
            log.debug("departures: cannot record the departure", exc_info=True)
            return
        if self.rank == 0:
            self._linger()

    def _linger(self) -> None:
        """Wait (at most ``LINGER_S``) until every other rank has written its departure.

        Rank 0 serves the job's store under MPI and under ``ringpipe launch``: when it leaves first,
        the others' last writes meet a closed server and the store's client logs every failed call
        with a traceback, on a run that ended well. A rank still working after that is left to it.
        """
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline:
            recs = self.records()
            if len(recs) == self.size - 1 and all(rec.get("state") != "running" for rec in recs.values()):
                return
            time.sleep(0.02)

    def start(self) -> Departures:
        self._thread = threading.Thread(target=self._loop, name="ringpipe-departures", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the beat and wait for its thread: a daemon thread still inside a store call when the
        interpreter finalizes aborts the process (it cannot take the GIL back)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _loop(self) -> None:
        written, last, watched = 0.0, None, 0.0
        while not self._stop.is_set():
            try:
                now, call = time.monotonic(), self.last_call()
                if call != last or now - written >= BEAT_S:  # a new call is published within LOOK_S
                    self._write("running")
                    written, last = now, call
                if self._abort is not None and now - watched >= BEAT_S:
                    self._watch()
                    watched = now
            except Exception:  # noqa: BLE001 - the watchdog must never take the job down itself
                log.debug("departures: beat failed", exc_info=True)
            self._stop.wait(LOOK_S)

    # ---------------------------------------------------------------- the others

    def records(self) -> dict[int, dict[str, Any]]:
        """Every other rank's record (ranks that wrote none are left out)."""
        store = self.store
        out: dict[int, dict[str, Any]] = {}
        if store is None:
            return out
        for r in range(self.size):
            if r == self.rank:
                continue
            key = f"{PREFIX}/{r}"
            try:
                if store.check([key]):
                    out[r] = json.loads(store.get(key))
            except Exception:  # noqa: BLE001 - the store's server may have left with its rank
                break
        return out

    def departed(self, wait_s: float = 0.0) -> list[tuple[int, dict[str, Any]]]:
        """Ranks that wrote a departure, first one first; those silent for ``SILENT_S`` if none did.

        ``wait_s``: how long to keep looking when no rank has departed yet.
        """
        deadline = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            recs = self.records()
            for r, rec in recs.items():
                beat, since = self._seen.get(r, (-1, now))
                self._seen[r] = (rec.get("beat", 0), since if beat == rec.get("beat", 0) else now)
            gone = sorted(((r, rec) for r, rec in recs.items() if rec.get("state") != "running"),
                          key=lambda item: item[1].get("order", 0))
            if gone:
                return gone
            silent = [(r, {**rec, "state": "silent"}) for r, rec in recs.items()
                      if now - self._seen[r][1] >= SILENT_S]
            if silent or now >= deadline:
                return silent
            time.sleep(min(0.25, max(0.0, deadline - now)))

    def message(self, call: str, gone: list[tuple[int, dict[str, Any]]], cause: str = "") -> str:
        """``rank R left the job while rank M waited in CALL: R exited; its last call was ...``."""
        if not gone:
            text = f"a peer left the job while rank {self.rank} waited in {call} (no rank recorded its departure)"
            return f"{text} [{cause}]" if cause else text
        r, rec = gone[0]
        state = str(rec["state"])
        how = {"exited": "exited", "shutdown": "shut its world down", "silent":
               f"stopped without a word (killed or crashed; no sign of life for {SILENT_S:.0f} s)"}.get(
                   state, "raised an uncaught " + state.removeprefix("exception: ")
                   if state.startswith("exception: ") else state)
        text = (f"rank {r} left the job while rank {self.rank} waited in {call}: rank {r} {how}; "
                f"its last call was {rec.get('last', '?')}")
        if len(gone) > 1:
            text += "; then left: " + ", ".join(f"rank {o}" for o, _ in gone[1:])
        return f"{text} [{cause}]" if cause else text

    def _watch(self) -> None:
        """Under MPI: abort the job when this rank still waits ``GRACE_S`` after a peer departed."""
        ev = self._in_flight()
        if ev is None or (time.perf_counter_ns() - ev[START]) / 1e9 < GRACE_S:
            return
        gone = [(r, rec) for r, rec in self.records().items() if rec.get("state") != "running"]
        if not gone:
            return
        time.sleep(GRACE_S)
        if ev[END]:  # the call finished after all (the peer left after its last call)
            return
        gone.sort(key=lambda item: item[1].get("order", 0))
        text = self.message(_describe(ev).removesuffix(", still waiting in it"), gone)
        sys.stderr.write(f"ringpipe: {PeerDeparted.__name__}: {text}; aborting the MPI job\n")
        sys.stderr.flush()
        self._abort()

    def _in_flight(self) -> list[Any] | None:
        tail = list(itertools.islice(reversed(self.events._events), 256))
        pending = [ev for ev in tail if ev[END] == 0]
        return min(pending, key=lambda ev: ev[START]) if pending else None


_CURRENT: Departures | None = None


def current() -> Departures | None:
    return _CURRENT


def start(rank: int, size: int, events: Any, store: Any, backend: str, abort: Any = None) -> Departures | None:
    """Start this rank's record (replacing an earlier one); None when turned off or alone."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.stop()
        _CURRENT = None
    if size <= 1 or store is None or os.environ.get("RINGPIPE_DEPARTURES", "1").strip().lower() in (
            "0", "false", "no", "off"):
        return None
    _CURRENT = Departures(rank, size, events, store, backend, abort).start()
    _install_excepthook()
    return _CURRENT


def leave(how: str) -> None:
    """Record this rank's departure (if a record runs) and stop it."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.leave(how)
        _CURRENT = None


def translate(exc: BaseException, op: str, nbytes: int, comm: str) -> PeerDeparted | None:
    """A :class:`PeerDeparted` for a backend's lost-peer error ``exc`` raised in ``op``; else None."""
    call = f"{op} ({human_bytes(nbytes)}) on {comm}"
    if isinstance(exc, PeerDeparted):  # raised by an inner operation of the call ``op``: name the outer call
        if exc.call.startswith(call.split(" (")[0] + " ") or _CURRENT is None or exc.gone is None:
            return None
        return _named(_CURRENT, call, exc.gone, exc.cause)
    if not is_peer_loss(exc):
        return None
    cause = _cause(exc)
    records = _CURRENT
    if records is None:
        return PeerDeparted(f"a peer left the job during {call} [{cause}]", None, call)
    # In an elastic job the driver names the worker that failed and the survivors go on at once:
    # waiting for a silent peer's name here would hold the recovery up by seconds.
    from ringpipe.comm import elastic_rendezvous

    wait_s = 0.0 if elastic_rendezvous.active() else SILENT_S + BEAT_S
    return _named(records, call, records.departed(wait_s=wait_s), cause)


def _named(records: Departures, call: str, gone: list[tuple[int, dict[str, Any]]], cause: str) -> PeerDeparted:
    err = PeerDeparted(records.message(call, gone, cause), gone[0][0] if gone else None, call,
                       gone[0][1].get("last", "") if gone else "")
    err.gone, err.cause = gone, cause
    return err


def _cause(exc: BaseException) -> str:
    """The backend's words, short: ``Connection closed by peer [127.0.0.1]:6046``."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:  # gloo's source location
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0][:160]


def _install_excepthook() -> None:
    """Record ``exception: Type: message`` as the departure of a rank that raises, then go on."""
    previous = sys.excepthook
    if getattr(previous, "_ringpipe_departures", False):
        return

    def hook(kind: Any, value: Any, tb: Any) -> None:
        try:
            text = str(value).strip().splitlines()[0][:160] if str(value).strip() else ""
            leave(f"exception: {kind.__name__}: {text}" if text else f"exception: {kind.__name__}")
        finally:
            previous(kind, value, tb)

    hook._ringpipe_departures = True  # type: ignore[attr-defined]
    sys.excepthook = hook
