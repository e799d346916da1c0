"""The pipeline doctor: where a pipeline step's time goes, and the change its own figures favour.

From the events of a pipeline run (:mod:`ringpipe.pipeline.action_events`: every forward
``F``, backward ``B``, weight pass ``W`` and step ``S`` of every stage, timed) it measures,
per stage, the median time of each pass per micro-batch (the thread's CPU time when torch ran
one intra-op thread, so that a pass that waited for a core is not taken for a heavy one; the
wall time otherwise, and where the passes computed off the CPU:
:func:`~ringpipe.pipeline.action_events.cpu_times_measure_passes`), the step period (from one step's end
to the next, the first step left out as warm-up) and the stage's busy time per step; the rest
of the period the stage was idle. It then explains the step time with the schedule's own
action lists run on an idealised machine (:func:`~ringpipe.pipeline.schedule_checks.list_schedule`,
as :func:`~ringpipe.pipeline.bubble.simulate_timing` does), in three parts:

- **the schedule's bubble**: the idle time of the schedule when every stage takes the mean of
  the measured pass times (what the schedule costs even on a perfect split);
- **imbalance**: how much longer the step gets with each stage's own measured pass times;
- **transport and other**: the measured step time the simulation does not explain (messages
  between stages, a stage late for other reasons, the training loop's own work).

The links between neighbour stages are measured on their own (:mod:`ringpipe.pipeline.stage_links`:
how long each link's messages held the stages up, beyond the schedule's own waits), and a link
clearly slower than the others is named with its stages and hosts; when the links named are a stage's
links to both neighbours, its host is named once instead.

Findings name the largest part and the change that the same simulation says helps most:
more micro-batches (pass times assumed proportional to the micro-batch size), interleaving
with 2 chunks per rank, a zero-bubble schedule (``zb_h1``/``zb_h2``; with an unsplit backward
the weight pass is taken as half of it, the paper's equal-passes assumption), or another
``pipeline.balance`` (layers moved off the heaviest stage, each layer's cost taken as its
stage's mean), each with its predicted step time. The breakdown's figures, links included, are
``ringpipe doctor --json``'s ``pipeline`` (:func:`pipeline_figures`). The asynchronous pipeline,
whose stages share no step, is explained per optimizer step by
:mod:`ringpipe.pipeline.stream_diagnosis`, with the pieces of this module it shares (the
simulation, pass costs, the rebalanced split, the link findings).
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ringpipe.observe.collect import JobEvents
from ringpipe.observe.doctor import register_analyzer, register_figures
from ringpipe.observe.finding import Finding
from ringpipe.pipeline.action_events import (
    ACTION_OPS,
    computes_on_cpu,
    cpu_times_measure_passes,
    pass_seconds,
)
from ringpipe.pipeline.actions import Action, ScheduleError
from ringpipe.pipeline.partition import balance_by_size
from ringpipe.pipeline.schedule_checks import list_schedule
from ringpipe.pipeline.schedules import SCHEDULES, async_1f1b
from ringpipe.pipeline.schedules_interleaved import interleaved_1f1b
from ringpipe.pipeline.stage_links import (
    LinkTimes,
    SlowLink,
    link_times,
    median_or_zero,
    message_latency,
    slow_links,
    slow_stage,
)

__all__ = ["StageTimes", "PipelineBreakdown", "breakdown", "pipeline_findings", "pipeline_figures", "step_time",
           "actions_of", "pass_costs", "mean_stages", "rebalanced_stages", "stage_link_findings", "links_text",
           "link_figures", "named_slow_links", "slow_host_figures", "stage_figures", "crowded_hosts", "imbalance_share", "transport_share", "ms", "PROBLEM_SHARE", "BETTER"]

#: A part of the step this large (share of the measured step time) is named as a problem.
PROBLEM_SHARE = 0.10
#: A change is recommended when it is predicted this much faster.
BETTER = 1.10
_OPS = {v: v.removeprefix("pipeline.") for v in ACTION_OPS.values()}


@dataclass
class StageTimes:
    """One stage's medians (seconds): per pass per micro-batch (per chunk), the step, the period, busy time."""

    stage: int
    forward: dict[int, float] = field(default_factory=dict)
    backward: dict[int, float] = field(default_factory=dict)
    weight: dict[int, float] = field(default_factory=dict)
    step: float = 0.0
    period: float = 0.0
    busy: float = 0.0
    steps: int = 0

    @property
    def idle(self) -> float:
        return max(0.0, self.period - self.busy)


def imbalance_share(measured: float, predicted: float, balanced: float) -> float:
    """Share of a measured time (a step, a stream's period) that unequal stages add: the simulation with
    each stage's own passes (``predicted``) over the one with every stage at the mean (``balanced``)."""
    return max(0.0, predicted - balanced) / measured if measured else 0.0


