"""Pipeline schedules as data: pure functions ``(stages, microbatches, stage) -> [Action]``.

A schedule says, for one stage, in which order it runs the forward (``F``) and backward (``B``)
of each micro-batch and when it runs its optimizer step (``S``). It knows nothing about
processes or tensors, so it can be printed, validated and tested without any communicator;
the executors (:mod:`ringpipe.pipeline.executor`, :mod:`ringpipe.pipeline.chunked`) run them.
Text form: ``"F0 F1 B0 B1 S"``.

Two extensions serve the newer schedules. A rank may hold several model *chunks* (virtual
stages, :mod:`ringpipe.pipeline.schedules_interleaved`): ``F3.1`` is the forward of
micro-batch 3 on the rank's chunk 1 (``F3`` is chunk 0). And the backward may be split
(:mod:`ringpipe.pipeline.zero_bubble`): in a list that holds ``W`` actions, ``B m`` computes
only the gradient of the stage input and ``W m`` the weight gradient later; a micro-batch's
activations are held until its ``W``.

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
    "num_chunks",
    "max_in_flight",
    "staleness_at_forward",
    "render",
]

Kind = Literal["F", "B", "W", "S"]


class ScheduleError(ValueError):
    """A schedule is malformed (a backward before its forward, a missing step, ...)."""


@dataclass(frozen=True, slots=True)
class Action:
    """One thing a stage does: forward ``F``, backward ``B`` (input gradient only where the list
    has ``W`` actions) or weight-gradient pass ``W`` of micro-batch ``mb`` on the rank's model
    chunk ``chunk``, or step ``S``."""

    kind: Kind
    mb: int = -1
    chunk: int = 0

    def __str__(self) -> str:
        if self.kind == "S":
            return "S"
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def parse(text: str) -> list[Action]:
    """The actions of a text form such as ``"F0 F1 B0 B1 S"`` or ``"F0 F0.1 B0.1 W0.1 B0 W0 S"``."""
    out: list[Action] = []
    for tok in text.split():
        mb, _, chunk = tok[1:].partition(".")
        if tok == "S":
            out.append(Action("S"))
        elif tok[:1] in ("F", "B", "W") and mb.isdigit() and (chunk.isdigit() or "." not in tok):
            out.append(Action(tok[0], int(mb), int(chunk or 0)))  # type: ignore[arg-type]
        else:
            raise ScheduleError(f"cannot parse action {tok!r} in {text!r}; use F<n>, B<n>, W<n> (or F<n>.<chunk>) or S")
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

    Per model chunk (chunks ``0 .. k-1`` must all appear): every micro-batch is forwarded once
    and backwarded once after its forward; where the chunk has ``W`` actions, every micro-batch
    has one ``W``, after its ``B``. The last action must be a step once every backward is done,
    so no gradient is left behind.
    """
    done: dict[str, set[tuple[int, int]]] = {"F": set(), "B": set(), "W": set()}
    for i, a in enumerate(actions):
        where = f"action {i} ({a}) of {format_actions(actions)!r}"
        if a.kind == "S":
            continue
        if not 0 <= a.mb < num_microbatches:
            raise ScheduleError(f"{where}: micro-batch {a.mb} is not in [0, {num_microbatches})")
        if a.chunk < 0:
            raise ScheduleError(f"{where}: chunk {a.chunk} is negative")
        key = (a.chunk, a.mb)
        name = {"F": "forward", "B": "backward", "W": "weight-gradient pass"}[a.kind]
        if key in done[a.kind]:
            raise ScheduleError(f"{where}: {name} of micro-batch {a.mb} appears twice")
        if a.kind == "B" and key not in done["F"]:
            raise ScheduleError(f"{where}: backward of micro-batch {a.mb} before its forward")
        if a.kind == "W" and key not in done["B"]:
            raise ScheduleError(f"{where}: weight-gradient pass of micro-batch {a.mb} before its backward")
        done[a.kind].add(key)
    chunks = sorted({c for c, _ in done["F"] | done["B"]} | {0})
    if chunks != list(range(len(chunks))):
        raise ScheduleError(f"schedule {format_actions(actions)!r} uses chunks {chunks}; use chunks 0 .. k-1")
    for c in chunks:
        missing = sorted(m for m in range(num_microbatches) if (c, m) not in done["B"])
        if missing:
            on = f" of chunk {c}" if len(chunks) > 1 else ""
            raise ScheduleError(f"micro-batches {missing}{on} have no backward in {format_actions(actions)!r}")
        split = {m for cc, m in done["W"] if cc == c}
        if split and len(split) != num_microbatches:
            lacking = sorted(set(range(num_microbatches)) - split)
            raise ScheduleError(
                f"micro-batches {lacking} of chunk {c} have no weight-gradient pass W in "
                f"{format_actions(actions)!r}: a chunk splits the backward of every micro-batch or of none"
            )
    if not actions or actions[-1].kind != "S":
        raise ScheduleError(f"schedule {format_actions(actions)!r} must end with a step S")


