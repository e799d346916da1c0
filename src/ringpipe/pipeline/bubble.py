"""Time a schedule's action lists imply on an idealised machine, and the bubble that leaves.

Every rank runs its list in order; an action starts when its rank is free and what it
depends on has finished (:func:`~ringpipe.pipeline.schedule_checks.list_schedule`:
``F m`` of virtual stage ``g`` after ``F m`` of ``g - 1``, ``B m`` after ``B m`` of ``g + 1``
and its own ``F m``, ``W m`` after its own ``B m``). Messages take ``latency``. Costs are
those of a whole stage (all of a rank's layers): ``forward``, ``backward_input`` (the
gradient of the stage input) and ``backward_weight`` (the weight gradient); an unsplit ``B``
costs both, and with ``k`` chunks per rank each action of a chunk costs ``1/k`` of its kind.
Steps take no time.

The bubble of a run is the time a rank is not computing: ``makespan - busy``, equal on every
rank since every rank does the same work. :attr:`Timing.bubble_ratio` divides it by the
ideal time ``busy`` (the paper's measure: ``(stages - 1) / microbatches`` for GPipe and 1F1B
with no latency); :attr:`Timing.bubble_fraction` by the makespan (the share of the run spent
idle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ringpipe.pipeline.schedule_checks import list_schedule
from ringpipe.pipeline.schedules import Action, num_chunks

__all__ = ["Timing", "simulate_timing", "bubble_fraction"]


@dataclass(frozen=True)
class Timing:
    """When each action of each rank started and ended, the makespan, and the busy time per rank."""

    makespan: float
    busy: tuple[float, ...]
    spans: tuple[tuple[tuple[Action, float, float], ...], ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of ``ranks x makespan``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0

    @property
    def bubble_ratio(self) -> float:
        """Idle time over ideal (busy) time, the largest over ranks."""
        return max((self.makespan - b) / b for b in self.busy if b > 0)


def simulate_timing(
    per_stage: Sequence[Sequence[Action]],
    forward: float = 1.0,
    backward_input: float = 1.0,
    backward_weight: float = 1.0,
    latency: float = 0.0,
) -> Timing:
    """List-schedule ``per_stage`` (one action list per rank) under the dependencies above."""
    k = num_chunks(per_stage)
    split = [{(a.chunk, a.mb) for a in acts if a.kind == "W"} for acts in per_stage]

    def cost(s: int, a: Action) -> float:
        if a.kind == "F":
            return forward / k
        if a.kind == "W":
            return backward_weight / k
        if a.kind == "B":
            return (backward_input + (0.0 if (a.chunk, a.mb) in split[s] else backward_weight)) / k
        return 0.0

    spans = list_schedule(per_stage, cost, latency)
    busy = [sum(cost(s, a) for a in acts) for s, acts in enumerate(per_stage)]
    makespan = max((rank[-1][2] for rank in spans if rank), default=0.0)
    return Timing(makespan, tuple(busy), tuple(tuple(x) for x in spans))


def bubble_fraction(
    per_stage: Sequence[Sequence[Action]],
    forward: float = 1.0,
    backward_input: float = 1.0,
    backward_weight: float = 1.0,
    latency: float = 0.0,
) -> float:
    """The idle share of a schedule's run (:attr:`Timing.bubble_fraction` of :func:`simulate_timing`)."""
    return simulate_timing(per_stage, forward, backward_input, backward_weight, latency).bubble_fraction