def transport_share(measured: float, predicted: float) -> float:
    """Share of a measured time that the simulation of the passes does not explain (messages and other)."""
    return max(0.0, measured - predicted) / measured if measured else 0.0


@dataclass
class PipelineBreakdown:
    """A pipeline run's step explained: measured, the schedule's bubble, imbalance, the rest (seconds per step)."""

    schedule: str
    stages: int
    microbatches: int
    chunks: int
    balance: list[int] | None
    per_stage: list[StageTimes]
    measured: float  # the median step period over stages
    ideal: float  # mean busy time per stage with balanced passes
    balanced: float  # simulated step time, every stage at the mean pass times
    predicted: float  # simulated step time, each stage at its own pass times
    detail: dict[str, Any] = field(default_factory=dict)
    links: list[LinkTimes] = field(default_factory=list)
    crowded: str = ""  # why the hosts had no core to spare ("": they had), :func:`crowded_hosts`

    @property
    def measured_idle(self) -> float:
        """The stages' mean idle share of the measured step."""
        return statistics.fmean(s.idle for s in self.per_stage) / self.measured if self.measured else 0.0

    @property
    def message_waits(self) -> list[float]:
        """Per stage, its waits per step for messages in transit (:mod:`~ringpipe.pipeline.stage_links`): the
        activations from the stage before it, the gradients from the one after it."""
        waits = [0.0] * self.stages
        for x in self.links:
            waits[x.down] += x.activations
            waits[x.up] += x.gradients
        return waits

    @property
    def measured_bubble(self) -> float:
        """The stages' mean idle share of the measured step less their waits for messages in transit: the idle
        time in which a stage waited for a neighbour still computing, what the schedule (and unequal stages)
        leave idle and :attr:`bubble` predicts for balanced stages."""
        if not self.measured:
            return 0.0
        waits = self.message_waits
        return statistics.fmean(max(0.0, s.idle - waits[i]) for i, s in enumerate(self.per_stage)) / self.measured

    @property
    def predicted_idle(self) -> float:
        """The stages' mean idle share that the schedule predicts with each stage's measured passes and every
        message taking what one took where its receiver waited for it
        (:func:`~ringpipe.pipeline.stage_links.message_latency`): what :attr:`measured_idle` is compared with."""
        step, busy = self.detail.get("with_messages"), self.detail.get("busy")
        return 1.0 - busy / step if step and busy is not None else self.bubble

    @property
    def bubble(self) -> float:
        """The schedule's own bubble: its idle share with balanced stages."""
        return 1.0 - self.ideal / self.balanced if self.balanced else 0.0

    @property
    def imbalance(self) -> float:
        """Share of the measured step added by unequal stages."""
        return imbalance_share(self.measured, self.predicted, self.balanced)

    @property
    def transport(self) -> float:
        """Share of the measured step the simulation does not explain."""
        return transport_share(self.measured, self.predicted)


def actions_of(schedule: str, stages: int, microbatches: int, chunks: int = 1, step_every: int = 1) -> list[list[Action]]:
    """Every stage's action list of one step of ``schedule``."""
    if schedule == "interleaved_1f1b":
        return [interleaved_1f1b(stages, microbatches, s, chunks) for s in range(stages)]
    if schedule == "async_1f1b":
        return [async_1f1b(stages, microbatches, s, step_every) for s in range(stages)]
    return [SCHEDULES[schedule](stages, microbatches, s) for s in range(stages)]


Costs = Callable[[int, Action], float]


def step_time(per_stage: Sequence[Sequence[Action]], cost: Costs, latency: float = 0.0) -> tuple[float, list[float]]:
    """(makespan, busy time per stage) of the lists under ``cost``, each message between stages taking ``latency``."""
    spans = list_schedule(per_stage, cost, latency)
    makespan = max((rank[-1][2] for rank in spans if rank), default=0.0)
    busy = [sum(cost(s, a) for a in acts) for s, acts in enumerate(per_stage)]
    return makespan, busy


def _steps(events: Sequence[Any]) -> tuple[list[list[Any]], dict[str, Any]]:
    """A rank's actions cut into steps (each ends with its ``S``), and the schedule the steps carry."""
    acts = sorted((e for e in events if e.op in _OPS), key=lambda e: e.start_ns)
    info: dict[str, Any] = {}
    steps: list[list[Any]] = [[]]
    for e in acts:
        steps[-1].append(e)
        if e.op == "pipeline.S":
            info = {k: v for k, v in e.detail.items() if k not in ("mb", "chunk")}
            steps.append([])
    return [s for s in steps if s and s[-1].op == "pipeline.S"], info


