"""The MPI-style communication profile: time, calls and bytes per operation and per rank.

Modelled on the flat profiles of MPI tracing libraries (``mpi_profile.*`` of libmpitrace, mpiP):
one row per operation with its calls (over all ranks and per rank), average message size, total
bytes, each rank's *total* time in it (min / average / max over ranks, and the rank with the
maximum) and the time *per call*; then one row per rank with its communication time and share
of wall time. For a training run (:mod:`ringpipe.observe.runreport`) the window is the
training steps, and each rank's row also gives the time its steps were blocked on
communication: rank 0's share is the summary's ``comm_share``. Algorithm steps and consistency headers
(``allreduce.step``, ``allreduce.header``) are part of the call that made them and are not
counted again; overlapping asynchronous operations count once in a rank's communication time.
ringpipe's own calls (start-up's hostname exchange, announcements, the messages of its
algorithms: :func:`ringpipe.comm.events.split_internal`) are listed apart, below the program's.
"""

from __future__ import annotations

from typing import Any

from ringpipe.comm.events import Event, human_bytes, split_internal
from ringpipe.observe.collect import JobEvents
from ringpipe.observe.regions import EXPECTED_OP
from ringpipe.observe.runreport import WINDOW_OP

__all__ = ["profile", "format_profile", "busy_ns"]


def _top_level(events: list[Event]) -> list[Event]:
    """The operations recorded (not their steps and headers, not declared expected work)."""
    return [e for e in events if "." not in e.op and e.op != EXPECTED_OP]


def _calls(events: list[Event], internal: bool) -> list[Event]:
    """The program's calls, or (``internal``) ringpipe's own."""
    mine, theirs = split_internal(_top_level(events))
    return theirs if internal else mine


def busy_ns(events: list[Event]) -> int:
    """Length of the union of the events' intervals (overlapping operations count once)."""
    total, end = 0, None
    for e in sorted(events, key=lambda e: e.start_ns):
        if end is None or e.start_ns > end:
            total += e.end_ns - e.start_ns
            end = e.end_ns
        elif e.end_ns > end:
            total += e.end_ns - end
            end = e.end_ns
    return total


def _window(r: Any) -> Event | None:
    return next((e for e in r.events if e.op == WINDOW_OP), None)


def _wall_ns(r: Any) -> int:
    """A rank's wall time: its training window, else from its first to its last recorded operation."""
    win = _window(r)
    if win is not None:
        return win.end_ns - win.start_ns
    if not r.events:
        return 0
    return max(e.end_ns for e in r.events) - min(e.start_ns for e in r.events)


def _op_rows(job: JobEvents, internal: bool) -> list[dict[str, Any]]:
    ops: dict[str, dict[str, Any]] = {}
    for r in job.ranks:
        for e in _calls(r.events, internal):
            row = ops.setdefault(e.op, {"calls": 0, "bytes": 0, "time_ns": [0] * job.size})
            row["calls"] += 1
            row["bytes"] += e.nbytes
            row["time_ns"][r.rank] += e.end_ns - e.start_ns
    op_rows = []
    for name, row in ops.items():
        per_rank = row["time_ns"]
        worst = max(range(job.size), key=lambda k: per_rank[k])
        op_rows.append({
            "op": name,
            "calls": row["calls"],
            "avg_bytes": row["bytes"] / row["calls"] if row["calls"] else 0.0,
            "total_bytes": row["bytes"],
            "calls_per_rank": row["calls"] / job.size,
            "min_ms": min(per_rank) / 1e6,
            "avg_ms": sum(per_rank) / job.size / 1e6,
            "max_ms": per_rank[worst] / 1e6,
            "max_rank": worst,
            "per_call_ms": sum(per_rank) / row["calls"] / 1e6 if row["calls"] else 0.0,
        })
    op_rows.sort(key=lambda row: -row["avg_ms"])
    return op_rows


