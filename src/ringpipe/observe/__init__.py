"""Seeing where the time goes: events on one clock, the timeline, the profile table, the doctor, the bench.

Every communication operation is recorded at the communicators' one choke point; this package
only reads those records. In a job::

    job = collect_events(comm)             # every rank calls it; rank 0 gets all ranks' events
    if job is not None:
        write_timeline("timeline.json", job)   # chrome://tracing or ui.perfetto.dev
        print(format_profile(job))             # MPI-style table: time, calls, bytes per op and rank
        for finding in diagnose(job):          # late ranks, placement, slow hosts and links
            print(finding.text())
"""

from ringpipe.observe.collect import JobEvents, RankEvents, collect_events, load_events, save_events
from ringpipe.observe.doctor import Finding, diagnose, format_report
from ringpipe.observe.regions import expected_work
from ringpipe.observe.table import format_profile, profile
from ringpipe.observe.timeline import chrome_trace, write_timeline

__all__ = [
    "Finding",
    "JobEvents",
    "RankEvents",
    "chrome_trace",
    "collect_events",
    "diagnose",
    "expected_work",
    "format_profile",
    "format_report",
    "load_events",
    "profile",
    "save_events",
    "write_timeline",
]
