"""The MPI-style communication profile: time, calls and bytes per operation and per rank.

Modelled on the flat profiles of MPI tracing libraries (``mpi_profile.*`` of libmpitrace, mpiP):
one row per operation with its calls (over all ranks and per rank), average message size, total
bytes, each rank's *total* time in it (min / average / max over ranks, and the rank with the
maximum) and the time *per call*; then one row per rank.

A rank's row gives two different times, named as what they are:

- **comm** (``comm ms``, ``comm %``): the time the rank's training steps were blocked waiting for
  communication, and its share of the steps' time: what a faster network or more overlap could
  win back. It is the one communication figure of a training run (docs/observe.md): rank 0's is
  ``summary.json``'s ``comm_share``, and each epoch's log line gives it for that epoch's steps.
  It needs a training window (:mod:`ringpipe.observe.runreport`); other events files have none.
- **in flight** (``in flight ms``, ``in flight %``): the time with at least one of the program's
  calls in progress (overlapping calls once), whether or not anything waited for it, as a share
  of the window. Communication overlapped with computation counts here and not in comm.

The window is a training run's steps (from the first step's start to the last step's end; the
evaluations and checkpoints between epochs fall inside it, start-up and the final evaluation do
not), else each rank's first to last recorded operation; events are cut to it, so no share
exceeds 100 %. Algorithm steps and consistency headers (``allreduce.step``,
``allreduce.header``) are part of the call that made them and are not counted again. ringpipe's
own calls (start-up's hostname exchange, announcements, the messages of its algorithms:
:func:`ringpipe.comm.events.split_internal`) are listed apart, below the program's.
"""

from __future__ import annotations

from typing import Any

from ringpipe.comm.events import Event, human_bytes, split_internal
from ringpipe.observe.collect import JobEvents
from ringpipe.observe.regions import EXPECTED_OP
from ringpipe.observe.runreport import WINDOW_OP

__all__ = ["profile", "format_profile", "busy_ns", "comm_line"]


def _top_level(events: list[Event]) -> list[Event]:
    """The operations recorded (not their steps and headers, not declared expected work)."""
    return [e for e in events if "." not in e.op and e.op != EXPECTED_OP]


def _calls(events: list[Event], internal: bool) -> list[Event]:
    """The program's calls, or (``internal``) ringpipe's own."""
    mine, theirs = split_internal(_top_level(events))
    return theirs if internal else mine


def busy_ns(events: list[Event], within: tuple[int, int] | None = None) -> int:
    """Length of the union of the events' intervals (overlapping operations count once), cut to ``within``."""
    total, end = 0, None
    lo, hi = within if within is not None else (None, None)
    for e in sorted(events, key=lambda e: e.start_ns):
        a, b = e.start_ns, e.end_ns
        if lo is not None and hi is not None:
            a, b = max(a, lo), min(b, hi)
            if b <= a:
                continue
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _window(r: Any) -> Event | None:
    return next((e for e in r.events if e.op == WINDOW_OP), None)


def _span(r: Any) -> tuple[int, int]:
    """A rank's window: its training window, else from its first to its last recorded operation."""
    win = _window(r)
    if win is not None:
        return win.start_ns, win.end_ns
    if not r.events:
        return 0, 0
    return min(e.start_ns for e in r.events), max(e.end_ns for e in r.events)


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
        span = _span(r)
        wall = span[1] - span[0]
        busy = busy_ns(_top_level(r.events), span)
        win = _window(r)
        row = {
            "rank": r.rank,
            "host": r.host,
            "wall_ms": wall / 1e6,
            "in_flight_ms": busy / 1e6,
            "in_flight_share": busy / wall if wall else 0.0,
            "calls": len(_calls(r.events, False)),
        }
        if win is not None:
            step_ns, blocked = int(win.detail.get("step_ns", 0)), int(win.detail.get("blocked_ns", 0))
            row.update(steps=int(win.detail.get("steps", 0)), step_ms=step_ns / 1e6, comm_ms=blocked / 1e6,
                       comm_share=blocked / step_ns if step_ns else 0.0)
        rank_rows.append(row)
    return {"ops": op_rows, "internal": internal_rows, "ranks": rank_rows, "meta": job.meta}


def comm_line(job: JobEvents) -> str:
    """The run's one communication figure in a sentence ("" for events without a training window)."""
    rows = [row for row in profile(job)["ranks"] if "steps" in row]
    if not rows:
        return ""
    first = rows[0]
    lo = min(rows, key=lambda row: row["comm_share"])
    hi = max(rows, key=lambda row: row["comm_share"])
    spread = (f" (ranks: {100 * lo['comm_share']:.1f}% on rank {lo['rank']} to {100 * hi['comm_share']:.1f}% on "
              f"rank {hi['rank']})" if len(rows) > 1 else "")
    return (f"comm {100 * first['comm_share']:.1f}%: rank {first['rank']}'s {first['steps']} training steps were "
            f"blocked on communication for {100 * first['comm_share']:.1f}% of their time{spread}; summary.json's "
            f"comm_share")


def format_profile(job: JobEvents) -> str:
    """The profile of ``job`` as a text table."""
    p = profile(job)
    hosts = len(set(job.hosts()))
    steps = [row for row in p["ranks"] if "steps" in row]
    window = (f"window: the {steps[0]['steps']} training steps of each rank (from its first step's start to its last "
              "step's end, as in summary.json; the evaluations and checkpoints between epochs fall inside it, "
              "start-up and the final evaluation do not)" if steps else
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
    head = f"{'rank':>6}  {'host':<20}{'calls':>8}{'window ms':>12}{'in flight ms':>14}{'in flight %':>13}"
    if steps:
        head += f"{'step ms':>12}{'comm ms':>12}{'comm %':>9}"
    lines += ["", head]
    for row in p["ranks"]:
        line = (f"{row['rank']:>6}  {row['host']:<20}{row['calls']:>8}{row['wall_ms']:>12.2f}"
                f"{row['in_flight_ms']:>14.2f}{100 * row['in_flight_share']:>12.1f}%")
        if "steps" in row:
            line += f"{row['step_ms']:>12.2f}{row['comm_ms']:>12.2f}{100 * row['comm_share']:>8.1f}%"
        lines.append(line)
    lines.append("")
    if steps:
        lines += ["comm: the time the training steps were blocked waiting for communication, and its share of the "
                  "steps' time (what a faster network or more overlap can win back; rank 0's comm % is summary.json's "
                  "comm_share, the log lines give it per epoch)",
                  "in flight: the time with a call of the program in progress (overlapping calls once), waited for or "
                  "overlapped with computation, and its share of the window"]
    else:
        lines += ["in flight: the time with a call of the program in progress (overlapping calls once), and its share "
                  "of the window; no comm %: these events hold no training steps (the time blocked on communication "
                  "is measured by ringpipe train)"]
    return "\n".join(lines)
