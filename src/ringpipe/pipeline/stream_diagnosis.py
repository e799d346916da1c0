"""The pipeline doctor for the asynchronous pipeline: where the stream's time goes, and the split its figures favour.

The asynchronous pipeline (``async_1f1b``, PipeDream without flush: ``ringpipe train --mode async``)
keeps its stream of micro-batches full from one drain to the next: each stage steps on its own after
every ``step_every`` backwards and no stage waits for a flush, so the schedule has no bubble in
steady state, only its fill and drain at the stream's ends (the trainer drains the stream at every
epoch end, evaluation and checkpoint). There is no step shared by the stages to explain (as
:mod:`ringpipe.pipeline.diagnosis` explains a synchronous one); what sets the speed is the
**period**, the time from one optimizer step of a stage to its next, the same on every stage in
steady state and set by the slowest.

From the run's action events (:mod:`ringpipe.pipeline.action_events`) it measures, per stage, the
time of each pass per micro-batch as its passes' 10th percentile (:func:`unhindered`: the thread's CPU
time with one intra-op thread, as the synchronous doctor; a pass's CPU time still grows when other
processes share its core's caches and memory, the slowed passes are time outside the work), the mean period (between consecutive optimizer steps of one stream, from a
stage's first step to its stream's last forward: the fill before and the drain after are left out,
and so are the drains and evaluations between streams; the mean, as where messages are slow the
periods alternate, a few short ones while a stage runs the micro-batches it may hold in flight, then
a long one while it waits for the round trip), and per period the stage's busy time, its waits
for messages (:func:`~ringpipe.pipeline.stage_links.stream_link_times`: from when the sender's pass
had ended and the stage was free to the start of the pass that needed the message) and the rest,
idle: waiting for a slower neighbour. The period is then explained with the schedule's own action
lists (:func:`~ringpipe.pipeline.schedules.async_1f1b`) run on an idealised machine
(:func:`~ringpipe.pipeline.diagnosis.step_time`) at two stream lengths, whose difference leaves out
fill and drain:

- **imbalance**: how much longer the period is with each stage's own pass times than with every
  stage at their mean (the heaviest stage sets the period);
- **transport and other**: the measured period the simulation does not explain (messages, a stage
  late for other reasons, the loop's own work between the batches it feeds into the stream, which
  runs within the stream);
- **fill and drain**: the share of a stream of the run's length (micro-batches from one drain to the
  next) that the schedule, stages balanced, spends filling and draining: its only bubble.

The findings: the breakdown; the heaviest stage when it lengthens the period, with a
``pipeline.balance`` moving layers off it (:func:`~ringpipe.pipeline.diagnosis.rebalanced_stages`)
and its predicted period (the run's time outside the passes kept) — a problem only when some split
of the layers shortens the simulated period 1.1 times (:data:`~ringpipe.pipeline.diagnosis.BETTER`),
else information: the imbalance is then the layers' size, which no ``pipeline.balance`` changes (two
stages of an MLP split [2, 3], the last holding the head and loss: 7-10 % apart, named a problem
in runs where noise took it past 10 %); time outside the passes; a slow
link between stages; a stream drained so often that filling and draining cost a share of it.
``ringpipe doctor RUN --verify N`` measures a recommended balance by training, as for the
synchronous schedules (:mod:`ringpipe.observe.verify_run`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ringpipe.observe.collect import JobEvents
from ringpipe.observe.doctor import register_analyzer, register_figures
from ringpipe.observe.finding import Finding
from ringpipe.pipeline.action_events import ACTION_OPS, cpu_times_measure_passes, pass_seconds
from ringpipe.pipeline.diagnosis import (
    BETTER,
    PROBLEM_SHARE,
    StageTimes,
    crowded_hosts,
    imbalance_share,
    link_figures,
    links_text,
    mean_stages,
    ms,
    named_slow_links,
    pass_costs,
    rebalanced_stages,
    slow_host_figures,
    stage_figures,
    stage_link_findings,
    step_time,
    transport_share,
)
from ringpipe.pipeline.schedules import async_1f1b
from ringpipe.pipeline.stage_links import (
    LinkTimes,
    median_or_zero,
    ready_times,
    stream_link_times,
)

__all__ = ["StreamBreakdown", "stream_breakdown", "stream_findings", "stream_figures", "stream_period", "unhindered",
           "SLOWED"]

_OPS = {v: v.removeprefix("pipeline.") for v in ACTION_OPS.values()}
#: A stream of up to this many micro-batches is simulated whole for its fill and drain; a longer one is
#: extrapolated from it (in steady state every period is the same).
_SIMULATED = 512


#: The share of a stage's passes of one kind that :func:`unhindered` takes to run slowed.
SLOWED = 0.1


def unhindered(values: Sequence[float]) -> float:
    """A pass's work from its times: their 10th percentile (the value above the fastest tenth), not the median.

    The thread's CPU time leaves out the waits for a core, but not the slowdown of sharing the core's caches
    and memory with other processes, which only ever adds: on a host short of cores (2 CPUs, 3 stages and other
    jobs) one stage's passes ran 1.3-2 times their usual CPU time for much of a run, a different stage each run,
    so that with medians the stages of an even split read 12-16% apart in 6 runs of 10 (asynchronous 3 stages,
    benchmarks/RESULTS.md) and the heaviest was named. The passes that ran unhindered show the work a split
    decides; a low percentile rather than the least keeps one unusually fast pass from deciding. On a quiet
    host a stage's passes differ little and this is about their median."""
    if not values:
        return 0.0
    return sorted(values)[int(SLOWED * len(values))]