def _stage_times(done: list[list[Any]], info: dict[str, Any], spans: Sequence[float], cpu: bool) -> StageTimes:
    """``cpu``: pass times are the thread's CPU time (one intra-op thread: the work without the waits for a core)."""
    st = StageTimes(int(info.get("stage", 0)))
    body = done[1:]  # the first step warms up (allocations, first messages)
    passes: dict[tuple[str, int], list[float]] = {}
    for step in body:
        for e in step:
            passes.setdefault((_OPS[e.op], int(e.detail.get("chunk", 0))), []).append(pass_seconds(e, cpu))
    for (kind, chunk), ds in passes.items():
        if kind in ("F", "B", "W"):
            {"F": st.forward, "B": st.backward, "W": st.weight}[kind][chunk] = median_or_zero(ds)
    st.step = median_or_zero(passes.get(("S", 0), []))
    st.period = median_or_zero(list(spans))
    st.busy = median_or_zero([sum(pass_seconds(e, cpu) for e in s) for s in body])
    st.steps = len(body)
    return st


def pass_costs(per_stage: Sequence[StageTimes], scale: float = 1.0, split_w: bool = False) -> Costs:
    """Measured pass times as a cost function; ``scale`` multiplies the passes; ``split_w``: an unsplit
    backward is cut in two equal ``B`` and ``W`` (the stage's ``W`` is then half its ``B``)."""

    def cost(s: int, a: Action) -> float:
        st = per_stage[s]
        if a.kind == "S":
            return st.step
        table = {"F": st.forward, "B": st.backward, "W": st.weight}[a.kind]
        if a.kind == "W" and not st.weight:
            return scale * st.backward.get(a.chunk, 0.0) / 2
        if a.kind == "B" and split_w and not st.weight:
            return scale * table.get(a.chunk, 0.0) / 2
        return scale * table.get(a.chunk, 0.0)

    return cost


def mean_stages(per_stage: Sequence[StageTimes]) -> list[StageTimes]:
    mean = StageTimes(-1)
    for name in ("forward", "backward", "weight"):
        chunks = {c for st in per_stage for c in getattr(st, name)}
        setattr(mean, name, {c: statistics.fmean(getattr(st, name).get(c, 0.0) for st in per_stage) for c in chunks})
    mean.step = statistics.fmean(st.step for st in per_stage)
    return [mean] * len(per_stage)


def breakdown(job: JobEvents) -> PipelineBreakdown | None:
    """The step of the pipeline run in ``job`` explained (None: no pipeline events, too few steps, or an
    asynchronous run, whose stream has no step shared by the stages: :mod:`ringpipe.pipeline.stream_diagnosis`
    explains it per optimizer step).

    A step's measured time is its span over the stages: from the first action any stage starts
    for it to the last stage's step (so the loop's work between steps, data loading and
    logging, is left out and reported as ``between steps``).
    """
    ranks = [(r, *_steps(r.events)) for r in job.ranks]
    ranks = [(r, done, info) for r, done, info in ranks if info and len(done) >= 3]
    if not ranks:
        return None
    info = ranks[0][2]
    if info.get("schedule") == "async_1f1b":
        return None
    stages = int(info["stages"])
    first: dict[int, tuple[Any, list[list[Any]], dict[str, Any]]] = {}
    for entry in ranks:  # replicas of a stage: the first one seen
        first.setdefault(int(entry[2].get("stage", 0)), entry)
    if sorted(first) != list(range(stages)):
        return None
    n = min(len(first[s][1]) for s in range(stages))
    spans = [(max(first[s][1][k][-1].end_ns for s in range(stages))
              - min(first[s][1][k][0].start_ns for s in range(stages))) / 1e9 for k in range(1, n)]
    ends = [first[0][1][k][-1].end_ns for k in range(n)]
    period = median_or_zero([(b - a) / 1e9 for a, b in zip(ends, ends[1:], strict=False)])
    cpu = all(cpu_times_measure_passes(first[s][0].events) for s in range(stages))
    per_stage = [_stage_times(first[s][1][:n], first[s][2], spans, cpu) for s in range(stages)]
    schedule, m, chunks = str(info["schedule"]), int(info["microbatches"]), int(info.get("chunks") or 1)
    lists = actions_of(schedule, stages, m, chunks, int(info.get("step_every") or 1))
    mean = mean_stages(per_stage)
    balanced, busy_bal = step_time(lists, pass_costs(mean))
    predicted, busy_own = step_time(lists, pass_costs(per_stage))
    measured = median_or_zero(spans)
    bal = info.get("balance")
    body = [[first[s][1][k] for s in range(stages)] for k in range(n)]
    links = link_times(body, [first[s][0] for s in range(stages)], chunks)
    # the schedule again with each message taking what one takes where its receiver waits: the idle it predicts
    message = message_latency(body, stages, chunks)
    with_messages, _ = step_time(lists, pass_costs(per_stage), message)
    return PipelineBreakdown(schedule, stages, m, chunks, list(bal) if bal else None, per_stage, measured,
                             statistics.fmean(busy_bal), balanced, predicted,
                             {"recompute": bool(info.get("recompute")), "period": period, "cpu": cpu,
                              "message": message, "with_messages": with_messages,
                              "busy": statistics.fmean(busy_own)},
                             links, crowded_hosts(job))