def profile(job: JobEvents) -> dict[str, Any]:
    """Per-operation and per-rank figures of ``job`` (the data behind :func:`format_profile`).

    ``ops``: the program's calls; ``internal``: ringpipe's own, part of them or beside them.
    """
    op_rows, internal_rows = _op_rows(job, False), _op_rows(job, True)
    rank_rows = []
    for r in job.ranks:
        busy = busy_ns(_top_level(r.events))
        wall = _wall_ns(r)
        win = _window(r)
        row = {
            "rank": r.rank,
            "host": r.host,
            "wall_ms": wall / 1e6,
            "comm_ms": busy / 1e6,
            "comm_share": busy / wall if wall else 0.0,
            "calls": len(_calls(r.events, False)),
        }
        if win is not None:
            step_ns, blocked = int(win.detail.get("step_ns", 0)), int(win.detail.get("blocked_ns", 0))
            row.update(steps=int(win.detail.get("steps", 0)), step_ms=step_ns / 1e6, blocked_ms=blocked / 1e6,
                       blocked_share=blocked / step_ns if step_ns else 0.0)
        rank_rows.append(row)
    return {"ops": op_rows, "internal": internal_rows, "ranks": rank_rows, "meta": job.meta}


def format_profile(job: JobEvents) -> str:
    """The profile of ``job`` as a text table."""
    p = profile(job)
    hosts = len(set(job.hosts()))
    steps = [row for row in p["ranks"] if "steps" in row]
    window = (f"window: the {steps[0]['steps']} training steps of each rank (from its first step to its last, as in "
              "summary.json; start-up and final evaluation left out)" if steps else
              "window: each rank's first to last recorded operation")
    lines = [
        f"Communication profile: {job.size} ranks on {hosts} host{'s' if hosts != 1 else ''}, "
        f"backend {job.meta.get('backend', '?')}",
        window,
        "calls: over all ranks (and per rank); total ms: each rank's total time in the operation, min / avg / max "
        "over ranks; ms per call: total time over all ranks / calls",
        "",
        f"{'operation':<22}{'calls':>8}{'per rank':>9}{'avg size':>11}{'total':>11}"
        f"{'total ms':>10}{'(avg)':>9}{'(max)':>9}{'max rank':>9}{'ms/call':>9}",
    ]
    def op_line(row: dict[str, Any]) -> str:
        return (f"{row['op']:<22}{row['calls']:>8}{row['calls_per_rank']:>9.1f}{human_bytes(row['avg_bytes']):>11}"
                f"{human_bytes(row['total_bytes']):>11}{row['min_ms']:>10.2f}{row['avg_ms']:>9.2f}"
                f"{row['max_ms']:>9.2f}{row['max_rank']:>9}{row['per_call_ms']:>9.3f}")

    lines += [op_line(row) for row in p["ops"]]
    if p["internal"]:
        lines += ["", "ringpipe's own calls (not made by the program: start-up, consistency checks, announcements, "
                  "the messages of its algorithms; their time is part of the calls above or beside them):"]
        lines += [op_line(row) for row in p["internal"]]
    head = f"{'rank':>6}  {'host':<20}{'calls':>8}{'wall ms':>12}{'comm ms':>12}{'comm %':>9}"
    if steps:
        head += f"{'step ms':>12}{'blocked ms':>12}{'blocked %':>11}"
    lines += ["", head]
    for row in p["ranks"]:
        line = (f"{row['rank']:>6}  {row['host']:<20}{row['calls']:>8}{row['wall_ms']:>12.2f}"
                f"{row['comm_ms']:>12.2f}{100 * row['comm_share']:>8.1f}%")
        if "steps" in row:
            line += f"{row['step_ms']:>12.2f}{row['blocked_ms']:>12.2f}{100 * row['blocked_share']:>10.1f}%"
        lines.append(line)
    if steps:
        lines += ["", "comm ms: time with a communication in flight (overlapping calls once); blocked ms: time the "
                  "steps waited for communication (summary.json's comm_share is rank 0's blocked %)"]
    return "\n".join(lines)
