"""The vocabulary of pipeline schedules: one stage's :class:`Action`, its text form, the error.

A schedule (:mod:`ringpipe.pipeline.schedules`) is a list of actions per stage: the forward
(``F``) or backward (``B``) of a micro-batch, or the optimizer step (``S``). Text form:
``"F0 F1 B0 B1 S"``. Two extensions serve the newer schedules. A rank may hold several model
*chunks* (virtual stages, :mod:`ringpipe.pipeline.schedules_interleaved`): ``F3.1`` is the
forward of micro-batch 3 on the rank's chunk 1 (``F3`` is chunk 0). And the backward may be
split (:mod:`ringpipe.pipeline.zero_bubble`): in a list that holds ``W`` actions, ``B m``
computes only the gradient of the stage input and ``W m`` the weight gradient later; a
micro-batch's activations are held until its ``W``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "Kind", "ScheduleError", "check_args", "format_actions", "parse", "render"]

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


def check_args(num_stages: int, num_microbatches: int, stage: int) -> None:
    """Raise :class:`ScheduleError` unless ``stage`` is one of ``num_stages >= 1`` stages and ``num_microbatches >= 1``."""
    if num_stages < 1:
        raise ScheduleError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= stage < num_stages:
        raise ScheduleError(f"stage {stage} is not in [0, {num_stages})")


def render(per_stage: Sequence[Sequence[Action]]) -> str:
    """A text chart, one row per stage, one column per action slot of the longest stage."""
    width = max((len(str(a)) for acts in per_stage for a in acts), default=1)
    rows = []
    for s, acts in enumerate(per_stage):
        cells = " ".join(str(a).ljust(width) for a in acts)
        rows.append(f"stage {s}: {cells}".rstrip())
    return "\n".join(rows)