# ----------------------------------------------------------------------------- what to change


def ms(seconds: float) -> str:
    """``seconds`` in milliseconds, as the findings write them."""
    return f"{1e3 * seconds:.1f} ms"


def _candidates(b: PipelineBreakdown) -> list[tuple[str, str, float, int]]:
    """(change, how to ask for it, simulated step time, messages per stage and step) for each alternative.

    The simulated time counts the passes only; :func:`_estimate` adds the time outside them."""
    out: list[tuple[str, str, float, int]] = []
    p, m = b.stages, b.microbatches
    split = b.schedule in ("zb_h1", "zb_h2")

    def at(schedule: str, m2: int, chunks: int = 1, scale: float = 1.0) -> float:
        try:
            lists = actions_of(schedule, p, m2, chunks)
        except ScheduleError:
            return float("inf")
        costs = pass_costs(b.per_stage, scale=scale * b.chunks / chunks, split_w=schedule in ("zb_h1", "zb_h2"))
        return step_time(lists, costs)[0]

    if b.chunks != 1:  # a chunk's pass is 1/chunks of a stage's: compare as whole stages
        return out
    for k in (2, 4):
        # the same batch in k times as many micro-batches, each pass k times shorter
        out.append((f"{k * m} micro-batches instead of {m}", f"--set pipeline.microbatches={k * m}",
                    at(b.schedule, k * m, scale=1 / k), k * m))
    if b.schedule != "async_1f1b" and m % p == 0:
        out.append(("interleaving with 2 chunks per rank", "--mode interleaved --set pipeline.chunks=2",
                    _interleaved(b), 2 * m))
    if not split and b.schedule in ("gpipe", "1f1b", "seq"):
        out.append(("the zero-bubble schedule zb_h1", "--mode zb_h1", at("zb_h1", m), m))
        out.append(("the zero-bubble schedule zb_h2", "--mode zb_h2", at("zb_h2", m), m))
    elif b.schedule == "zb_h1":
        out.append(("the zero-bubble schedule zb_h2", "--mode zb_h2", at("zb_h2", m), m))
    return out


def _outside_per_message(b: PipelineBreakdown) -> float:
    """The run's time outside the passes (transport and other) per message a stage sends each step."""
    return max(0.0, b.measured - b.predicted) / (b.microbatches * b.chunks)


def _estimate(b: PipelineBreakdown, simulated: float, messages: int) -> float:
    """A changed run's step time: its simulated passes plus :func:`_outside_per_message` for each message a
    stage sends each step, so that a change sending more (more micro-batches, interleaving) pays for them:
    per-message costs (latency, a pass's fixed overhead) are what make many small micro-batches slower than
    the simulation of their passes says. A change keeping the messages (a new split, a zero-bubble schedule)
    keeps the run's time outside the passes."""
    return simulated + _outside_per_message(b) * messages


def _interleaved(b: PipelineBreakdown) -> float:
    """Each rank's passes cut into 2 chunks of half the time each."""
    try:
        lists = actions_of("interleaved_1f1b", b.stages, b.microbatches, 2)
    except ScheduleError:
        return float("inf")
    half = pass_costs(b.per_stage, scale=0.5)
    return step_time(lists, lambda s, a: half(s, Action(a.kind, a.mb, 0)) if a.kind != "S" else b.per_stage[s].step)[0]


