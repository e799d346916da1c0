"""A stage's actions as events: when each forward, backward, weight pass and step ran.

:func:`record_actions` wraps, on the given objects only, a stage's runtimes (``forward``,
``backward``, ``backward_input``, ``backward_weight``) and its executor's ``step``, and records
each call into the communicator's event log as ``pipeline.F``, ``pipeline.B``, ``pipeline.W``
or ``pipeline.S`` (a ``.`` in the name keeps them out of the communication tables, which list
the program's own calls). Each ``pipeline.S`` carries what the pipeline doctor
(:mod:`ringpipe.pipeline.diagnosis`) needs to rebuild the schedule: its name, the stage,
stages, micro-batches, chunks, the balance (layers per part) and whether the stage recomputes.
The cost is four clock reads and one append per action (on a GPU also two CUDA events per action
and one wait for the last of them per optimizer step).

:func:`cpu_times_measure_passes` says how to read those clocks back: a pass's CPU time is its work
without the time it waited for a core when torch ran one intra-op thread and the pass computed on the
CPU at all; a pass whose thread was on a CPU for under a tenth of its time (:data:`ON_CPU_SHARE`)
computed elsewhere (a GPU's kernels, an accelerator, a device held for a fixed time) and its wall time
is its work. Such a stage needs no core of its own for its passes. On a GPU, whose passes return
once their kernels are queued, each action is also timed on the device (``gpu_ns``, CUDA events),
and :func:`pass_seconds` reads that instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ringpipe.comm.events import EventLog

__all__ = ["ACTION_OPS", "SCHEDULE_KEYS", "ON_CPU_SHARE", "record_actions", "computes_on_cpu", "cpu_times_measure_passes",
           "pass_seconds"]

ACTION_OPS = {"forward": "pipeline.F", "backward": "pipeline.B", "backward_input": "pipeline.B",
              "backward_weight": "pipeline.W", "step": "pipeline.S"}
#: What each ``pipeline.S`` event's detail holds about the run.
SCHEDULE_KEYS = ("schedule", "stage", "stages", "microbatches", "chunks", "balance", "recompute", "step_every")
#: Passes whose calling thread ran on a CPU for less than this share of their wall time (one intra-op
#: thread) computed elsewhere: on a GPU, an accelerator, or a device held for a fixed time.
ON_CPU_SHARE = 0.10
_PASSES = ("pipeline.F", "pipeline.B", "pipeline.W")


class _GpuPassTimes:
    """CUDA events around each action of a stage on a GPU, read after the stage's optimizer step.

    A pass on a GPU returns once its kernels are queued: its wall and CPU times are the queueing.
    An event pair on the current stream times the kernels themselves; the pairs are read (the
    last one waited for) at the end of each optimizer step, into each action's ``gpu_ns``."""

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self._device = device  # the stage's: its current stream, whichever device is current
        self._pending: list[tuple[Any, Any, dict[str, Any]]] = []

    def start(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.current_stream(self._device))
        return event

    def finish(self, start: Any, detail: dict[str, Any]) -> None:
        end = self._torch.cuda.Event(enable_timing=True)
        end.record(self._torch.cuda.current_stream(self._device))
        self._pending.append((start, end, detail))

    def read(self) -> None:
        if self._pending:  # one stream: once its last event is done, every earlier one is
            self._pending[-1][1].synchronize()
        for start, end, detail in self._pending:
            detail["gpu_ns"] = int(start.elapsed_time(end) * 1e6)
        self._pending.clear()


def _timed(log: EventLog, op: str, fn: Callable[..., Any], chunk: int, detail: dict[str, Any],
           gpu: _GpuPassTimes | None = None) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        g0 = gpu.start() if gpu is not None else None
        try:
            return fn(*args, **kwargs)
        finally:
            mb = args[0] if args and isinstance(args[0], int) else -1
            stored = log.record(op, 0, -1, t0, time.perf_counter_ns(), 0, "pipeline", mb=mb, chunk=chunk,
                                cpu_ns=time.thread_time_ns() - c0, **detail)
            if gpu is not None:
                gpu.finish(g0, stored)
                if op == ACTION_OPS["step"]:
                    gpu.read()

    return timed


def pass_seconds(e: Any, cpu: bool) -> float:
    """A recorded action's time: its kernels' time on the GPU where recorded (``gpu_ns``), else the thread's
    CPU time (``cpu``: :func:`cpu_times_measure_passes`) or the wall time."""
    if "gpu_ns" in e.detail:
        return e.detail["gpu_ns"] / 1e9
    return (e.detail["cpu_ns"] if cpu else e.end_ns - e.start_ns) / 1e9


def record_actions(log: EventLog, runtimes: Sequence[Any], executor: Any, **schedule: Any) -> None:
    """Record every action of this stage into ``log`` (see the module docstring); ``schedule``: the
    :data:`SCHEDULE_KEYS` that each step event carries. Each event also holds the CPU time of the
    calling thread (``cpu_ns``), and each step the number of torch's intra-op threads
    (``threads``): with one, a pass's CPU time is its work without the time it waited for a
    core. On a GPU each action also holds its kernels' time (``gpu_ns``, CUDA events read at the
    end of each optimizer step)."""
    import torch

    devices = [torch.device(rt.device) for rt in runtimes if getattr(rt, "device", None) is not None]
    gpu = next((_GpuPassTimes(torch, d) for d in devices if d.type == "cuda"), None)
    for chunk, rt in enumerate(runtimes):
        for name in ("forward", "backward", "backward_input", "backward_weight"):
            if hasattr(rt, name):
                setattr(rt, name, _timed(log, ACTION_OPS[name], getattr(rt, name), chunk, {}, gpu))
    executor.step = _timed(log, ACTION_OPS["step"], executor.step, 0,
                           {**schedule, "threads": torch.get_num_threads()}, gpu)


def computes_on_cpu(events: Sequence[Any]) -> bool:
    """Whether a stage's recorded passes (``events``: one rank's) computed on its CPU.

    False when the passes were timed on a GPU (``gpu_ns``), or when every step ran one intra-op thread
    and the passes' thread was on a CPU for less
    than :data:`ON_CPU_SHARE` of their wall time in all (with more threads the calling thread's CPU
    time is a part of the work, and a crowded machine lowers it: such a stage counts as computing on
    the CPU); True when no pass recorded its CPU time."""
    if any("gpu_ns" in e.detail for e in events if e.op in _PASSES):
        return False  # timed on the GPU
    passes = [e for e in events if e.op in _PASSES and "cpu_ns" in e.detail]
    if not passes or not _one_intra_op_thread(events):
        return True
    wall = sum(e.end_ns - e.start_ns for e in passes)
    return sum(e.detail["cpu_ns"] for e in passes) >= ON_CPU_SHARE * wall


def cpu_times_measure_passes(events: Sequence[Any]) -> bool:
    """Whether a stage's passes are measured by their CPU time rather than their wall time: every step ran
    one intra-op thread, every action recorded its CPU time, and the passes computed on the CPU
    (:func:`computes_on_cpu`)."""
    actions = [e for e in events if e.op in _PASSES or e.op == "pipeline.S"]
    return (_one_intra_op_thread(events) and all("cpu_ns" in e.detail for e in actions)
            and computes_on_cpu(events))


def _one_intra_op_thread(events: Sequence[Any]) -> bool:
    """Whether the stage recorded steps and torch ran one intra-op thread at every one of them."""
    steps = [e for e in events if e.op == "pipeline.S"]
    return bool(steps) and all(e.detail.get("threads") == 1 for e in steps)
