"""Pipeline schedules as data: pure functions ``(stages, microbatches, stage) -> [Action]``.

A schedule says, for one stage, in which order it runs the forward (``F``) and backward (``B``)
of each micro-batch and when it runs its optimizer step (``S``). It knows nothing about
processes or tensors, so it can be printed, validated and tested without any communicator;
one executor (:mod:`ringpipe.pipeline.executor`) runs any of them. Text form: ``"F0 F1 B0 B1 S"``.

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

A new schedule is one function registered in :data:`SCHEDULES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

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
    "max_in_flight",
    "staleness_at_forward",
    "render",
]

Kind = Literal["F", "B", "S"]


class ScheduleError(ValueError):
    """A schedule is malformed (a backward before its forward, a missing step, ...)."""


@dataclass(frozen=True, slots=True)
class Action:
    """One thing a stage does: forward ``F`` / backward ``B`` of micro-batch ``mb``, or step ``S``."""

    kind: Kind
    mb: int = -1

    def __str__(self) -> str:
        return "S" if self.kind == "S" else f"{self.kind}{self.mb}"


def parse(text: str) -> list[Action]:
    """The actions of a text form such as ``"F0 F1 B0 B1 S"``."""
    out: list[Action] = []
    for tok in text.split():
        if tok == "S":
            out.append(Action("S"))
        elif tok[:1] in ("F", "B") and tok[1:].isdigit():
            out.append(Action(tok[0], int(tok[1:])))  # type: ignore[arg-type]
        else:
            raise ScheduleError(f"cannot parse action {tok!r} in {text!r}; use F<n>, B<n> or S")
    return out


def format_actions(actions: Sequence[Action]) -> str:
    """The compact text form of a list of actions."""
    return " ".join(str(a) for a in actions)


def _check_args(num_stages: int, num_microbatches: int, stage: int) -> None:
    if num_stages < 1:
        raise ScheduleError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= stage < num_stages:
        raise ScheduleError(f"stage {stage} is not in [0, {num_stages})")


def seq(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Naive model parallelism: ``F0 B0 F1 B1 ... S`` (no two micro-batches overlap)."""
    _check_args(num_stages, num_microbatches, stage)
    out: list[Action] = []
    for mb in range(num_microbatches):
        out += [Action("F", mb), Action("B", mb)]
    return out + [Action("S")]


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Fill-drain: ``F0 .. F(M-1) B0 .. B(M-1) S``."""
    _check_args(num_stages, num_microbatches, stage)
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
    _check_args(num_stages, num_microbatches, stage)
    return _one_f_one_b_order(num_stages, num_microbatches, stage) + [Action("S")]


def async_1f1b(num_stages: int, num_microbatches: int, stage: int, step_every: int = 1) -> list[Action]:
    """PipeDream without flush: the 1F1B order, a step after every ``step_every`` backwards.

    Stage ``i`` runs warm-up forwards ``F0 .. F(N-1-i)`` then alternates ``B, F`` and drains;
    ``num_microbatches`` is the whole stream (e.g. an epoch), not one mini-batch.
    """
    _check_args(num_stages, num_microbatches, stage)
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


def validate(actions: Sequence[Action], num_microbatches: int) -> None:
    """Check one stage's actions: each micro-batch forward once, backward once after it, steps.

    The last action must be a step once every backward is done, so no gradient is left behind.
    """
    fwd: set[int] = set()
    bwd: set[int] = set()
    for i, a in enumerate(actions):
        where = f"action {i} ({a}) of {format_actions(actions)!r}"
        if a.kind == "S":
            continue
        if not 0 <= a.mb < num_microbatches:
            raise ScheduleError(f"{where}: micro-batch {a.mb} is not in [0, {num_microbatches})")
        if a.kind == "F":
            if a.mb in fwd:
                raise ScheduleError(f"{where}: forward of micro-batch {a.mb} appears twice")
            fwd.add(a.mb)
        else:
            if a.mb not in fwd:
                raise ScheduleError(f"{where}: backward of micro-batch {a.mb} before its forward")
            if a.mb in bwd:
                raise ScheduleError(f"{where}: backward of micro-batch {a.mb} appears twice")
            bwd.add(a.mb)
    missing = sorted(set(range(num_microbatches)) - bwd)
    if missing:
        raise ScheduleError(f"micro-batches {missing} have no backward in {format_actions(actions)!r}")
    if not actions or actions[-1].kind != "S":
        raise ScheduleError(f"schedule {format_actions(actions)!r} must end with a step S")


def validate_pipeline(per_stage: Sequence[Sequence[Action]], num_microbatches: int) -> None:
    """Check every stage and that the whole pipeline can run without deadlock.

    Simulates the stages with unbounded message queues: stage ``s`` can run ``F m`` once
    stage ``s-1`` ran it, and ``B m`` once stage ``s+1`` ran it (the last stage's backward
    follows its own forward). Forward messages between two stages are consumed in the order
    they are sent, and so are backward ones.
    """
    for s, acts in enumerate(per_stage):
        try:
            validate(acts, num_microbatches)
        except ScheduleError as exc:
            raise ScheduleError(f"stage {s}: {exc}") from None
    n = len(per_stage)
    pos = [0] * n
    done: list[set[tuple[str, int]]] = [set() for _ in range(n)]
    progress = True
    while progress:
        progress = False
        for s in range(n):
            while pos[s] < len(per_stage[s]):
                a = per_stage[s][pos[s]]
                ready = (
                    a.kind == "S"
                    or (a.kind == "F" and (s == 0 or ("F", a.mb) in done[s - 1]))
                    or (a.kind == "B" and (s == n - 1 or ("B", a.mb) in done[s + 1]))
                )
                if not ready:
                    break
                done[s].add((a.kind, a.mb))
                pos[s] += 1
                progress = True
    stuck = [s for s in range(n) if pos[s] < len(per_stage[s])]
    if stuck:
        at = ", ".join(f"stage {s} at {per_stage[s][pos[s]]}" for s in stuck)
        raise ScheduleError(f"the pipeline deadlocks: {at}")
    for s in range(n - 1):
        order_out = [a.mb for a in per_stage[s] if a.kind == "F"]
        order_in = [a.mb for a in per_stage[s + 1] if a.kind == "F"]
        if order_out != order_in:
            raise ScheduleError(f"stages {s} and {s + 1} run forwards in different orders")
        b_out = [a.mb for a in per_stage[s + 1] if a.kind == "B"]
        b_in = [a.mb for a in per_stage[s] if a.kind == "B"]
        if b_out != b_in:
            raise ScheduleError(f"stages {s} and {s + 1} run backwards in different orders")


def max_in_flight(actions: Sequence[Action]) -> int:
    """The largest number of micro-batches forwarded but not yet backwarded (activation memory)."""
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind == "B":
            live -= 1
    return peak


def staleness_at_forward(actions: Sequence[Action], step_every: int = 1) -> dict[int, int]:
    """Staleness of each micro-batch: optimizer steps between its forward and its backward.

    Counted at forward time as ``#{x in [done_bwds, done_fwds) : x is the last micro-batch of a
    step}`` (micro-batches are consumed in order). For schedules with explicit steps this equals
    the number of ``S`` actions between ``F m`` and ``B m``.
    """
    done_f = done_b = 0
    out: dict[int, int] = {}
    for a in actions:
        if a.kind == "F":
            out[a.mb] = sum(1 for x in range(done_b, done_f) if (x + 1) % step_every == 0)
            done_f += 1
        elif a.kind == "B":
            done_b += 1
    return out


def render(per_stage: Sequence[Sequence[Action]]) -> str:
    """A text chart, one row per stage, one column per action slot of the longest stage."""
    width = max((len(str(a)) for acts in per_stage for a in acts), default=1)
    rows = []
    for s, acts in enumerate(per_stage):
        cells = " ".join(str(a).ljust(width) for a in acts)
        rows.append(f"stage {s}: {cells}".rstrip())
    return "\n".join(rows)