def rebalanced_stages(per_stage: Sequence[StageTimes], balance: Sequence[int] | None, chunks: int = 1,
                      steps_per_microbatch: float | None = None) -> tuple[list[int], list[StageTimes]] | None:
    """A split moving layers off the heaviest stage and each new stage's pass times (None: no balance known,
    interleaved, or the split is already that).

    Each layer is costed at its stage's mean per layer; the split is the exact
    :func:`~ringpipe.pipeline.partition.balance_by_size` of the layers' passes summed. Each new stage keeps
    the step time of the stage it replaces; with ``steps_per_microbatch`` (optimizer steps per micro-batch:
    ``1 / step_every`` in the asynchronous stream, where a stage's step weighs on its rate) the step is
    costed per layer too, moves with the layers and counts in the split at that weight.
    """
    if balance is None or chunks != 1 or len(balance) != len(per_stage):
        return None
    kinds = ("forward", "backward", "weight")
    layer_costs: list[dict[str, float]] = []
    for st, n in zip(per_stage, balance, strict=True):
        layer_costs += [{**{k: getattr(st, k).get(0, 0.0) / n for k in kinds}, "step": st.step / n}] * n
    weight = steps_per_microbatch or 0.0
    total = [sum(c[k] for k in kinds) + weight * c["step"] for c in layer_costs]
    new = balance_by_size(total, len(per_stage))
    if new == list(balance):
        return None
    stages, start = [], 0
    for s, n in enumerate(new):
        mine = layer_costs[start:start + n]
        st = StageTimes(s, step=sum(c["step"] for c in mine) if steps_per_microbatch else per_stage[s].step)
        for k in kinds:
            v = sum(c[k] for c in mine)
            if v:
                getattr(st, k)[0] = v
        stages.append(st)
        start += n
    return new, stages


def _rebalance(b: PipelineBreakdown) -> tuple[list[int], float] | None:
    """:func:`rebalanced_stages` and its predicted step time."""
    moved = rebalanced_stages(b.per_stage, b.balance, b.chunks)
    if moved is None:
        return None
    new, per_stage = moved
    lists = actions_of(b.schedule, b.stages, b.microbatches)
    return new, step_time(lists, pass_costs(per_stage))[0]


def _per_stage_text(b: PipelineBreakdown) -> str:
    rows = []
    for st in b.per_stage:
        f = sum(st.forward.values())
        bw = sum(st.backward.values())
        w = f", W {ms(sum(st.weight.values()))}" if st.weight else ""
        rows.append(f"stage {st.stage}: F {ms(f)}, B {ms(bw)}{w} per micro-batch, step {ms(st.step)}, "
                    f"busy {ms(st.busy)}, idle {ms(st.idle)} ({100 * st.idle / b.measured:.0f}%)")
    return "; ".join(rows)


def _several_hosts(b: Any) -> bool:
    """Whether ``b``'s stages are on several hosts (then its texts name them)."""
    return len({x.up_host for x in b.links} | {x.down_host for x in b.links}) > 1


def links_text(b: Any) -> str:
    """Each of ``b``'s links with its figures per step, its stages (and hosts when there are several)."""
    hosts = _several_hosts(b)
    rows = []
    for x in b.links:
        sent = f", {x.nbytes / 1e6:.2f} MB sent" if x.nbytes else ""
        rows.append(f"{x.name(hosts)}: {ms(x.total)} (activations {ms(x.activations)}, gradients "
                    f"{ms(x.gradients)}; {ms(x.message)} per message, {x.statistic}{sent})")
    return "; ".join(rows)


def _compared(s: SlowLink) -> str:
    """What a slow link was compared with, for its finding: ``4.0x the other links'``."""
    with_ = {"links": "the other links'", "apart": "those of the links that share no stage with it",
             "pass": "a typical pass of the stages"}[s.against]
    if s.ratio == float("inf"):
        return f"where {'the other links' if s.against == 'links' else 'the links that share no stage with it'}' " \
               "messages wait for nothing"
    return f"{s.ratio:.1f}x {with_}"


def _host_of(s: SlowLink, stage: int) -> str:
    return s.link.up_host if s.link.up == stage else s.link.down_host


def _slow_host(b: Any, slow: Sequence[SlowLink]) -> tuple[int, str] | None:
    """The stage (and its host) whose links to both neighbours are named slow, when its host is not theirs:
    then the common part of their paths is that host's network (None: no such host)."""
    stage = slow_stage(slow)
    if stage is None or not _several_hosts(b):
        return None
    host = _host_of(slow[0], stage)
    others = {s.link.down_host if s.link.up == stage else s.link.up_host for s in slow}
    return (stage, host) if host not in others and all(_host_of(s, stage) == host for s in slow) else None


def _evidence(b: Any, summed: str) -> str:
    return (f"a message's wait runs from when both stages were ready (the sender's pass done, the receiver free) "
            f"to the start of the receiver's pass that needs it (the schedule's simulation counts none of it); per "
            f"step: {summed}: {links_text(b)}")


