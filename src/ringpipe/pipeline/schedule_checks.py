"""Checks and measures of schedules' action lists: well-formed, deadlock-free, memory, staleness.

:func:`validate` checks one stage's actions, :func:`validate_pipeline` that all stages together
run without deadlock and pass messages in matching orders; :func:`max_in_flight` (peak
activation memory, in micro-batches) and :func:`staleness_at_forward` (optimizer steps between
a micro-batch's forward and its backward) measure a list. They read any action list, whichever
schedule (:mod:`ringpipe.pipeline.schedules`) or hand produced it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ringpipe.pipeline.actions import Action, ScheduleError, format_actions

__all__ = ["list_schedule", "max_in_flight", "num_chunks", "staleness_at_forward", "validate", "validate_pipeline"]


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


def list_schedule(
    per_stage: Sequence[Sequence[Action]], cost: Callable[[int, Action], float], latency: float = 0.0,
) -> list[list[tuple[Action, float, float]]]:
    """Run every rank's list in order on an idealised machine: each action's (start, end) per rank.

    An action starts when its rank is free and what it depends on has ended: with ``k`` chunks
    per rank and ``n`` ranks, chunk ``c`` of rank ``s`` is virtual stage ``g = c * n + s``;
    ``F m`` of ``g`` follows ``F m`` of ``g - 1``, ``B m`` of ``g`` follows its own ``F m`` and
    ``B m`` of ``g + 1``, ``W m`` follows its own ``B m``; a message between virtual stages takes
    ``latency``; ``cost(rank, action)`` is how long an action computes. Raises
    :class:`ScheduleError` naming each stuck rank's next action when the lists deadlock.
    """
    n, k = len(per_stage), num_chunks(per_stage)
    total = n * k
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * n
    pos = [0] * n
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(n)]
    progress = True
    while progress:
        progress = False
        for s in range(n):
            while pos[s] < len(per_stage[s]):
                a = per_stage[s][pos[s]]
                g = a.chunk * n + s
                deps: list[float] = []
                if a.kind == "F" and g > 0:
                    deps.append(end.get(("F", g - 1, a.mb), -1.0) + latency)
                elif a.kind == "B":
                    deps.append(end.get(("F", g, a.mb), -1.0))
                    if g < total - 1:
                        deps.append(end.get(("B", g + 1, a.mb), -1.0) + latency)
                elif a.kind == "W":
                    deps.append(end.get(("B", g, a.mb), -1.0))
                if any(d < 0 for d in deps):
                    break
                start = max([free[s], *deps])
                free[s] = start + cost(s, a)
                if a.kind != "S":
                    end[(a.kind, g, a.mb)] = free[s]
                spans[s].append((a, start, free[s]))
                pos[s] += 1
                progress = True
    stuck = [f"stage {s} at {per_stage[s][pos[s]]}" for s in range(n) if pos[s] < len(per_stage[s])]
    if stuck:
        raise ScheduleError(f"the pipeline deadlocks: {', '.join(stuck)}")
    return spans


def validate_pipeline(per_stage: Sequence[Sequence[Action]], num_microbatches: int) -> None:
    """Check every stage and that the whole pipeline can run without deadlock.

    With ``k`` chunks per rank and ``n`` ranks, chunk ``c`` of rank ``s`` is virtual stage
    ``c * n + s``. Runs the virtual stages with unbounded message queues (:func:`list_schedule`,
    no costs): a virtual stage can run ``F m`` once the previous one ran it, and ``B m`` once the
    next one ran it and it ran its own ``F m``; ``W m`` follows the stage's own ``B m``. Forward
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
    list_schedule(per_stage, lambda s, a: 0.0)  # raises if the pipeline deadlocks

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