@dataclass
class StreamBreakdown:
    """An asynchronous pipeline run's period explained (seconds per optimizer step of a stage)."""

    stages: int
    microbatches: int  # per batch fed into the stream
    step_every: int  # micro-batches per optimizer step
    stream: int  # micro-batches from one drain to the next (the median over the run's streams)
    balance: list[int] | None
    per_stage: list[StageTimes]  # passes per micro-batch; period, busy per optimizer step
    messages: list[float]  # per stage, its waits for messages per optimizer step
    measured: float  # the mean period within the streams (the median over stages)
    mean_period: float  # the run's whole time per optimizer step: drains and evaluations between streams too
    balanced: float  # simulated period, every stage at the mean pass times
    predicted: float  # simulated period, each stage at its own pass times
    fill_drain: float  # share of a stream the balanced schedule spends filling and draining
    links: list[LinkTimes] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)
    crowded: str = ""  # why the hosts had no core to spare ("": they had), :func:`crowded_hosts`

    schedule = "async_1f1b"

    @property
    def imbalance(self) -> float:
        """Share of the measured period added by unequal stages."""
        return imbalance_share(self.measured, self.predicted, self.balanced)

    @property
    def transport(self) -> float:
        """Share of the measured period the simulation does not explain."""
        return transport_share(self.measured, self.predicted)

    def idle(self, stage: int) -> float:
        """A stage's time per period neither computing nor waiting for a message: waiting for a neighbour."""
        st = self.per_stage[stage]
        return max(0.0, self.measured - st.busy - self.messages[stage])

    @property
    def measured_idle(self) -> float:
        """The stages' mean share of the period not computing (messages and idle)."""
        if not self.measured:
            return 0.0
        return statistics.fmean(max(0.0, self.measured - st.busy) for st in self.per_stage) / self.measured


def stream_period(per_stage: Sequence[StageTimes], step_every: int) -> float:
    """The steady-state period (per optimizer step) of the asynchronous 1F1B stream with these pass times:
    the difference of two stream lengths' simulated makespans, per optimizer step between them."""
    p, k = len(per_stage), step_every
    m1 = k * (2 * p + 2)
    m2 = m1 + k * 4 * p
    cost = pass_costs(per_stage)
    t1 = step_time([async_1f1b(p, m1, s, k) for s in range(p)], cost)[0]
    t2 = step_time([async_1f1b(p, m2, s, k) for s in range(p)], cost)[0]
    return (t2 - t1) / ((m2 - m1) / k)


def _fill_drain(per_stage: Sequence[StageTimes], step_every: int, length: int, period: float) -> float:
    """Share of a stream of ``length`` micro-batches spent filling and draining (stages at these pass times):
    its mean idle time over its makespan, the idle time being the same for a longer stream."""
    p, k = len(per_stage), step_every
    n = max(1, min(length, _SIMULATED))
    t, busy = step_time([async_1f1b(p, n, s, k) for s in range(p)], pass_costs(per_stage))
    if not t:
        return 0.0
    return (t - statistics.fmean(busy)) / (t + max(0, length - n) / k * period)


def _stream(events: Sequence[Any]) -> tuple[list[Any], dict[int, int], dict[str, Any]]:
    """A rank's actions in order, each one's stream (numbered from 0; micro-batch numbers start again at 0
    after each drain) by ``id``, and the schedule its steps carry."""
    acts = sorted((e for e in events if e.op in _OPS), key=lambda e: e.start_ns)
    stream, of = -1, {}
    info: dict[str, Any] = {}
    for e in acts:
        if e.op == "pipeline.F" and int(e.detail.get("mb", -1)) == 0:
            stream += 1
        of[id(e)] = max(stream, 0)
        if e.op == "pipeline.S":
            info = {k: v for k, v in e.detail.items() if k not in ("mb", "chunk")}
    return acts, of, info


