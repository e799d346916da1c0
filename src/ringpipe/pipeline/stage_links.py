"""The links between neighbour stages of a pipeline run: how long their messages held the stages up.

From the action events of a run (:mod:`ringpipe.pipeline.action_events`), cut into steps, a
message between two neighbour stages **waits** from when both sides were ready (the sender's pass
that produced it had ended, the receiver's previous action had ended) to the start of the
receiver's pass that uses it: the transfer and its latency as far as they held the receiver up.
A sender still computing or a receiver busy with other work is the schedule's own waiting and is
left out; the schedule's simulation (:mod:`ringpipe.pipeline.diagnosis`) counts no time for
messages, so all of a wait is beyond what the schedule predicts. Per link (stage ``i`` and
``i + 1``, both ways: activations down, gradients up) the waits of a step are summed and the
median over the steps after the first is the link's figure (the two directions' waits are
different stages' idle times and may overlap, so a figure can exceed the step). With
interleaving a link between two ranks carries several boundaries between virtual stages (and
the last rank's link to the first one fewer): links are compared per boundary.

:func:`slow_links` names a link slow when it is :data:`LINK_RATIO` times the median of the other
links and at least :data:`LINK_SHARE` of the step: in an even pipeline every link carries the
same messages, so on a fair network their figures differ by noise (at most 1.5x the other links
in ``benchmarks/pipeline_doctor.py --cases link`` on a crowded 2-core machine, where receivers
often wait for a core; a link shaped to 20 Mbit/s, 4.4x or more), and the share keeps a link
that costs little out of the findings. The
one link of two stages, having no other to compare with, is named when it is :data:`LINK_RATIO`
times the stages' mean busy time per step (a receiver waiting for a core waits about a pass; a
slow link, many).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringpipe.pipeline.action_events import ACTION_OPS

__all__ = ["LinkTimes", "boundaries", "link_times", "slow_links", "LINK_RATIO", "LINK_SHARE"]

#: A link is named slow when its waits are this many times the median of the other links' ...
LINK_RATIO = 3.0
#: ... and at least this share of the measured step (so that a link that costs little is left alone).
LINK_SHARE = 0.05
_OPS = {v: v.removeprefix("pipeline.") for v in ACTION_OPS.values()}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


@dataclass
class LinkTimes:
    """The link between two neighbour stages: how long its messages held the receivers up (seconds per step, medians)."""

    up: int  # the stage that sends activations over it (of two interleaved ranks: the lower)
    down: int  # the stage that sends gradients back
    up_host: str
    down_host: str
    activations: float  # the waits of ``down`` for ``up``'s activations
    gradients: float  # the waits of ``up`` for ``down``'s gradients
    total: float  # the median over steps of both summed
    nbytes: int = 0  # sent over the link per step, both ways (0: not recorded)
    crossings: int = 1  # boundaries between virtual stages over the link (more than 1 with interleaving)

    @property
    def per_crossing(self) -> float:
        """The figure per boundary that crosses the link: what links are compared by."""
        return self.total / self.crossings

    def name(self, hosts: bool) -> str:
        """``stage 1 (host a) and stage 2 (host b)``; without ``hosts``, the stages only."""
        if not hosts:
            return f"stage {self.up} and stage {self.down}"
        return f"stage {self.up} (host {self.up_host}) and stage {self.down} (host {self.down_host})"


def boundaries(stages: int, chunks: int) -> dict[tuple[int, int], list[tuple[int, int, int, int]]]:
    """Per link, the rank pair ``(a, b)`` with ``a < b``: the boundaries between virtual stages that cross it, each
    ``(up rank, up chunk, down rank, down chunk)`` (virtual stage ``g`` is chunk ``g // stages`` of rank
    ``g % stages``, and sends to ``g + 1``). With interleaving, two ranks' link carries several boundaries,
    and on two ranks both directions."""
    out: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for g in range(stages * chunks - 1):
        uc, us = divmod(g, stages)
        dc, ds = divmod(g + 1, stages)
        out.setdefault((min(us, ds), max(us, ds)), []).append((us, uc, ds, dc))
    return out


def _waits(steps: Sequence[Sequence[list[Any]]], stages: int, chunks: int) -> dict[tuple[int, int], list[list[float]]]:
    """Per link (:func:`boundaries`) and step (the first left out): [activation waits, gradient waits] in seconds."""
    out: dict[tuple[int, int], list[list[float]]] = {}
    crossing = boundaries(stages, chunks)
    for k in range(1, len(steps)):
        when: list[dict[tuple[str, int, int], tuple[int, int, int]]] = []  # (kind, mb, chunk) -> start, end, free
        for s in range(stages):
            mine: dict[tuple[str, int, int], tuple[int, int, int]] = {}
            free = steps[k - 1][s][-1].end_ns  # the previous step's last action
            for e in steps[k][s]:
                d = e.detail
                mine[(_OPS[e.op], int(d.get("mb", -1)), int(d.get("chunk", 0)))] = (e.start_ns, e.end_ns, free)
                free = e.end_ns
            when.append(mine)
        for pair, crossings in crossing.items():
            row = [0.0, 0.0]
            out.setdefault(pair, []).append(row)
            for us, uc, ds, dc in crossings:
                for (kind, mb, c), (start, _, free) in when[ds].items():
                    if kind == "F" and c == dc and ("F", mb, uc) in when[us]:  # down waited for up's activation
                        row[0] += (start - max(when[us][("F", mb, uc)][1], free)) / 1e9
                for (kind, mb, c), (start, _, free) in when[us].items():
                    if kind == "B" and c == uc and ("B", mb, dc) in when[ds]:  # up waited for down's gradient
                        row[1] += (start - max(when[ds][("B", mb, dc)][1], free)) / 1e9
    return out


def _link_bytes(rank: Any, peer: int, since: int, until: int) -> int:
    """Bytes ``rank`` sent to stage ``peer`` between two times."""
    return sum(e.nbytes for e in rank.events
               if e.op in ("isend", "send") and e.peer == peer and since <= e.start_ns <= until)


def link_times(steps: Sequence[Sequence[list[Any]]], ranks: Sequence[Any], chunks: int = 1) -> list[LinkTimes]:
    """Every link between neighbour stages, from ``steps[k][stage]`` (that stage's actions of step ``k``,
    in order, each step ending with its ``S``) and each stage's :class:`~ringpipe.observe.collect.RankEvents`.

    A message's wait is the time from when both sides were ready (the sender's pass that made it
    had ended, the receiver's previous action had ended) to the start of the receiver's pass that
    uses it: the transfer and its latency, beyond the schedule's own waits (a receiver busy with
    other work, a sender still computing) which are left out. Activations and gradients are summed
    per step, and each figure is the median over the steps after the first (warm-up). Times are on
    rank 0's clock: an error in a host's clock offset adds to one direction what it takes from the
    other, so the sum of both directions is what is compared. Links with several chunks per rank
    (interleaving) include the link from the last stage back to the first.
    """
    stages = len(ranks)
    if stages < 2 or len(steps) < 2:
        return []
    since, until = min(s[0].start_ns for s in steps[1]), max(s[-1].end_ns for s in steps[-1])
    out = []
    crossing = boundaries(stages, chunks)
    for (up, down), rows in sorted(_waits(steps, stages, chunks).items()):
        both = _link_bytes(ranks[up], down, since, until) + _link_bytes(ranks[down], up, since, until)
        out.append(LinkTimes(up, down, ranks[up].host, ranks[down].host,
                             max(0.0, _median([r[0] for r in rows])), max(0.0, _median([r[1] for r in rows])),
                             max(0.0, _median([r[0] + r[1] for r in rows])), both // (len(steps) - 1),
                             len(crossing[(up, down)])))
    return out



def slow_links(links: Sequence[LinkTimes], step: float, work: float) -> list[tuple[LinkTimes, float]]:
    """The links named slow (see the module docstring), each with how many times the median of the others it is;
    ``step``: the measured step time, ``work``: the stages' mean busy time per step (what the one link of two
    stages is compared with, returned as its ratio)."""
    if len(links) == 1:  # nothing to compare with but the work of the two stages it joins
        only = links[0]
        if step and work and only.total >= LINK_SHARE * step and only.total >= LINK_RATIO * work:
            return [(only, only.total / work)]
        return []
    out = []
    for link in links:
        others = _median([x.per_crossing for x in links if x is not link])
        if link.total >= LINK_SHARE * step and link.per_crossing >= LINK_RATIO * others:
            out.append((link, link.per_crossing / others if others > 0 else float("inf")))
    return out
