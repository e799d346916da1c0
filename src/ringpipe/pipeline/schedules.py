"""Pipeline schedules as data: pure functions ``(stages, microbatches, stage) -> [Action]``.

A schedule says, for one stage, in which order it runs the forward (``F``) and backward (``B``)
of each micro-batch and when it runs its optimizer step (``S``). It knows nothing about
processes or tensors, so it can be printed, validated and tested without any communicator;
the executor (:mod:`ringpipe.pipeline.executor`) runs them.
Text form: ``"F0 F1 B0 B1 S"``. The actions, their text form and their extensions (model
chunks, split backward) are in :mod:`ringpipe.pipeline.actions`; the checks and measures of
action lists (validation, deadlock freedom, peak memory, staleness) in
:mod:`ringpipe.pipeline.schedule_checks`. Both are re-exported here.

Schedules:

- ``seq``: naive model parallelism, each micro-batch goes all the way forward and back before
  the next one starts (with one micro-batch: no micro-batching at all); one step at the end.
- ``gpipe``: fill-drain (GPipe, Huang et al. 2019): all forwards, then all backwards, one step.
- ``1f1b``: PipeDream-flush (Narayanan et al. 2021): ``stages - stage - 1`` warm-up forwards,
  then one forward / one backward, then the remaining backwards and one step. At most
  ``stages - stage`` micro-batches are in flight on a stage.
- ``async_1f1b``: PipeDream (Harlap et al. 2018) without flush: the 1F1B order over the whole
  stream of micro-batches, the stage stepping after every ``step_every`` backwards; a trailing
  partial group of backwards gets a final step.
- ``interleaved_1f1b``: 1F1B over ``chunks`` virtual stages per rank (Narayanan et al. 2021).
- ``zb_h1``: zero-bubble ZB-H1 (Qi et al. 2024), backward split into ``B`` and ``W``.
- ``zb_h2``: zero-bubble ZB-H2 (same paper): up to ``2 * stages - 1`` micro-batches held, no
  idle time from step to step when ``F``, ``B`` and ``W`` take equally long.

A new schedule is one function registered in :data:`SCHEDULES`.
"""

from __future__ import annotations

from collections.abc import Callable

from ringpipe.pipeline.actions import (
    Action,
    ScheduleError,
    check_args,
    format_actions,
    parse,
    render,
)
from ringpipe.pipeline.schedule_checks import (
    max_in_flight,
    num_chunks,
    staleness_at_forward,
    validate,
    validate_pipeline,
)
from ringpipe.pipeline.schedules_interleaved import interleaved_1f1b
from ringpipe.pipeline.zero_bubble import zb_h1, zb_h2

__all__ = [
    "Action",
    "ScheduleError",
    "SCHEDULES",
    "ASYNC_SCHEDULES",
    "parse",
    "format_actions",
    "seq",
    "gpipe",
    "one_f_one_b",
    "async_1f1b",
    "async_1f1b_window",
    "async_staleness",
    "get_schedule",
    "validate",
    "validate_pipeline",
    "num_chunks",
    "max_in_flight",
    "staleness_at_forward",
    "render",
]


