"""The timeline hooks every face calls: start and stop writing the timeline, save every rank's events.

The timeline itself (its file, its events as Chrome trace rows) is :mod:`ringpipe.observe.live`;
these are Horovod's ``hvd.start_timeline`` / ``hvd.stop_timeline`` on the process state, and the
saving of every rank's events that ``shutdown`` does when ``HOROVOD_TIMELINE`` named a file.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ringpipe.comm.base import Communicator
from ringpipe.core import world as _w

__all__ = ["save_events", "start_timeline", "stop_timeline"]

log = logging.getLogger("ringpipe.api")


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing the timeline to ``file_path`` now (Horovod's ``hvd.start_timeline``); every rank calls it.

    Rank 0 creates the file (replacing one there) and every rank appends its events as the job
    runs; a ``start_timeline`` instant marks where recording began and :func:`stop_timeline` a
    ``stop_timeline`` instant where it ended. ``mark_cycles``: a ``CYCLE_START`` instant where
    each queued operation starts. A timeline being written to another file is closed first.
    """
    from ringpipe.observe import live

    if not _w.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    live.start(file_path, _w.current().comm.rank, bool(mark_cycles))


def stop_timeline() -> None:
    """Stop writing the timeline and close its file (Horovod's ``hvd.stop_timeline``)."""
    from ringpipe.observe import live

    if not _w.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    live.stop()


def save_events(comm: Communicator, path: str) -> None:
    """Rank 0 saves every rank's events beside the timeline ``path`` (``FILE.events.json``; collective)."""
    from ringpipe.observe import collect_events
    from ringpipe.observe import save_events as save_job

    job = collect_events(comm)
    if job is not None:
        out = Path(path)
        save_job(out.with_name(out.stem + ".events.json"), job)
        log.info("timeline written to %s (open in chrome://tracing or ui.perfetto.dev)", out)