def num_chunks(per_stage: Sequence[Sequence[Action]]) -> int:
    """Model chunks per rank in a pipeline's action lists (1 for the classic schedules)."""
    return 1 + max((a.chunk for acts in per_stage for a in acts), default=0)


def validate_pipeline(per_stage: Sequence[Sequence[Action]], num_microbatches: int) -> None:
    """Check every stage and that the whole pipeline can run without deadlock.

    With ``k`` chunks per rank and ``n`` ranks, chunk ``c`` of rank ``s`` is virtual stage
    ``c * n + s``. Simulates the virtual stages with unbounded message queues: a virtual stage
    can run ``F m`` once the previous one ran it, and ``B m`` once the next one ran it (the last
    one's backward follows its own forward); ``W m`` follows the stage's own ``B m``. Forward
    messages between two virtual stages are consumed in the order they are sent, and so are
    backward ones.
    """
    for s, acts in enumerate(per_stage):
        try:
            validate(acts, num_microbatches)
        except ScheduleError as exc:
            raise ScheduleError(f"stage {s}: {exc}") from None
    n, k = len(per_stage), num_chunks(per_stage)
    for s, acts in enumerate(per_stage):
        if num_chunks([acts]) != k:
            raise ScheduleError(f"stage {s} holds {num_chunks([acts])} chunks, other stages {k}")
    total = n * k
    word = "stage" if k == 1 else "virtual stage"
    pos = [0] * n
    done: list[set[tuple[str, int]]] = [set() for _ in range(total)]
    progress = True
    while progress:
        progress = False
        for s in range(n):
            while pos[s] < len(per_stage[s]):
                a = per_stage[s][pos[s]]
                g = a.chunk * n + s
                ready = (
                    a.kind in ("S", "W")
                    or (a.kind == "F" and (g == 0 or ("F", a.mb) in done[g - 1]))
                    or (a.kind == "B" and (g == total - 1 or ("B", a.mb) in done[g + 1]))
                )
                if not ready:
                    break
                if a.kind != "S":
                    done[g].add((a.kind, a.mb))
                pos[s] += 1
                progress = True
    stuck = [s for s in range(n) if pos[s] < len(per_stage[s])]
    if stuck:
        at = ", ".join(f"stage {s} at {per_stage[s][pos[s]]}" for s in stuck)
        raise ScheduleError(f"the pipeline deadlocks: {at}")

    def order(g: int, kind: str) -> list[int]:
        return [a.mb for a in per_stage[g % n] if a.kind == kind and a.chunk == g // n]

    for g in range(total - 1):
        if order(g, "F") != order(g + 1, "F"):
            raise ScheduleError(f"{word}s {g} and {g + 1} run forwards in different orders")
        if order(g + 1, "B") != order(g, "B"):
            raise ScheduleError(f"{word}s {g} and {g + 1} run backwards in different orders")


def max_in_flight(actions: Sequence[Action]) -> int:
    """The largest number of micro-batches whose activations a stage holds at once.

    A micro-batch is held from its forward to its backward, or to its ``W`` where the backward
    is split. With several chunks per rank, a micro-batch counts once per chunk (each chunk
    holds the activations of its share of the rank's layers).
    """
    split = {(a.chunk, a.mb) for a in actions if a.kind == "W"}
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif (a.kind == "B" and (a.chunk, a.mb) not in split) or a.kind == "W":
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


# Schedules in modules of their own register here (they import Action from this module).
from ringpipe.pipeline.schedules_interleaved import interleaved_1f1b  # noqa: E402
from ringpipe.pipeline.zero_bubble import zb_h1, zb_h2  # noqa: E402

SCHEDULES["interleaved_1f1b"] = interleaved_1f1b
SCHEDULES["zb_h1"] = zb_h1
SCHEDULES["zb_h2"] = zb_h2
