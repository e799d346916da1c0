"""The links between neighbour stages of a pipeline run: how long their messages held the stages up.

From the action events of a run (:mod:`ringpipe.pipeline.action_events`), cut into steps, a
message between two neighbour stages **waits** from when both sides were ready (the sender's pass
that produced it had ended, the receiver's previous action had ended) to the start of the
receiver's pass that uses it: the transfer and its latency as far as they held the receiver up.
A sender still computing or a receiver busy with other work is the schedule's own waiting and is
left out; the schedule's simulation (:mod:`ringpipe.pipeline.diagnosis`) counts no time for
messages, so all of a wait is beyond what the schedule predicts. Per link (stage ``i`` and
``i + 1``, both ways: activations down, gradients up) two figures: what it costs, the median over
the steps after the first of each step's summed waits (the two directions' waits are different
stages' idle times and may overlap, so it can exceed the step); and how slow it is, the median
wait of one of its messages. With interleaving a link between two ranks carries several
boundaries between virtual stages (on two ranks, both directions); its messages are pooled.
The asynchronous stream has no step shared by the stages: :func:`stream_link_times` matches its
messages over the whole run (a micro-batch known by its stream and number) and gives each link's
waits per optimizer step as their mean, and how slow it is as the **mean** wait of one of its
messages, the longest tenth left out (:func:`trimmed_mean`), not the median: in the stream each stage
holds micro-batches in flight, so a slow link's
delay is partly hidden; its messages either arrive while the receiver is busy (no wait) or find it
idle and wait about the whole delay, in proportions the schedule sets per link and direction (on
three stages with stage 1's host slow, a third of one link's activations and two thirds of its
gradients wait, the other way round on the other link). The median of such a set is 0 or the whole
delay as fewer or more than half of it wait: of two equally slow links it named one by chance
(stage 1's upstream link, on the synthetic stream) and so never the host. The mean is the link's
waits per message, which the proportions scale but do not flip; the longest tenth is left out for what
the median left out, the few messages whose receiver waited long for a core on a crowded host (up to 73
typical passes at a load average of 10 on 2 CPUs, which put a fair link's plain mean at up to 4.8 passes and
had one named; trimmed, fair links read at most 1.5 passes in 4 runs of 10 trials, the shaped links and slow
hosts' at least 6.7).

:func:`slow_links` names a link slow when its messages' median wait is :data:`LINK_RATIO` times
what it is compared with and it costs at least :data:`LINK_SHARE` of the step more than that, trying
in turn:

1. the other links (the median of theirs). In an even pipeline every link carries the same messages,
   so on a fair network the links differ by noise; a median over messages leaves out the few that
   waited long for a core on a crowded host, which a sum over a step does not.
2. the links that share no stage with it (the median of theirs). A host with a slow network slows
   both links of its stage, so that, on three stages, each is compared with the other, equally slow,
   one, and on four the other links' median holds one of them; the links that share no stage with
   either are the fair ones.
3. a typical pass of the stages (the median of their forward and backward passes per micro-batch),
   when no link shares no stage with it, or those are slow themselves (3 times a pass), and no link's
   messages wait 3 times its own (a link that fast beside a slow one is the fair one of the two).
   A receiver waiting for a core after its message arrived waits about a pass on a crowded host; a
   slow link, many. The one link of two stages, having no other, is always compared so.

On hosts short of cores a link whose two stages are on one host is never named: its messages cross no
network, so a receiver that waited long for one waited for a core, and which of that host's links its
receivers wait on longest is the scheduler's doing (on one host of 2 CPUs, 3 asynchronous stages and
other jobs, the link below a heavy stage read 3.0-3.3 times the other, 3 of 10 runs).

:func:`slow_stage` finds the stage that every link named touches, when at least two are: its host's
network is the common part of their paths.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ringpipe.pipeline.action_events import ACTION_OPS

__all__ = ["LinkTimes", "Ready", "boundaries", "ready_times", "message_waits", "message_latency", "link_times", "stream_link_times",
           "slow_links", "SlowLink", "slow_stage", "LINK_RATIO", "LINK_SHARE", "median_or_zero", "trimmed_mean",
           "TRIMMED"]

#: A link is named slow when its messages' median wait is this many times what it is compared with (the other
#: links', the links' that share no stage with it, or a typical pass) ...
LINK_RATIO = 3.0
#: ... and it costs at least this share of the measured step more than they do (compared with a pass: this
#: share), so that a link that costs little is left alone.
LINK_SHARE = 0.05
_OPS = {v: v.removeprefix("pipeline.") for v in ACTION_OPS.values()}
#: How the asynchronous stream's message figure is taken, as the findings say it.
TRIMMED = "mean, the longest tenth left out"


def median_or_zero(values: Sequence[float]) -> float:
    """The median of ``values``, 0.0 when there are none (a figure of the pipeline doctors with nothing measured)."""
    return statistics.median(values) if values else 0.0


def trimmed_mean(values: Sequence[float]) -> float:
    """The mean of ``values`` with the largest tenth (rounded down) left out (0.0: none)."""
    kept = sorted(values)[:len(values) - len(values) // 10]
    return statistics.fmean(kept) if kept else 0.0


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
    message: float  # the median wait of one message, either way (what links are compared by)
    nbytes: int = 0  # sent over the link per step, both ways (0: not recorded)
    statistic: str = "median"  # how ``message`` was taken over the link's messages (the stream's: :data:`TRIMMED`)

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


#: A stage's actions by what they are: ``(kind, micro-batch key, chunk) -> (start, end, when the stage was free
#: before it)``, nanoseconds. The micro-batch key is its number within a step (flushing schedules) or
#: ``(stream, number)`` within the asynchronous stream, whose numbers start again after each drain.
Ready = dict[tuple[str, Any, int], tuple[int, int, int]]


def ready_times(events: Sequence[Any], free: int, key: Any = None) -> Ready:
    """:data:`Ready` of one stage's ``events`` (its actions in order); ``free``: when the stage was free before
    the first; ``key(event)``: the micro-batch key (default: the event's micro-batch number)."""
    mine: Ready = {}
    for e in events:
        d = e.detail
        mb = key(e) if key is not None else int(d.get("mb", -1))
        mine[(_OPS[e.op], mb, int(d.get("chunk", 0)))] = (e.start_ns, e.end_ns, free)
        free = e.end_ns
    return mine


def _messages(when: Sequence[Ready], pair_crossings: Sequence[tuple[int, int, int, int]], since: int = 0,
              until: float = float("inf")) -> Iterator[tuple[str, int, int, int]]:
    """Each message over one link's ``pair_crossings`` whose receiving pass starts from ``since`` to ``until``:
    ``(kind, sent, free, start)``, ``kind`` ``"F"`` for an activation and ``"B"`` for a gradient, ``sent`` when the
    pass that made it ended, ``free`` when its receiver's previous action ended, ``start`` when the pass that uses it
    began (nanoseconds)."""
    for us, uc, ds, dc in pair_crossings:
        for (kind, mb, c), (start, _, free) in when[ds].items():
            if kind == "F" and c == dc and since <= start <= until and ("F", mb, uc) in when[us]:  # down waited for up
                yield "F", when[us][("F", mb, uc)][1], free, start
        for (kind, mb, c), (start, _, free) in when[us].items():
            if kind == "B" and c == uc and since <= start <= until and ("B", mb, dc) in when[ds]:  # up waited for down
                yield "B", when[ds][("B", mb, dc)][1], free, start


def message_waits(when: Sequence[Ready], pair_crossings: Sequence[tuple[int, int, int, int]],
                  since: int = 0, until: float = float("inf")) -> tuple[list[float], list[float]]:
    """(each activation's wait, each gradient's), seconds, over one link's ``pair_crossings`` (:func:`boundaries`),
    from every stage's :data:`Ready`: each message whose receiving pass starts from ``since`` to ``until``."""
    acts: list[float] = []
    grads: list[float] = []
    for kind, sent, free, start in _messages(when, pair_crossings, since, until):
        (acts if kind == "F" else grads).append((start - max(sent, free)) / 1e9)
    return acts, grads


def message_latency(steps: Sequence[Sequence[list[Any]]], stages: int, chunks: int = 1) -> float:
    """The time a message between stages takes where its receiver waits for it, seconds: over the steps after the
    first (``steps[k][stage]``, as :func:`link_times`), the median of the receiving pass's start less the sending
    pass's end, over the messages whose receiver was free when they were sent (one sent while its receiver still
    computed hides its transfer behind that work, and is left out); 0.0 when there are none."""
    out: list[float] = []
    crossing = boundaries(stages, chunks)
    for when in _ready_by_step(steps, stages):
        for crossings in crossing.values():
            out += [(start - sent) / 1e9 for _, sent, free, start in _messages(when, crossings) if free <= sent]
    return median_or_zero(out)


def _ready_by_step(steps: Sequence[Sequence[list[Any]]], stages: int) -> Iterator[list[Ready]]:
    """Every stage's :data:`Ready` of each step after the first (``steps[k][stage]``), each stage free before a
    step at its previous step's last action."""
    for k in range(1, len(steps)):
        yield [ready_times(steps[k][s], steps[k - 1][s][-1].end_ns) for s in range(stages)]


def _waits(steps: Sequence[Sequence[list[Any]]], stages: int,
           chunks: int) -> dict[tuple[int, int], list[tuple[list[float], list[float]]]]:
    """Per link (:func:`boundaries`) and step (the first left out): (each activation's wait, each gradient's), s."""
    out: dict[tuple[int, int], list[tuple[list[float], list[float]]]] = {}
    crossing = boundaries(stages, chunks)
    for when in _ready_by_step(steps, stages):
        for pair, crossings in crossing.items():
            out.setdefault(pair, []).append(message_waits(when, crossings))
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
    other work, a sender still computing) which are left out. Per link, the activation waits, the
    gradient waits and both are summed per step and their medians taken over the steps after the
    first (warm-up); the median wait of one message pools both directions of those steps. Times are
    on rank 0's clock: an error in a host's clock offset adds to one direction what it takes from
    the other, which pooling both directions keeps from deciding. Links with several chunks per rank
    (interleaving) include the link from the last stage back to the first.
    """
    stages = len(ranks)
    if stages < 2 or len(steps) < 2:
        return []
    since, until = min(s[0].start_ns for s in steps[1]), max(s[-1].end_ns for s in steps[-1])
    out = []
    for (up, down), rows in sorted(_waits(steps, stages, chunks).items()):
        both = _link_bytes(ranks[up], down, since, until) + _link_bytes(ranks[down], up, since, until)
        acts, grads = [sum(r[0]) for r in rows], [sum(r[1]) for r in rows]
        out.append(LinkTimes(up, down, ranks[up].host, ranks[down].host, max(0.0, median_or_zero(acts)),
                             max(0.0, median_or_zero(grads)), max(0.0, median_or_zero([a + g for a, g in zip(acts, grads, strict=True)])),
                             max(0.0, median_or_zero([w for r in rows for w in (*r[0], *r[1])])), both // (len(steps) - 1)))
    return out



def stream_link_times(when: Sequence[Ready], ranks: Sequence[Any], steps: int, since: int, until: int) -> list[LinkTimes]:
    """Every link between neighbour stages of an asynchronous stream (one chunk per rank), from each stage's
    :data:`Ready` over the whole run (micro-batch keys ``(stream, number)``) and its
    :class:`~ringpipe.observe.collect.RankEvents`.

    The stream has no step that every stage shares (each stage steps on its own), so a link's figures per
    step are its waits of the messages received from ``since`` to ``until`` (after the warm-up) summed and
    divided by ``steps``, the optimizer steps each stage made meanwhile: the mean per step, where
    :func:`link_times` takes the median over steps. How slow a link is: the mean wait of one of its
    messages, the longest tenth left out (:func:`trimmed_mean`), both directions pooled (the module
    docstring says why not the median).
    """
    stages = len(ranks)
    if stages < 2 or steps < 1:
        return []
    out = []
    for (up, down), crossings in sorted(boundaries(stages, 1).items()):
        acts, grads = message_waits(when, crossings, since, until)
        both = _link_bytes(ranks[up], down, since, until) + _link_bytes(ranks[down], up, since, until)
        out.append(LinkTimes(up, down, ranks[up].host, ranks[down].host, max(0.0, sum(acts) / steps),
                             max(0.0, sum(grads) / steps), max(0.0, (sum(acts) + sum(grads)) / steps),
                             max(0.0, trimmed_mean(acts + grads)), both // steps, TRIMMED))
    return out



class SlowLink(NamedTuple):
    """A link named slow: how many times what it was compared with its messages' median wait is, and with what:
    ``"links"`` (the other links), ``"apart"`` (the links that share no stage with it) or ``"pass"`` (a typical
    pass of the stages)."""

    link: LinkTimes
    ratio: float
    against: str


def _stages(x: LinkTimes) -> set[int]:
    return {x.up, x.down}


def _against(link: LinkTimes, others: Sequence[LinkTimes], step: float, kind: str, noise: float) -> SlowLink | None:
    """``link`` named slow against the median of ``others``' message waits and costs (None: it is not); its
    messages must also wait ``noise`` longer each than theirs."""
    typical = median_or_zero([x.message for x in others])
    excess = link.total - median_or_zero([x.total for x in others])
    if (excess >= LINK_SHARE * step and link.message >= LINK_RATIO * typical
            and link.message - typical >= noise):
        return SlowLink(link, link.message / typical if typical > 0 else float("inf"), kind)
    return None


def slow_links(links: Sequence[LinkTimes], step: float, pass_time: float, crowded: bool = False) -> list[SlowLink]:
    """The links named slow (see the module docstring), in ``links``' order; ``step``: the measured step time;
    ``pass_time``: a typical pass of the stages; ``crowded``: the hosts were short of cores."""
    found = _slow_links(links, step, pass_time, pass_time if crowded else 0.0)
    return [s for s in found if not (crowded and s.link.up_host == s.link.down_host)]


def _slow_links(links: Sequence[LinkTimes], step: float, pass_time: float, noise: float) -> list[SlowLink]:
    """:func:`slow_links` before links within one crowded host are left out; ``noise``: how much longer than
    the links it is compared with a link's messages must wait (a pass on crowded hosts, else 0)."""
    def by_pass(link: LinkTimes) -> SlowLink | None:
        if pass_time and link.total >= LINK_SHARE * step and link.message >= LINK_RATIO * pass_time:
            return SlowLink(link, link.message / pass_time, "pass")
        return None

    if len(links) == 1:  # nothing to compare with but the work of the two stages it joins
        return [s for s in (by_pass(links[0]),) if s is not None]
    out = []
    for link in links:
        found = _against(link, [x for x in links if x is not link], step, "links", noise)
        apart = [x for x in links if not _stages(x) & _stages(link)]
        if found is None and apart:
            found = _against(link, apart, step, "apart", noise)
        if (found is None and (not apart or median_or_zero([x.message for x in apart]) >= LINK_RATIO * pass_time)
                and not any(x.message >= LINK_RATIO * link.message for x in links)):
            found = by_pass(link)
        if found is not None:
            out.append(found)
    return out


def slow_stage(slow: Sequence[SlowLink]) -> int | None:
    """The stage that every link named touches, when at least two are (None: no such stage)."""
    if len(slow) < 2:
        return None
    common = set.intersection(*(_stages(s.link) for s in slow))
    return min(common) if common else None
