"""Gather every rank's communication events onto rank 0, on one clock, and save or load them.

Each process records its events with ``time.perf_counter_ns`` (``CLOCK_MONOTONIC`` on Linux),
which all processes of one host share but hosts do not. Ranks on rank 0's host keep their
times; a rank on another host estimates its offset to rank 0's clock with a few ping-pongs
(Cristian's method: the offset seen on the exchange with the shortest round trip), so that a
timeline and the doctor can compare when ranks entered the same collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ringpipe.comm.base import Communicator
from ringpipe.comm.events import Event, EventLog, default_log, internal

__all__ = ["RankEvents", "JobEvents", "collect_events", "save_events", "load_events", "clock_offsets", "member_hosts"]

FORMAT = "ringpipe-events/1"
_SYNC_ROUNDS = 8
_SYNC_TAG = 7_000_000


@dataclass
class RankEvents:
    """One rank's events, with times on rank 0's clock (nanoseconds)."""

    rank: int
    host: str
    events: list[Event]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class JobEvents:
    """Every rank's events of one job."""

    ranks: list[RankEvents]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def hosts(self) -> list[str]:
        return [r.host for r in self.ranks]


def clock_offsets(comm: Communicator, rounds: int = _SYNC_ROUNDS) -> list[int]:
    """Per rank, nanoseconds to subtract from its ``perf_counter_ns`` to get rank 0's clock.

    Zero for ranks on rank 0's host (one monotonic clock per host). Every rank must call this.
    Its waits are quiet (:mod:`ringpipe.observe.quiet`): under Open MPI, blocking calls spin, and
    on a machine with fewer cores than ranks the ranks waiting their turn (or for the result)
    took the cores that the two ranks exchanging timestamps needed.
    """
    from ringpipe.observe.quiet import quiet_wait

    hosts = member_hosts(comm)
    same_host = [h == hosts[0] for h in hosts]
    offsets = [0] * comm.size
    t = torch.zeros(1, dtype=torch.int64)

    def leg(work: Any, longest: float = 0.0002) -> None:  # poll briefly (a nap would lengthen the round trip)
        quiet_wait(comm, work, longest=longest, spin=0.0003)

    for peer in range(1, comm.size):
        if same_host[peer] or comm.rank not in (0, peer):
            continue
        best_rtt, best = None, 0
        for i in range(rounds):
            if comm.rank == 0:
                t0 = time.perf_counter_ns()
                leg(comm.isend(t, peer, _SYNC_TAG))
                leg(comm.irecv(t, peer, _SYNC_TAG))
                t1 = time.perf_counter_ns()
                if best_rtt is None or t1 - t0 < best_rtt:
                    best_rtt, best = t1 - t0, int(t.item()) - (t0 + t1) // 2
            else:
                # The first message comes when rank 0 reaches this rank's turn: wait for it with
                # longer naps (that round trip is the longest and never the one kept).
                leg(comm.irecv(t, 0, _SYNC_TAG), longest=0.002 if i == 0 else 0.0002)
                t.fill_(time.perf_counter_ns())
                leg(comm.isend(t, 0, _SYNC_TAG))
        offsets[peer] = best
    if comm.size == 1:
        return offsets
    # Rank 0 sends the result to each rank: a broadcast's waiting ranks spin (MPI), these sleep.
    table = torch.tensor(offsets, dtype=torch.int64)
    if comm.rank == 0:
        for q in range(1, comm.size):
            comm.isend(table, q, _SYNC_TAG + 1).wait()
    else:
        quiet_wait(comm, comm.irecv(table, 0, _SYNC_TAG + 1))
    return [int(v) for v in table.tolist()]


def member_hosts(comm: Communicator) -> list[str]:
    """The host of each member of ``comm`` (``localhost`` for all before hostnames are known)."""
    names = comm.topology.hostnames
    if not names:
        return ["localhost"] * comm.size
    return [names[g] for g in comm.global_ranks]


def _rank_info() -> dict[str, Any]:
    """Where this process runs: what the doctor needs to explain placement."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    info: dict[str, Any] = {"pid": os.getpid(), "cpus": cpus, "cpu_count": os.cpu_count() or 1}
    with contextlib.suppress(OSError):  # one id per booted kernel: containers and namespaces of a machine share it
        info["machine"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with contextlib.suppress(OSError, AttributeError):  # runnable processes, averaged over the last minute
        info["loadavg"] = os.getloadavg()[0]
    return info


def collect_events(
    comm: Communicator, log: EventLog | None = None, info: dict[str, Any] | None = None
) -> JobEvents | None:
    """Gather all ranks' events (recorded so far) onto rank 0; None on the other ranks.

    Every rank must call it (it is a collective). The exchange itself is not part of the result.
    ``info`` adds per-rank facts (e.g. a compute probe's time) to :attr:`RankEvents.info`.
    """
    log = log or default_log()
    mine = log.events()
    t0 = time.perf_counter()
    with internal():  # ringpipe's own calls, apart from the program's in comm_stats and the profile
        offsets = clock_offsets(comm)
    sync_ms = 1e3 * (time.perf_counter() - t0)
    shift = offsets[comm.rank]
    payload = {
        "host": member_hosts(comm)[comm.rank],
        "events": [
            (e.op, e.nbytes, e.peer, e.start_ns - shift, e.end_ns - shift, e.tag, e.comm, e.detail)
            for e in mine
        ],
        "info": {**_rank_info(), "clock_sync_ms": sync_ms, **(info or {})},
    }
    with internal():
        every = comm.allgather_object(payload) if comm.size > 1 else [payload]
    if comm.rank != 0:
        return None
    ranks = [
        RankEvents(r, p["host"], [Event(*e) for e in p["events"]], p["info"]) for r, p in enumerate(every)
    ]
    return JobEvents(ranks, {"backend": comm.backend, "size": comm.size, "comm": comm.name})


def save_events(path: str | Path, job: JobEvents) -> Path:
    """Write ``job`` as JSON (read back by :func:`load_events`, ``ringpipe trace`` and ``ringpipe doctor``)."""
    path = Path(path)
    data = {
        "format": FORMAT,
        "meta": job.meta,
        "ranks": [
            {
                "rank": r.rank,
                "host": r.host,
                "info": r.info,
                "events": [[e.op, e.nbytes, e.peer, e.start_ns, e.end_ns, e.tag, e.comm, e.detail] for e in r.events],
            }
            for r in job.ranks
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
    return path


def load_events(path: str | Path) -> JobEvents:
    """Read a file written by :func:`save_events`; a clear error for anything else."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such events file (write one with ringpipe.observe.save_events "
                                "or any `ringpipe train` of several processes)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc}); expected a ringpipe events file") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a ringpipe events file (format {FORMAT!r} expected)")
    ranks = [
        RankEvents(int(r["rank"]), str(r["host"]), [Event(*e) for e in r["events"]], dict(r.get("info", {})))
        for r in data["ranks"]
    ]
    return JobEvents(ranks, dict(data.get("meta", {})))