def _stage_times(stage: int, acts: Sequence[Any], of: dict[int, int], cpu: bool) -> tuple[StageTimes, list[float]]:
    """The stage's passes (:func:`unhindered`, after its first optimizer step), its mean busy time per period, and its
    periods: between consecutive optimizer steps of one stream before its drain (after the stream's last forward
    the stage only drains, at another rate), or all of one stream's where the streams are too short to have two
    such. Its StageTimes' ``period`` is left to the caller."""
    st = StageTimes(stage)
    steps = [i for i, e in enumerate(acts) if e.op == "pipeline.S"]
    last_forward = {of[id(e)]: i for i, e in enumerate(acts) if e.op == "pipeline.F"}
    pairs = [(a, b) for a, b in zip(steps, steps[1:], strict=False) if of[id(acts[a])] == of[id(acts[b])]]
    steady = [(a, b) for a, b in pairs if b < last_forward.get(of[id(acts[b])], -1)]  # not in the drain
    if len(steady) >= 2:  # else streams shorter than the pipeline: every period fills or drains
        pairs = steady
    periods = [(acts[b].end_ns - acts[a].end_ns) / 1e9 for a, b in pairs]
    busy = [sum(pass_seconds(e, cpu) for e in acts[a + 1:b + 1]) for a, b in pairs]
    passes: dict[str, list[float]] = {}
    for e in acts[steps[0] + 1:] if steps else []:
        passes.setdefault(_OPS[e.op], []).append(pass_seconds(e, cpu))
    for kind, table in (("F", st.forward), ("B", st.backward), ("W", st.weight)):
        if passes.get(kind):
            table[0] = unhindered(passes[kind])
    st.step = unhindered(passes.get("S", []))
    st.busy = statistics.fmean(busy) if busy else 0.0
    st.steps = len(periods)
    return st, periods


def stream_breakdown(job: JobEvents) -> StreamBreakdown | None:
    """The period of the asynchronous pipeline run in ``job`` explained (None: no such run, or fewer than
    three optimizer steps of one stream on some stage)."""
    ranks = [(r, *_stream(r.events)) for r in job.ranks]
    ranks = [x for x in ranks if x[3].get("schedule") == "async_1f1b"]
    if not ranks:
        return None
    info = ranks[0][3]
    stages, k = int(info["stages"]), int(info.get("step_every") or 1)
    first: dict[int, tuple[Any, list[Any], dict[int, int], dict[str, Any]]] = {}
    for entry in ranks:  # replicas of a stage: the first one seen
        first.setdefault(int(entry[3].get("stage", 0)), entry)
    if sorted(first) != list(range(stages)) or int(info.get("chunks") or 1) != 1:
        return None
    cpu = all(cpu_times_measure_passes(first[s][0].events) for s in range(stages))
    timed = [_stage_times(s, first[s][1], first[s][2], cpu) for s in range(stages)]
    if any(len(periods) < 2 for _, periods in timed):
        return None
    per_stage = [st for st, _ in timed]
    measured = median_or_zero([statistics.fmean(periods) for _, periods in timed])
    for st in per_stage:
        st.period = measured
    step_ends = [[e.end_ns for e in first[s][1] if e.op == "pipeline.S"] for s in range(stages)]
    mean_period = median_or_zero([(ends[-1] - ends[0]) / 1e9 / (len(ends) - 1) for ends in step_ends])
    # links: the messages from every stage's first optimizer step to the first stage's last
    since, until = max(ends[0] for ends in step_ends), min(ends[-1] for ends in step_ends)
    counted = median_or_zero([sum(since < t <= until for t in ends) for ends in step_ends])
    when = [ready_times(first[s][1], first[s][1][0].start_ns,
                        key=lambda e, of=first[s][2]: (of[id(e)], int(e.detail.get("mb", -1))))
            for s in range(stages)]
    links = stream_link_times(when, [first[s][0] for s in range(stages)], int(counted), since, until)
    messages = [0.0] * stages
    for x in links:
        messages[x.down] += x.activations
        messages[x.up] += x.gradients
    lengths = _stream_lengths(first[0][1], first[0][2])
    mean = mean_stages(per_stage)
    balanced = stream_period(mean, k)
    bal = info.get("balance")
    return StreamBreakdown(stages, int(info["microbatches"]), k, int(median_or_zero(lengths)), list(bal) if bal else None,
                           per_stage, messages, measured, mean_period, balanced, stream_period(per_stage, k),
                           _fill_drain(mean, k, int(median_or_zero(lengths)), balanced), links,
                           {"cpu": cpu, "recompute": bool(info.get("recompute")), "streams": len(lengths)},
                           crowded_hosts(job))


