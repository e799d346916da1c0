"""A timeline of every rank's communication in Chrome's trace format (chrome://tracing, Perfetto).

One process row per rank (named ``rank R @ host``), one thread row per tensor name (the ``name=``
of an API call, ``allreduce.avg_loss``, as Horovod's timeline has a row per tensor) or per
communicator for unnamed operations, and a separate row per collective algorithm's steps, so
that a ring's steps line up under the call that made them. Times are microseconds from the first event of the job, on rank 0's clock.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ringpipe.observe.collect import JobEvents

__all__ = ["span_name", "chrome_trace", "row_of", "write_timeline"]


def row_of(op: str, comm: str, name: str | None = None) -> str:
    """The timeline row of an event: its tensor's name, else its communicator; steps on a row of their own."""
    # "allreduce.step" / "allreduce.header" go under the call that made them, on their own row.
    if "." in op:
        return f"{name or comm}: {op.split('.', 1)[0]} steps"
    return name or comm or "world"


def span_name(op: str, detail: dict[str, Any]) -> str:
    """A span's name: the operation, or Horovod's ``NEGOTIATE_ALLREDUCE`` for the announcement before a named call.

    The announcement is where the ranks agree on the call (Horovod's negotiation phase); its own
    message is an allreduce whatever the call is, so it is named after the call's tensor name. A
    small allreduce whose data travelled in that same message (``negotiated``) is named so too:
    its negotiation and its reduction are one message.
    """
    name = detail.get("name")
    if (detail.get("internal") or detail.get("negotiated")) and isinstance(name, str) and "." in name and "." not in op:
        return "NEGOTIATE_" + name.split(".", 1)[0].upper()
    return op


def chrome_trace(job: JobEvents) -> dict[str, Any]:
    """The Chrome trace-event JSON object for ``job`` (``{"traceEvents": [...]}``)."""
    starts = [e.start_ns for r in job.ranks for e in r.events]
    origin = min(starts) if starts else 0
    out: list[dict[str, Any]] = []
    for r in job.ranks:
        out.append({"ph": "M", "name": "process_name", "pid": r.rank, "tid": 0,
                    "args": {"name": f"rank {r.rank} @ {r.host}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r.rank, "tid": 0,
                    "args": {"sort_index": r.rank}})
        tids: dict[str, int] = {}
        for e in r.events:
            row = row_of(e.op, e.comm, e.detail.get("name"))
            if row not in tids:
                tids[row] = len(tids) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": r.rank, "tid": tids[row],
                            "args": {"name": row}})
            args: dict[str, Any] = {"bytes": e.nbytes}
            if e.peer >= 0:
                args["peer"] = e.peer
            if e.tag:
                args["tag"] = e.tag
            args.update({k: v for k, v in e.detail.items() if isinstance(v, (int, float, str, bool))})
            out.append({
                "ph": "X",
                "name": span_name(e.op, e.detail),
                "cat": "comm",
                "pid": r.rank,
                "tid": tids[row],
                "ts": (e.start_ns - origin) / 1e3,
                "dur": max(0, e.end_ns - e.start_ns) / 1e3,
                "args": args,
            })
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"ringpipe": job.meta}}


def write_timeline(path: str | Path, job: JobEvents) -> Path:
    """Write :func:`chrome_trace` of ``job`` to ``path`` (open it in chrome://tracing or ui.perfetto.dev)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(chrome_trace(job)))
    tmp.replace(path)
    return path
