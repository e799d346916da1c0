"""The MPI-style communication profile: time, calls and bytes per operation and per rank.

Modelled on the flat profiles of MPI tracing libraries (``mpi_profile.*`` of libmpitrace, mpiP):
one row per operation with its calls, average message size, total bytes and the time spent in
it (min / average / max over ranks, and the rank with the maximum), then one row per rank with
its communication time and share of wall time. Algorithm steps and consistency headers
(``allreduce.step``, ``allreduce.header``) are part of the call that made them and are not
counted again; overlapping asynchronous operations count once in a rank's communication time.
"""

from __future__ import annotations

from typing import Any

from ringpipe.comm.events import Event, human_bytes
from ringpipe.observe.collect import JobEvents
from ringpipe.observe.regions import EXPECTED_OP

__all__ = ["profile", "format_profile", "busy_ns"]


def _top_level(events: list[Event]) -> list[Event]:
    """The calls a program made (not their steps and headers, not its declared expected work)."""
    return [e for e in events if "." not in e.op and e.op != EXPECTED_OP]


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


def _wall_ns(r: Any) -> int:
    """A rank's wall time: from its first to its last recorded operation."""
    if not r.events:
        return 0
    return max(e.end_ns for e in r.events) - min(e.start_ns for e in r.events)


def profile(job: JobEvents) -> dict[str, Any]:
    """Per-operation and per-rank figures of ``job`` (the data behind :func:`format_profile`)."""
    ops: dict[str, dict[str, Any]] = {}
    for r in job.ranks:
        for e in _top_level(r.events):
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
            "min_ms": min(per_rank) / 1e6,
            "avg_ms": sum(per_rank) / job.size / 1e6,
            "max_ms": per_rank[worst] / 1e6,
            "max_rank": worst,
        })
    op_rows.sort(key=lambda row: -row["avg_ms"])
    rank_rows = []
    for r in job.ranks:
        busy = busy_ns(_top_level(r.events))
        wall = _wall_ns(r)
        rank_rows.append({
            "rank": r.rank,
            "host": r.host,
            "wall_ms": wall / 1e6,
            "comm_ms": busy / 1e6,
            "comm_share": busy / wall if wall else 0.0,
            "calls": len(_top_level(r.events)),
        })
    return {"ops": op_rows, "ranks": rank_rows, "meta": job.meta}


def format_profile(job: JobEvents) -> str:
    """The profile of ``job`` as a text table."""
    p = profile(job)
    hosts = len(set(job.hosts()))
    lines = [
        f"Communication profile: {job.size} ranks on {hosts} host{'s' if hosts != 1 else ''}, "
        f"backend {job.meta.get('backend', '?')}",
        "",
        f"{'operation':<22}{'calls':>8}{'avg size':>12}{'total':>12}"
        f"{'min ms':>10}{'avg ms':>10}{'max ms':>10}{'max rank':>10}",
    ]
    for row in p["ops"]:
        lines.append(
            f"{row['op']:<22}{row['calls']:>8}{human_bytes(row['avg_bytes']):>12}{human_bytes(row['total_bytes']):>12}"
            f"{row['min_ms']:>10.2f}{row['avg_ms']:>10.2f}{row['max_ms']:>10.2f}{row['max_rank']:>10}"
        )
    lines += ["", f"{'rank':>6}  {'host':<20}{'calls':>8}{'wall ms':>12}{'comm ms':>12}{'comm %':>9}"]
    for row in p["ranks"]:
        lines.append(
            f"{row['rank']:>6}  {row['host']:<20}{row['calls']:>8}{row['wall_ms']:>12.2f}"
            f"{row['comm_ms']:>12.2f}{100 * row['comm_share']:>8.1f}%"
        )
    return "\n".join(lines)