def _stream_lengths(acts: Sequence[Any], of: dict[int, int]) -> list[int]:
    """Micro-batches forwarded in each stream (the last one as far as the events go)."""
    count: dict[int, int] = {}
    for e in acts:
        if e.op == "pipeline.F":
            count[of[id(e)]] = count.get(of[id(e)], 0) + 1
    return [count[s] for s in sorted(count)]


# ----------------------------------------------------------------------------- findings


def _per_stage_text(b: StreamBreakdown) -> str:
    rows = []
    for s, st in enumerate(b.per_stage):
        f, bw = sum(st.forward.values()), sum(st.backward.values())
        rows.append(f"stage {st.stage}: F {ms(f)}, B {ms(bw)} per micro-batch, step {ms(st.step)}; per optimizer "
                    f"step busy {ms(st.busy)}, waiting for messages {ms(b.messages[s])}, idle {ms(b.idle(s))} "
                    f"({100 * b.idle(s) / b.measured:.0f}%)")
    return "; ".join(rows)


def _per_step(st: StageTimes, k: int) -> float:
    """A stage's passes per optimizer step (``k`` micro-batches and the step), from its pass times."""
    return k * sum(sum(t.values()) for t in (st.forward, st.backward, st.weight)) + st.step


def stream_findings(job: JobEvents) -> list[Finding]:
    """The asynchronous pipeline doctor's findings for ``job`` (none when it holds no such run)."""
    b = stream_breakdown(job)
    if b is None:
        return []
    k = b.step_every
    every = f"{k} micro-batch{'es' if k > 1 else ''}"
    rate = f"{every}, {ms(b.measured / k)} per micro-batch" if k > 1 else every
    head = (f"asynchronous pipeline (async_1f1b on {b.stages} stages): one optimizer step every "
            f"{ms(b.measured)} per stage ({rate}; {b.per_stage[0].steps} steps)")
    parts = (f"no schedule bubble in steady state (the stream is not flushed); imbalance between stages "
             f"{100 * b.imbalance:.1f}%, transport and other {100 * b.transport:.1f}% of the period; fill and drain "
             f"{100 * b.fill_drain:.1f}% of a stream of {b.stream} micro-batches (predicted with balanced stages; "
             f"{b.detail['streams']} stream(s) in the run, each drained at an epoch end, evaluation or checkpoint)")
    between = max(0.0, b.mean_period - b.measured)
    evidence = (f"{parts}. {_per_stage_text(b)}; simulated period {ms(b.predicted)} (balanced {ms(b.balanced)}); "
                f"drains and evaluations between streams (outside their steady state) {ms(between)} per optimizer "
                f"step on average")
    if b.links:
        evidence += f"; waits on the links between stages per optimizer step: {links_text(b)}"
    largest = max(("imbalance", b.imbalance), ("transport", b.transport), key=lambda x: x[1])
    what = {"imbalance": f"{head}: mostly imbalance between stages",
            "transport": f"{head}: mostly time outside the passes (transport and other)"}[largest[0]]
    if largest[1] < PROBLEM_SHARE:
        what = f"{head}: no part above {100 * PROBLEM_SHARE:.0f}% of the period"
    found = [Finding("info", what, evidence)]

    skew = (b.predicted - b.balanced) / b.predicted if b.predicted else 0.0
    if skew >= PROBLEM_SHARE / 2:
        heavy = max(range(b.stages), key=lambda s: _per_step(b.per_stage[s], k))
        mean_busy = statistics.fmean(_per_step(st, k) for st in b.per_stage)
        fix = "give the heaviest stage fewer layers (pipeline.balance) or use pipeline.partition=time"
        gain = ""
        fixable = True  # no split known (no balance recorded): the imbalance may be the split's
        moved = rebalanced_stages(b.per_stage, b.balance, steps_per_microbatch=1 / k)
        if moved is None and b.balance is not None:  # the split is already the most even of these layers
            fixable = False
            gain = (f"; no split of its layers is more even (each layer's passes and step costed at its stage's "
                    f"mean): pipeline.balance {b.balance} is already the best, the imbalance is the layers' size")
        if moved is not None:
            new, stages = moved
            by_passes = stream_period(stages, k)
            # judged, as the skew, on the passes alone: the time outside them, kept below, is not the split's
            fixable = b.predicted / by_passes >= BETTER
            t = by_passes + max(0.0, b.measured - b.predicted)  # the time outside the passes kept
            gain = (f"; with pipeline.balance={new} (each layer's passes and step costed at its stage's mean) the "
                    f"period is predicted "
                    f"{ms(t)} instead of {ms(b.measured)} ({b.measured / t:.2f}x)")
            if not fixable:
                gain += (f"; no split of its layers shortens the simulated period {BETTER:.1f} times (the best, "
                         f"{ms(by_passes)} against {ms(b.predicted)}): the imbalance is the layers' size")
            if b.measured / t >= BETTER and fixable:
                fix = f"ringpipe train --set pipeline.balance=[{','.join(map(str, new))}] (now {b.balance})"
                crowded = b.crowded
                if crowded:  # as the synchronous doctor: the prediction gives each stage a core
                    fix = (f"once every stage has a core of its own: {fix}; not recommended now: {crowded}, and "
                           "the prediction gives each stage a core")
        if not fixable:
            fix = "no pipeline.balance helps; a model cut into more, smaller layers could be split more evenly"
        found.append(Finding(
            "problem" if skew >= PROBLEM_SHARE and fixable else "info",
            f"pipeline stage {heavy} is the heaviest: it sets the asynchronous stream's rate, the others wait for it",
            f"stage {heavy} computes {ms(_per_step(b.per_stage[heavy], k))} per optimizer step ({every} and the "
            f"step) against a mean of {ms(mean_busy)}; with the measured passes the period is {ms(b.predicted)} "
            f"against {ms(b.balanced)} with balanced stages ({100 * skew:.1f}% longer){gain}",
            fix,
        ))
    slow = named_slow_links(b)
    if b.transport >= PROBLEM_SHARE:
        found.append(Finding(
            "problem",
            "pipeline stages wait longer than their passes explain",
            f"measured period {ms(b.measured)}, simulated from the measured passes {ms(b.predicted)}: "
            f"{ms(b.measured - b.predicted)} per optimizer step ({100 * b.transport:.1f}%) is spent in messages "
            "between stages, a stage late for other reasons (a busy CPU) or the loop's own work",
            ("see the slow link (or host) named below" if slow else
             "check the links between the stages' hosts (ringpipe doctor -n N --probe) and the CPU load; "
             "larger micro-batches send fewer, larger messages"),
        ))
    found += stage_link_findings(b, slow, b.crowded,
                                 f"the mean over {b.per_stage[0].steps} optimizer steps of the waits of every message")
    if b.fill_drain >= PROBLEM_SHARE:
        found.append(Finding(
            "problem",
            f"the asynchronous stream is drained often: filling and draining take {100 * b.fill_drain:.1f}% of "
            f"each stream of {b.stream} micro-batches",
            "predicted from the schedule's action lists with balanced stages at the measured pass times; the "
            "stream is drained at every epoch end, evaluation and checkpoint, and each drain idles the stages "
            "as a synchronous schedule's flush does",
            "evaluate and checkpoint less often (or use longer epochs), so that each stream runs longer",
        ))
    return found


def stream_figures(job: JobEvents) -> dict[str, Any] | None:
    """The breakdown of an asynchronous pipeline run as ``ringpipe doctor --json`` gives it (None: not one)."""
    b = stream_breakdown(job)
    if b is None:
        return None
    per_stage = [{**stage_figures(st), "messages_s": b.messages[s], "idle_s": b.idle(s)}
                 for s, st in enumerate(b.per_stage)]
    return {"schedule": b.schedule, "stages": b.stages, "microbatches": b.microbatches, "chunks": 1,
            "balance": b.balance, "steps": b.per_stage[0].steps, "per": "optimizer step", "step_every": b.step_every,
            "stream_microbatches": b.stream, "streams": b.detail["streams"], "measured_s": b.measured,
            "predicted_s": b.predicted, "balanced_s": b.balanced,
            "between_steps_s": max(0.0, b.mean_period - b.measured), "cpu_times": b.detail["cpu"],
            "shares": {"fill_drain": b.fill_drain, "imbalance": b.imbalance, "transport": b.transport,
                       "idle": b.measured_idle},
            "per_stage": per_stage, "links": link_figures(b), "slow_hosts": slow_host_figures(b)}


register_analyzer(stream_findings)
register_figures("pipeline", stream_figures)