def stage_link_findings(b: Any, slow: Sequence[SlowLink], crowded: str, summed: str = "") -> list[Finding]:
    """A problem for each link named slow, or one for the host whose links to both neighbours are the links named
    (:func:`~ringpipe.pipeline.stage_links.slow_stage`). A link named only against a typical pass (the one link
    of two stages, or a link with no fair link apart from it) on hosts short of cores (``crowded`` says why)
    is information only: its waits may be the receivers waiting for a core after their message arrived (a link
    within one such host is not named at all: :func:`~ringpipe.pipeline.stage_links.slow_links`). ``b``: a breakdown
    with ``links``, ``measured`` and ``per_stage``; ``summed``: how its figures per step were taken (default:
    the median over the steps of each step's sum)."""
    summed = summed or f"the median over {b.per_stage[0].steps} steps of each step's sum"
    hosts = _several_hosts(b)
    step = f"on a {ms(b.measured)} step"
    caveat = (f"; {crowded}: a receiver that waits for a core after its message arrived reads as a slow link, "
              + ("and with one link there is no other to tell them apart" if len(b.links) == 1 else
                 "and a typical pass does not tell them apart as the other links would"))
    host = _slow_host(b, slow)
    if host is not None:
        stage, name = host
        by_pass = crowded and any(s.against == "pass" for s in slow)
        each = "; ".join(f"the link between {s.link.name(hosts)}: its messages wait {ms(s.link.message)} each "
                         f"({s.link.statistic}), {_compared(s)}; {ms(s.link.total)} per step" for s in slow)
        return [Finding(
            "info" if by_pass else "problem",
            f"host {name}'s links to both neighbours are slow: {each} ({step})",
            f"both links of stage {stage} (host {name}) are slow, and the part of their paths they share is host "
            f"{name}'s network; {_evidence(b, summed)}" + (caveat if by_pass else ""),
            f"check host {name}'s network: its NIC, cable and switch port, and traffic shaping (`tc qdisc show` "
            f"there), or place stage {stage} on another host; fewer, larger micro-batches send fewer messages",
            hosts=(name,),
        )]
    out = []
    for s in slow:
        link = s.link
        alone = len(b.links) == 1
        each = f"its messages wait {ms(link.message)} each ({link.statistic})"
        if alone:
            what = (f"the link between {link.name(hosts)} is slow: {each}, {_compared(s)}; {ms(link.total)} per "
                    f"step ({step}; the only link, no other to compare with)")
        else:
            what = f"the link between {link.name(hosts)} is slow: {each}, {_compared(s)}; {ms(link.total)} per step ({step})"
        where = (f"the path between hosts {link.up_host} and {link.down_host} (NIC, cable, switch port, traffic "
                 f"shaping: `tc qdisc show` on both)" if link.up_host != link.down_host
                 else f"what else runs on host {link.up_host} (both stages are there)")
        by_pass = bool(crowded) and s.against == "pass"
        out.append(Finding(
            "info" if by_pass else "problem", what, _evidence(b, summed) + (caveat if by_pass else ""),
            f"check {where}, or place stages {link.up} and {link.down} on hosts joined by a faster link; fewer, "
            "larger micro-batches send fewer messages",
            hosts=tuple(dict.fromkeys((link.up_host, link.down_host))) if hosts else (),
        ))
    return out


def _usable_cpus(rank: Any) -> int:
    """The CPUs a rank could run on (its affinity, else the host's count; 0: not recorded)."""
    cpus = rank.info.get("cpus")
    return len(cpus) if cpus else int(rank.info.get("cpu_count") or 0)


def crowded_hosts(job: JobEvents) -> str:
    """Why the job's hosts had no core to spare ("" when they had): more of the job's ranks on a machine than
    its CPUs (hosts that are namespaces or containers of one machine share its CPUs: one boot id), or a load
    average above them. A stage whose passes computed off the CPU (:func:`~ringpipe.pipeline.action_events.
    computes_on_cpu`: a GPU's) is not counted: its passes need no core of their own."""
    machines: dict[str, list[Any]] = collections.defaultdict(list)
    for r in job.ranks:
        if not computes_on_cpu(r.events):  # its passes ran on a device: they wait for no core
            continue
        machines[str(r.info.get("machine") or f"host:{r.host}")].append(r)
    for ranks in machines.values():
        cpus = set().union(*(set(r.info.get("cpus") or ()) for r in ranks)) if all(
            r.info.get("cpus") for r in ranks) else set()
        count = len(cpus) or max(_usable_cpus(r) for r in ranks)
        if count and len(ranks) > count:
            hosts = list(dict.fromkeys(r.host for r in ranks))
            if len(hosts) == 1:
                return f"host {hosts[0]} runs {len(ranks)} of the job's ranks on {count} CPUs"
            return (f"hosts {', '.join(hosts)} are one machine (one boot id) and run {len(ranks)} of the job's ranks "
                    f"on {count} CPUs")
    for r in job.ranks:
        load, cpu_count = r.info.get("loadavg"), r.info.get("cpu_count")
        if load is not None and cpu_count and load > cpu_count:
            return f"host {r.host} ran a load average of {load:.1f} on {cpu_count} CPUs"
    return ""


