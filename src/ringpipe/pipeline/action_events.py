"""A stage's actions as events: when each forward, backward, weight pass and step ran.

:func:`record_actions` wraps, on the given objects only, a stage's runtimes (``forward``,
``backward``, ``backward_input``, ``backward_weight``) and its executor's ``step``, and records
each call into the communicator's event log as ``pipeline.F``, ``pipeline.B``, ``pipeline.W``
or ``pipeline.S`` (a ``.`` in the name keeps them out of the communication tables, which list
the program's own calls). Each ``pipeline.S`` carries what the pipeline doctor
(:mod:`ringpipe.pipeline.diagnosis`) needs to rebuild the schedule: its name, the stage,
stages, micro-batches, chunks, the balance (layers per part) and whether the stage recomputes.
The cost is four clock reads and one append per action.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ringpipe.comm.events import EventLog

__all__ = ["ACTION_OPS", "SCHEDULE_KEYS", "record_actions"]

ACTION_OPS = {"forward": "pipeline.F", "backward": "pipeline.B", "backward_input": "pipeline.B",
              "backward_weight": "pipeline.W", "step": "pipeline.S"}
#: What each ``pipeline.S`` event's detail holds about the run.
SCHEDULE_KEYS = ("schedule", "stage", "stages", "microbatches", "chunks", "balance", "recompute", "step_every")


def _timed(log: EventLog, op: str, fn: Callable[..., Any], chunk: int, detail: dict[str, Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            mb = args[0] if args and isinstance(args[0], int) else -1
            log.record(op, 0, -1, t0, time.perf_counter_ns(), 0, "pipeline", mb=mb, chunk=chunk,
                       cpu_ns=time.thread_time_ns() - c0, **detail)

    return timed


def record_actions(log: EventLog, runtimes: Sequence[Any], executor: Any, **schedule: Any) -> None:
    """Record every action of this stage into ``log`` (see the module docstring); ``schedule``: the
    :data:`SCHEDULE_KEYS` that each step event carries. Each event also holds the CPU time of the
    calling thread (``cpu_ns``), and each step the number of torch's intra-op threads
    (``threads``): with one, a pass's CPU time is its work without the time it waited for a
    core."""
    for chunk, rt in enumerate(runtimes):
        for name in ("forward", "backward", "backward_input", "backward_weight"):
            if hasattr(rt, name):
                setattr(rt, name, _timed(log, ACTION_OPS[name], getattr(rt, name), chunk, {}))
    import torch

    executor.step = _timed(log, ACTION_OPS["step"], executor.step, 0, {**schedule, "threads": torch.get_num_threads()})
