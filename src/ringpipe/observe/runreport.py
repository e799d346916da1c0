"""What a training run writes about its communication: one window, one set of numbers.

The trainer's summary measures its steps only (from the first training step to the last), and
so do ``comm_profile.txt`` and ``doctor.txt``: each rank records its training window as an
event (``train.window``: first step start to last step end, with its step time and the time
blocked on communication inside the steps), and :func:`window_job` keeps only the events inside
each rank's window. Start-up (process group, model broadcast) and the final evaluation are
left out; the profile's "comm %" of rank 0 is the summary's ``comm_share``. The run's events
(``events.json``, start-up included, with the window) are written beside them in every run that
writes the profile, so that ``ringpipe doctor RUN`` and ``ringpipe trace RUN`` read the default
run; they cut it to the same window.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ringpipe.comm.base import Communicator
from ringpipe.observe.collect import JobEvents, RankEvents, collect_events, save_events

__all__ = ["record_window", "window_job", "write_run_observations", "WINDOW_OP"]

WINDOW_OP = "train.window"


def record_window(comm: Communicator, steps: Sequence[tuple[int, int, int]]) -> None:
    """Record this rank's training window from its steps ``(start ns, end ns, blocked ns)``."""
    if not steps:
        return
    comm.log.record(WINDOW_OP, 0, -1, steps[0][0], steps[-1][1], 0, "training", steps=len(steps),
                    step_ns=sum(b - a for a, b, _ in steps), blocked_ns=sum(x for _, _, x in steps))


def window_job(job: JobEvents) -> JobEvents:
    """``job`` with each rank's events cut to its training window (unchanged for ranks without one)."""
    ranks = []
    for r in job.ranks:
        win = next((e for e in r.events if e.op == WINDOW_OP), None)
        if win is None:
            ranks.append(r)
            continue
        kept = [e for e in r.events if e.op == WINDOW_OP or win.start_ns <= e.start_ns <= win.end_ns]
        ranks.append(RankEvents(r.rank, r.host, kept, r.info))
    return JobEvents(ranks, {**job.meta, "window": "training steps" if any(
        any(e.op == WINDOW_OP for e in r.events) for r in job.ranks) else "whole run"})


def write_run_observations(comm: Communicator, run: Path, timeline: bool,
                           steps: Sequence[tuple[int, int, int]] = ()) -> None:
    """Gather every rank's events; rank 0 writes ``comm_profile.txt``, ``doctor.txt``, ``events.json``
    and, with ``timeline``, ``timeline.json`` into ``run``. Every rank calls it."""
    from ringpipe.observe.doctor import diagnose, format_report
    from ringpipe.observe.table import comm_line, format_profile
    from ringpipe.observe.timeline import write_timeline

    record_window(comm, steps)
    job = collect_events(comm)
    if job is None:
        return
    steps_job = window_job(job)
    (run / "comm_profile.txt").write_text(format_profile(steps_job) + "\n")
    line = comm_line(steps_job)
    (run / "doctor.txt").write_text(format_report(steps_job, diagnose(steps_job), [line] if line else []) + "\n")
    save_events(run / "events.json", job)  # for `ringpipe doctor RUN` and `ringpipe trace RUN`, in every run
    if timeline:
        write_timeline(run / "timeline.json", job)