def pipeline_findings(job: JobEvents) -> list[Finding]:
    """The pipeline doctor's findings for ``job`` (none when it holds no pipeline run)."""
    b = breakdown(job)
    if b is None:
        return []
    name = f"{b.schedule} on {b.stages} stages with {b.microbatches} micro-batches"
    parts = (f"the schedule's own bubble {100 * b.bubble:.1f}% (predicted for {name} from the measured pass "
             f"times, stages balanced), imbalance between stages {100 * b.imbalance:.1f}%, transport and other "
             f"{100 * b.transport:.1f}%")
    found: list[Finding] = []
    head = (f"pipeline stages idle {100 * b.measured_idle:.1f}% of the step ({ms(b.measured)} per step, "
            f"{b.per_stage[0].steps} steps)")
    between = max(0.0, b.detail.get("period", 0.0) - b.measured)
    evidence = (f"{parts}. {_per_stage_text(b)}; simulated step {ms(b.predicted)} (balanced {ms(b.balanced)}); "
                f"between steps (the loop's own work, outside the pipeline) {ms(between)}")
    if b.links:
        evidence += f"; waits on the links between stages per step: {links_text(b)}"
    largest = max(("bubble", b.bubble), ("imbalance", b.imbalance), ("transport", b.transport), key=lambda x: x[1])
    what = {"bubble": f"{head}: mostly the schedule's own bubble",
            "imbalance": f"{head}: mostly imbalance between stages",
            "transport": f"{head}: mostly time outside the passes (transport and other)"}[largest[0]]
    if largest[1] < PROBLEM_SHARE:
        what = f"{head}: no part above {100 * PROBLEM_SHARE:.0f}% of the step"
    found.append(Finding("info", what, evidence))

    if b.bubble >= PROBLEM_SHARE:
        found.append(Finding(
            "problem", f"the schedule's own bubble: {name} leaves each stage idle {100 * b.bubble:.1f}% of the step",
            f"predicted from the schedule's action lists with the measured pass times and balanced stages; "
            f"with each stage's passes and every message taking what one took where its receiver waited for it "
            f"({ms(b.detail.get('message', 0.0))}, median) the schedule predicts stages idle {100 * b.predicted_idle:.1f}% "
            f"of the step; measured: stages idle {100 * b.measured_idle:.1f}% of the step, {100 * b.measured_bubble:.1f}% of the "
            f"step waiting for a neighbour still computing (which also holds any imbalance and the delays that "
            f"messages pass on) and the rest for messages in transit; this "
            "idle time is the schedule's fill and drain, not a fault: fewer of it needs more micro-batches per "
            "batch, interleaving or a zero-bubble schedule",
            "see the recommended change below, if any ([fix])",
        ))
    # judged on the simulation (the passes alone), so that a noisy step does not hide a heavy stage
    skew = (b.predicted - b.balanced) / b.predicted if b.predicted else 0.0
    if skew >= PROBLEM_SHARE / 2:
        heavy = max(b.per_stage, key=lambda st: st.busy)
        mean_busy = statistics.fmean(st.busy for st in b.per_stage)
        fix = "give the heaviest stage fewer layers (pipeline.balance) or use pipeline.partition=time"
        rebal = _rebalance(b)
        gain = ""
        if rebal is not None:
            new, t = rebal
            split = f"pipeline.balance=[{','.join(map(str, new))}]"
            fix = f"ringpipe train --set {split} (now {b.balance})"
            t = _estimate(b, t, b.microbatches * b.chunks)
            gain = f"; predicted step {ms(t)} instead of {ms(b.measured)} ({b.measured / t:.2f}x)"
            crowded = b.crowded
            if crowded:  # the simulation gives every stage a core; here evener stages take turns on fewer
                fix = (f"once every stage has a core of its own: {fix}; not recommended now: {crowded}, and the "
                       "prediction gives each stage a core: a stage that waits less is one more process "
                       "wanting a core at once")
        found.append(Finding(
            "problem" if skew >= PROBLEM_SHARE else "info",
            f"pipeline stage {heavy.stage} is the heaviest: the others wait for it",
            f"stage {heavy.stage} is busy {ms(heavy.busy)} per step against a mean of {ms(mean_busy)}; with the "
            f"measured passes the step takes {ms(b.predicted)} against {ms(b.balanced)} with balanced stages "
            f"({100 * skew:.1f}% longer){gain}",
            fix,
        ))
    slow = named_slow_links(b)
    if b.transport >= PROBLEM_SHARE:
        found.append(Finding(
            "problem",
            "pipeline stages wait longer than their schedule explains",
            f"measured step {ms(b.measured)}, simulated from the measured passes {ms(b.predicted)}: "
            f"{ms(b.measured - b.predicted)} per step ({100 * b.transport:.1f}%) is spent in messages between "
            "stages, a stage late for other reasons (a busy CPU, data loading) or the loop's own work",
            ("see the slow link (or host) named below" if slow else
             "check the links between the stages' hosts (ringpipe doctor -n N --probe) and the CPU load; "
             "larger micro-batches send fewer, larger messages"),
        ))
    found += stage_link_findings(b, slow, b.crowded)
    if b.bubble >= PROBLEM_SHARE / 2:
        cands = sorted(((c[0], c[1], _estimate(b, c[2], c[3])) for c in _candidates(b) if c[2] > 0),
                       key=lambda c: c[2])
        if cands and b.measured / cands[0][2] >= BETTER:
            what_, how, t = cands[0]
            others = ", ".join(f"{c[0]}: {ms(c[2])}" for c in cands[1:4])
            crowded = b.crowded
            evidence = (f"simulated with the measured pass times, plus the time outside the passes per message "
                        f"({ms(_outside_per_message(b))}): step {ms(t)} "
                        f"instead of {ms(b.measured)} ({b.measured / t:.2f}x)" + (f"; others: {others}" if others else ""))
            if crowded:
                # a stage's idle time is another process's CPU time there: overlapping more wins nothing
                found.append(Finding(
                    "info", f"once every stage has a core of its own: {what_} would shrink the schedule's bubble",
                    f"{evidence}; not recommended now: {crowded}, so the time a stage waits is spent by other "
                    "processes and a shorter bubble does not shorten the step",
                    f"ringpipe train {how}",
                ))
            else:
                found.append(Finding("fix", f"use {what_} to shrink the schedule's bubble", evidence,
                                     f"ringpipe train {how}"))
    return found