def seq(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Naive model parallelism: ``F0 B0 F1 B1 ... S`` (no two micro-batches overlap)."""
    check_args(num_stages, num_microbatches, stage)
    out: list[Action] = []
    for mb in range(num_microbatches):
        out += [Action("F", mb), Action("B", mb)]
    return out + [Action("S")]


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Fill-drain: ``F0 .. F(M-1) B0 .. B(M-1) S``."""
    check_args(num_stages, num_microbatches, stage)
    fwd = [Action("F", mb) for mb in range(num_microbatches)]
    bwd = [Action("B", mb) for mb in range(num_microbatches)]
    return fwd + bwd + [Action("S")]


def _one_f_one_b_order(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    warmup = min(num_stages - stage - 1, num_microbatches)
    out = [Action("F", mb) for mb in range(warmup)]
    nxt_f, nxt_b = warmup, 0
    while nxt_f < num_microbatches:
        out += [Action("F", nxt_f), Action("B", nxt_b)]
        nxt_f += 1
        nxt_b += 1
    out += [Action("B", mb) for mb in range(nxt_b, num_microbatches)]
    return out


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """PipeDream-flush: warm-up forwards, one forward / one backward, cool-down, one step."""
    check_args(num_stages, num_microbatches, stage)
    return _one_f_one_b_order(num_stages, num_microbatches, stage) + [Action("S")]


def async_1f1b(num_stages: int, num_microbatches: int, stage: int, step_every: int = 1) -> list[Action]:
    """PipeDream without flush: the 1F1B order, a step after every ``step_every`` backwards.

    Stage ``i`` runs warm-up forwards ``F0 .. F(N-1-i)`` then alternates ``B, F`` and drains;
    ``num_microbatches`` is the whole stream (e.g. an epoch), not one mini-batch.
    """
    check_args(num_stages, num_microbatches, stage)
    if step_every < 1:
        raise ScheduleError(f"step_every must be >= 1, got {step_every}")
    out: list[Action] = []
    done_b = 0
    for a in _one_f_one_b_order(num_stages, num_microbatches, stage):
        out.append(a)
        if a.kind == "B":
            done_b += 1
            if done_b % step_every == 0 or done_b == num_microbatches:
                out.append(Action("S"))
    return out


def async_1f1b_window(
    num_stages: int,
    stage: int,
    start: int,
    stop: int,
    step_every: int = 1,
    total: int | None = None,
) -> list[Action]:
    """One window of the asynchronous 1F1B stream: its actions from ``F start`` up to ``F stop``.

    A stream whose length is not known in advance (training batch after batch, draining only
    at the end of an epoch) runs window by window: the window holds the forwards of
    micro-batches ``start .. stop-1`` and the backwards (with their steps) that the 1F1B order
    places among them; the last ``stages - stage - 1`` of its micro-batches stay in flight.
    ``total`` (the stream's length, equal to ``stop``) closes the stream: the cool-down
    backwards follow, and a final step for a trailing partial group. With ``total=T`` on the
    last window, the windows ``[0, s1), [s1, s2), ..., [sn, T)`` concatenate to
    ``async_1f1b(num_stages, T, stage, step_every)``; ``[T, T)`` alone is the drain.
    """
    if num_stages < 1:
        raise ScheduleError(f"num_stages must be >= 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ScheduleError(f"stage {stage} is not in [0, {num_stages})")
    if step_every < 1:
        raise ScheduleError(f"step_every must be >= 1, got {step_every}")
    if not 0 <= start <= stop or (total is not None and total != stop):
        raise ScheduleError(
            f"window [{start}, {stop}) with total={total}: need 0 <= start <= stop, and total (if given) == stop"
        )
    warmup = num_stages - stage - 1
    out: list[Action] = []
    last_backward = False

    def backward(mb: int) -> None:
        nonlocal last_backward
        out.append(Action("B", mb))
        last_backward = total is not None and mb == total - 1
        if (mb + 1) % step_every == 0 or last_backward:
            out.append(Action("S"))

    for mb in range(start, stop):
        out.append(Action("F", mb))
        if mb >= warmup:
            backward(mb - warmup)
    if total is not None:
        for mb in range(max(0, stop - warmup), total):
            backward(mb)
        if total % step_every and not last_backward and total > 0:
            out.append(Action("S"))  # the last backward ran in an earlier window, before the end was known
    return out


def async_staleness(num_stages: int, stage: int, mb: int, step_every: int = 1) -> int:
    """Optimizer steps between micro-batch ``mb``'s forward and its backward in the asynchronous 1F1B stream.

    The forward of ``mb`` follows ``max(0, mb - (stages - stage - 1))`` backwards, and a step
    follows every backward of a micro-batch ``x`` with ``(x + 1) % step_every == 0``. The
    length of the stream does not matter: a final partial step comes after every backward.
    """
    done_backwards = max(0, mb - (num_stages - stage - 1))
    return mb // step_every - done_backwards // step_every


ScheduleFn = Callable[[int, int, int], list[Action]]

SCHEDULES: dict[str, ScheduleFn] = {
    "seq": seq,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "async_1f1b": async_1f1b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
    "zb_h2": zb_h2,
}
"""Name -> schedule function. ``async_1f1b`` also takes ``step_every``."""

ASYNC_SCHEDULES = frozenset({"async_1f1b"})
"""Schedules without a flush: weights change between a micro-batch's forward and backward."""


def get_schedule(name: str) -> ScheduleFn:
    """The schedule function registered under ``name``; the error lists the valid names."""
    try:
        return SCHEDULES[name]
    except KeyError:
        valid = ", ".join(sorted(SCHEDULES))
        raise ScheduleError(f"unknown schedule {name!r}; valid schedules: {valid}") from None