def named_slow_links(b: Any) -> list[SlowLink]:
    """The links of ``b`` (a synchronous or asynchronous breakdown) named slow: compared with each other and with
    a typical pass of its stages, on hosts short of cores or not (:func:`~ringpipe.pipeline.stage_links.slow_links`);
    the findings and the JSON both read them."""
    passes = [v for st in b.per_stage for kind in (st.forward, st.backward) for v in kind.values()]
    return slow_links(b.links, b.measured, median_or_zero(passes), crowded=bool(b.crowded))


def link_figures(b: Any) -> list[dict[str, Any]]:
    """``b``'s links as JSON-ready figures (seconds per step, bytes per step), each marked ``slow`` when
    :func:`~ringpipe.pipeline.stage_links.slow_links` names it."""
    slow = {(s.link.up, s.link.down) for s in named_slow_links(b)}
    return [{"up": x.up, "down": x.down, "up_host": x.up_host, "down_host": x.down_host,
             "activations_s": x.activations, "gradients_s": x.gradients, "total_s": x.total,
             "message_s": x.message, "bytes": x.nbytes, "slow": (x.up, x.down) in slow} for x in b.links]


def slow_host_figures(b: Any) -> list[dict[str, Any]]:
    """The host whose links to both neighbours are named slow, as JSON (``[]``: none): its ``host`` and ``stage``,
    named in one finding instead of its two links."""
    host = _slow_host(b, named_slow_links(b))
    return [] if host is None else [{"host": host[1], "stage": host[0]}]


def stage_figures(st: StageTimes) -> dict[str, Any]:
    """One stage's figures: pass times per micro-batch (summed over chunks), step, busy and idle, seconds."""
    return {"stage": st.stage, "forward_s": sum(st.forward.values(), 0.0), "backward_s": sum(st.backward.values(), 0.0),
            "weight_s": sum(st.weight.values(), 0.0), "step_s": st.step, "busy_s": st.busy, "idle_s": st.idle}


def pipeline_figures(job: JobEvents) -> dict[str, Any] | None:
    """The breakdown of a synchronous pipeline run as ``ringpipe doctor --json`` gives it (None: not one)."""
    b = breakdown(job)
    if b is None:
        return None
    return {"schedule": b.schedule, "stages": b.stages, "microbatches": b.microbatches, "chunks": b.chunks,
            "balance": b.balance, "steps": b.per_stage[0].steps, "per": "step", "measured_s": b.measured,
            "predicted_s": b.predicted, "balanced_s": b.balanced,
            "between_steps_s": max(0.0, b.detail.get("period", 0.0) - b.measured), "cpu_times": b.detail.get("cpu"),
            "shares": {"bubble": b.bubble, "imbalance": b.imbalance, "transport": b.transport,
                       "idle": b.measured_idle, "measured_bubble": b.measured_bubble,
                       "predicted_idle": b.predicted_idle},
            "per_stage": [stage_figures(st) for st in b.per_stage], "links": link_figures(b),
            "slow_hosts": slow_host_figures(b)}


register_analyzer(pipeline_findings)
register_figures("pipeline", pipeline_figures)
