"""How often the pipeline doctor names the right cause, and whether the change it recommends is faster.

    python benchmarks/pipeline_doctor.py --trials 10          # 2, 3 and 4 stages, every case
    python benchmarks/pipeline_doctor.py --trials 10 --cases link   # only the link cases (root)
    python benchmarks/pipeline_doctor.py --trials 5 --cases link,host --stages 3,4   # and a slow host (root)
    python benchmarks/pipeline_doctor.py --trials 10 --schedule async --stages 2,3 --cases schedule,link,host
    python benchmarks/pipeline_doctor.py --quick              # seconds: 2 stages, 1 trial, no link cases
    python benchmarks/pipeline_doctor.py --trials 10 --cases schedule --width 64 --batch 1024 --hold 20
                                                              # stages on a device each (below)

Each trial trains an MLP of equal blocks (``--width``, 2 blocks per stage and a small head on the
last, batches of 128) with ``PipelineTrainer``
on real gloo ranks, the stages' passes recorded (:mod:`ringpipe.pipeline.action_events`) and read by
:func:`ringpipe.pipeline.diagnosis.pipeline_findings`, in three cases:

- ``balanced``: 1F1B, ``m = 2 p`` micro-batches, the blocks split evenly; expected: a finding
  names the schedule's own bubble, the predicted bubble is within 5 points of the paper's
  ``(p - 1) / (m + p - 1)``, and no imbalance is named. Issue 35's check has columns of its own:
  the idle share the schedule predicts with the measured passes and every message taking what one
  took where its receiver waited (``PipelineBreakdown.predicted_idle``) against the measured idle
  share, and the measured idle spent waiting for a neighbour still computing (the idle less the
  waits for messages in transit).
- ``heavy``: stage 1 gets twice the blocks of the others; expected: imbalance named for stage 1,
  a ``pipeline.balance`` recommended.
- ``few``: ``m = p / 2`` (at least 1) micro-batches; expected: more micro-batches or interleaving
  recommended.

The link cases (``--cases link``; need root for network namespaces, ``tests/netns.py``) put each
stage on a host of its own (namespaces joined by a bridge) under ``ringpipe launch --nnodes p``,
and run ``tests/scripts/pipeline_link.py`` (1F1B, blocks of width 1024, batches of 192 in 6
micro-batches: 128 KiB per message), ``--trials`` trials in one launch:

- ``shaped link``: only the path between two neighbour stages' hosts is shaped with ``tc tbf``
  (``--link-rate``, both ways): stages 0 and 1 for 2 stages, 1 and 2 for 3 and 4 (the middle
  link of 4 stages, whose hosts each have another link); expected: that link named, and no
  other link (another named, as a problem or as information: a false accusation). The one link
  of 2 stages is named as information only on hosts short of cores (counted as named, and said);
- ``fair network``: the same hosts unshaped; any link or host named (a problem or information) is
  a false accusation.

The host case (``--cases host``, 3 and 4 stages, root) shapes host b's network (``--link-rate``,
its NIC's egress and the switch port's towards it, ``bridged_hosts(rates=...)``): both links of
stage 1 slow. Expected: one finding naming host b's links to both neighbours, and no link finding
(a link named, or another host: a false accusation; host b named as information on hosts short of
cores counts as named, and is said).

Every case also counts a link named where none is shaped (the one-host cases above) as a false
accusation.

``--schedule async`` runs the asynchronous pipeline instead (``async_1f1b``, ``ringpipe train --mode
async``: each trial's batches fed as one stream with ``stream_step`` and drained at its end, an
optimizer step per micro-batch) and its doctor (:mod:`ringpipe.pipeline.stream_diagnosis`), which
explains the **period**, the time per optimizer step of a stage, instead of a step's bubble:

- ``balanced``: the blocks split evenly, ``m = 2 p`` micro-batches per batch; expected: no stage
  named the heaviest as a problem (a false accusation; as information, said in its own column).
- ``heavy``: stage 1 twice the blocks; expected: stage 1 named the heaviest (a problem), counted, and a
  ``pipeline.balance`` named, counted on its own: recommended, or on hosts short of cores mentioned
  (the doctor names a split only when it predicts it 1.1 times faster, the run's time outside the
  passes kept); another stage named the heaviest is a false accusation. The split named is trained
  (the same schedule) and its measured period compared with the trial's (the speed-up; how many
  trials were faster); the split the doctor computes but does not name (predicted under 1.1x faster:
  it is in the finding's evidence) is trained too, so that the doctor's restraint is measured: the
  speed-up of every split computed, and apart of those named.
- ``few`` has no counterpart: the stream has no bubble but its fill and drain, which the number of
  micro-batches per batch does not change.

The link and host cases run ``pipeline_link.py --schedule async`` (the trials' batches one stream
each) and are scored as above, with the asynchronous doctor's findings.

``--hold US`` makes every block hold its stage US microseconds per sample of the micro-batch in its
forward, as long again in its input gradient (``B``) and in its weight gradient (``W``), asleep and off
the CPU (:class:`HeldBlock`), as a GPU's kernels hold a stage while its CPU is free; with a small
``--width`` the hold is nearly all of each pass. Stages then need no core of their own, so 3 and 4
stages run on the 2-core machine as they would on a GPU (or a core) each, and the doctor, which sees
their passes compute off the CPU (``action_events.computes_on_cpu``), recommends (and the script
verifies) what it would on such a machine.

A recommended change (a ``fix``: on a host whose load exceeds its CPUs the bubble changes are only
mentioned, as they cannot help there) is then run (the verification) and its median step time
compared with the trial's. A false accusation: an imbalance named in ``balanced`` or ``few``, or a
link named in any of the three. Steps are timed as the
doctor does (a step's span over the stages, the first step left out). The machine's other load
changes the step times (a 2-core machine with other jobs: see the load line); counts of named
causes are what the table claims.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import report, testhelpers  # noqa: E402

from ringpipe.comm.events import EventLog  # noqa: E402
from ringpipe.launch import spawn  # noqa: E402
from ringpipe.observe.collect import collect_events, load_events, save_events  # noqa: E402
from ringpipe.pipeline import PipelineTrainer  # noqa: E402
from ringpipe.pipeline.action_events import record_actions  # noqa: E402
from ringpipe.pipeline.diagnosis import breakdown, pipeline_findings  # noqa: E402
from ringpipe.pipeline.stream_diagnosis import stream_breakdown, stream_findings  # noqa: E402

LINK = "the link between"
HOST = "'s links to both neighbours are slow"
#: Each schedule's doctor: (its breakdown, its findings), both of a job's events.
DOCTORS = {"1f1b": (breakdown, pipeline_findings), "async": (stream_breakdown, stream_findings)}


class _HoldInBackward(torch.autograd.Function):
    """The identity, whose backward holds the calling thread ``seconds`` (asleep, off the CPU)."""

    @staticmethod
    def forward(ctx, t, seconds):
        ctx.seconds = seconds
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class HeldBlock(nn.Module):
    """A linear layer and a ReLU that also hold their stage, asleep and off the CPU, for ``hold`` seconds per
    sample of the micro-batch in forward, as long again for the input's gradient (``B``) and as long again
    for the weight's (``W``): a block whose passes run on a device, as a GPU's kernels do, while the CPU is
    free, with the zero-bubble papers' equal ``F``, ``B`` and ``W``."""

    def __init__(self, width: int, hold: float):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.hold = hold

    def forward(self, x):
        seconds = self.hold * x.shape[0]
        time.sleep(seconds)
        x = _HoldInBackward.apply(x, seconds)  # on the input gradient's path only
        weight = _HoldInBackward.apply(self.linear.weight, seconds)  # on the weight gradient's path only
        return nn.functional.relu(nn.functional.linear(x, weight, self.linear.bias))


def blocks(n: int, width: int, hold: float = 0.0) -> nn.Sequential:
    """``n`` blocks (a linear layer and a ReLU) and a small head; ``hold``: each block also holds its stage
    that many seconds per sample and pass off the CPU (:class:`HeldBlock`)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n):
        layers.append(HeldBlock(width, hold) if hold else nn.Sequential(nn.Linear(width, width), nn.ReLU()))
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def recorded_trainer(comm, m: int, balance: list[int], schedule: str, width: int, batch: int, chunks=None,
                     hold: float = 0.0):
    """A trainer of :func:`blocks` (the last layer the small head: its stage has one layer more) with its actions
    recorded into a fresh event log, and one batch ``(x, y)``: ``(trainer, log, x, y)``."""
    log = EventLog()
    t = PipelineTrainer(comm, blocks(sum(balance) - 1, width, hold), balance=balance, schedule=schedule, microbatches=m,
                        chunks=chunks, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.01),
                        loss_fn=nn.functional.cross_entropy)
    record_actions(log, t.runtimes, t.executor, schedule=t.schedule, stage=t.stage, stages=t.num_stages,
                   microbatches=m, chunks=t.chunks, balance=list(t.balance), recompute=False, step_every=1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return t, log, x, y


def train_once(comm, p: int, m: int, balance: list[int], schedule: str, width: int, steps: int, chunks=None,
               batch: int = 128, save: str | None = None, hold: float = 0.0):
    if schedule == "async_1f1b":
        return train_stream_once(comm, m, balance, width, steps, batch, save, hold)
    t, log, x, y = recorded_trainer(comm, m, balance, schedule, width, batch, chunks, hold)
    for _ in range(steps):
        t.train_step(x if t.is_first else None, y if t.is_last else None)
    job = collect_events(comm, log)
    if job is None:
        return None
    b = breakdown(job)
    found = pipeline_findings(job)
    return {"measured": b.measured if b else None, "bubble": b.bubble if b else None,
            "idle": b.measured_idle if b else None, "measured_bubble": b.measured_bubble if b else None,
            "predicted_idle": b.predicted_idle if b else None,
            "findings": [(f.severity, f.what, f.evidence, f.fix) for f in found]}


def train_stream_once(comm, m: int, balance: list[int], width: int, steps: int, batch: int = 128,
                      save: str | None = None, hold: float = 0.0):
    """As :func:`train_once` for the asynchronous pipeline: ``steps`` batches of ``m`` micro-batches fed as one
    stream (an optimizer step per micro-batch) and drained, read by the asynchronous doctor; ``measured``: its
    period per optimizer step; ``save``: a path to keep the run's events at (``ringpipe doctor --json``)."""
    t, log, x, y = recorded_trainer(comm, m, balance, "async_1f1b", width, batch, hold=hold)
    for _ in range(steps):
        t.stream_step(x if t.is_first else None, y if t.is_last else None)
    t.drain()
    job = collect_events(comm, log)
    if job is None:
        return None
    if save:
        save_events(save, job)
    b = stream_breakdown(job)
    return {"measured": b.measured if b else None, "imbalance": b.imbalance if b else None,
            "transport": b.transport if b else None, "fill_drain": b.fill_drain if b else None,
            "idle": b.measured_idle if b else None,
            "findings": [(f.severity, f.what, f.evidence, f.fix) for f in stream_findings(job)]}


def apply(fix: str, p: int, m: int, balance: list[int], schedule: str = "1f1b") -> dict | None:
    """The recommended change as trainer arguments (None: nothing this script can run); ``schedule``: the
    trial's (a new split keeps it)."""
    got = re.search(r"pipeline\.balance=\[([0-9, ]+)\]", fix)
    if got:
        return {"m": m, "balance": [int(v) for v in got.group(1).split(",")], "schedule": schedule}
    got = re.search(r"pipeline\.microbatches=(\d+)", fix)
    if got:
        return {"m": int(got.group(1)), "balance": balance, "schedule": "1f1b"}
    if "--mode interleaved" in fix:
        n = sum(balance)
        parts = 2 * p
        return {"m": m, "balance": [n // parts + (1 if i < n % parts else 0) for i in range(parts)],
                "schedule": "interleaved_1f1b", "chunks": 2}
    got = re.search(r"--mode (zb_h1|zb_h2)", fix)
    if got:
        return {"m": m, "balance": balance, "schedule": got.group(1)}
    return None


def change_kind(change: dict, m: int) -> str:
    """What a recommended change is, in a word or two (the table counts them)."""
    if change.get("chunks"):
        return "interleaving"
    if change["schedule"] not in ("1f1b", "async_1f1b"):
        return change["schedule"]
    if change["m"] != m:
        return f"m={change['m']}"
    return f"split {change['balance']}"


def worker(comm, cases, trials: int, width: int, steps: int, batch: int = 128, schedule: str = "1f1b",
           events: str | None = None, hold: float = 0.0):
    """Every trial of every case on this rank (``schedule``: ``1f1b`` or ``async_1f1b``); the asynchronous
    doctor's split is trained also where it is only mentioned (hosts short of cores) or only in the heaviest
    stage's evidence (predicted under 1.1x faster: not named), so that its restraint is measured too;
    ``events``: a folder to keep the asynchronous trials' events in."""
    p = comm.size
    out = []
    for trial in range(trials):
        for case, m, balance in cases:
            save = str(Path(events) / f"async-{p}-{case}-{trial}.json") if events and comm.rank == 0 else None
            res = train_once(comm, p, m, balance, schedule, width, steps, batch=batch, save=save, hold=hold)
            verify = None
            if res is not None:
                fix = next((f[3] for f in res["findings"] if f[0] == "fix" or (
                    "pipeline.balance=" in f[3] and (schedule == "async_1f1b" or
                                                     not f[3].startswith("once every stage")))), "")
                if schedule == "async_1f1b" and not fix:  # the split the evidence predicts, not named
                    fix = next((f[2] for f in res["findings"] if "is the heaviest" in f[1]), "")
                change = apply(fix, p, m, balance, schedule)
            else:
                change = None
            change = comm.allgather_object(change)[0]
            if change is not None:
                v = train_once(comm, p, change["m"], change["balance"], change["schedule"], width, steps,
                               change.get("chunks"), batch, hold=hold)
                verify = v["measured"] if v else None
            if res is not None:
                out.append({"trial": trial, "case": case, "m": m, "balance": balance, **res, "verify": verify,
                            "change": change})
    return out


def score(row: dict, p: int) -> tuple[bool, bool, bool]:
    """(the expected cause named, a false accusation, of which a link named)."""
    whats = [f[1] for f in row["findings"]]
    fixes = [f for f in row["findings"] if f[0] == "fix" or f[1].startswith("once every stage has a core")]
    imbalance = any("heaviest" in w for w, f in zip(whats, row["findings"], strict=True) if f[0] == "problem")
    link = any(w.startswith(LINK) or HOST in w for w in whats)  # no link is shaped in these cases
    if row["case"] == "balanced":
        paper = (p - 1) / (row["m"] + p - 1)
        named = any(w.startswith("the schedule's own bubble") for w in whats) and abs(row["bubble"] - paper) <= 0.05
        return named, imbalance or link, link
    if row["case"] == "heavy":
        return imbalance and any("pipeline.balance=" in f[3] for f in row["findings"]), link, link
    return any("micro-batches" in f[1] or "interleaving" in f[1] for f in fixes), imbalance or link, link


def score_async(row: dict) -> tuple[bool, bool, bool, bool, str]:
    """The asynchronous cases: (the expected cause named, a false accusation, of which a link or host named,
    the heaviest stage named as information only, the split: ``"recommended"``, ``"mentioned"`` (hosts short of
    cores) or ``""``). ``balanced``: nothing to name (named: no stage named the heaviest as a problem); ``heavy``:
    stage 1 named the heaviest, a problem."""
    found = row["findings"]
    link = any(f[1].startswith(LINK) or HOST in f[1] for f in found)
    heaviest = [f for f in found if "is the heaviest" in f[1]]
    problem = [f for f in heaviest if f[0] == "problem"]
    info = bool(heaviest) and not problem
    fix = next((f[3] for f in heaviest if "pipeline.balance=" in f[3]), "")
    split = "" if not fix else "mentioned" if fix.startswith("once every stage") else "recommended"
    if row["case"] == "balanced":
        return not problem, bool(problem) or link, link, info, split
    right = [f for f in problem if f[1].startswith("pipeline stage 1 is the heaviest")]
    wrong = [f for f in heaviest if not f[1].startswith("pipeline stage 1 ")]
    return bool(right), bool(wrong) or link, link, info, split


def shaped_pair(p: int) -> tuple[int, int]:
    """The stages whose link the shaped case slows: 0-1 of 2 stages, else 1-2."""
    return (0, 1) if p == 2 else (1, 2)


def link_trials(p: int, trials: int, case: str, rate: str, port: int, steps: int, schedule: str = "1f1b",
                events: str | None = None) -> list[dict]:
    """``trials`` runs of ``pipeline_link.py`` on ``p`` namespace hosts (one stage each) in one launch, each
    scored: ``case`` ``link`` shapes the path between :func:`shaped_pair`'s hosts to ``rate``, ``host`` host b's
    network (both links of stage 1), ``fair`` nothing; ``schedule``: ``1f1b`` or ``async`` (:data:`DOCTORS`);
    ``events``: a folder to keep each trial's events in (for ``ringpipe doctor --json``)."""
    breakdown_of, findings_of = DOCTORS[schedule]
    netns = testhelpers.module("netns")
    script = str(testhelpers.path("scripts/pipeline_link.py"))
    pair = shaped_pair(p)
    shape = {"link": {"pair_rates": {pair: rate}}, "host": {"rates": {1: rate}}, "fair": {}}[case]
    slow_pairs = {"link": [pair], "host": [(0, 1), (1, 2)], "fair": []}[case]
    with tempfile.TemporaryDirectory() as tmp, netns.bridged_hosts(p, **shape) as hosts:
        out = str(Path(tmp) / "events")
        done = netns.launch_across(hosts, (1,) * p, [script, out, "--trials", str(trials), "--steps", str(steps),
                                                     "--schedule", schedule], port, netns.job_env(), timeout=600)
        for o in done:
            if o.returncode != 0:
                raise RuntimeError(f"a launcher failed: {o.stderr[-3000:]}")
        rows = []
        for t in range(trials):
            job = load_events(f"{out}.{t}.json")
            if events:
                Path(events).mkdir(parents=True, exist_ok=True)
                shutil.copy(f"{out}.{t}.json", Path(events) / f"{schedule}-{p}-{case}-{t}.json")
            b = breakdown_of(job)
            # a link or a host named, as a problem or as information
            named = [f for f in findings_of(job) if f.what.startswith(LINK) or HOST in f.what]
            if case == "link":
                right = [f for f in named if f.what.startswith(
                    f"{LINK} stage {pair[0]} (host {hosts[pair[0]].hostname}) and stage {pair[1]} "
                    f"(host {hosts[pair[1]].hostname})")]
            elif case == "host":
                right = [f for f in named if f.what.startswith(f"host {hosts[1].hostname}{HOST}")]
            else:
                right = []
            links = {(x.up, x.down): x for x in b.links} if b else {}
            passes = [v for st in b.per_stage for kind in (st.forward, st.backward) for v in kind.values()] if b else []
            rows.append({"named": len(right) == 1, "false": len(named) - len(right),
                         "as_info": len(right) == 1 and right[0].severity == "info",
                         "cost": [links[k].total for k in slow_pairs if k in links],
                         "message": [links[k].message for k in slow_pairs if k in links],
                         "others": [x.message for k, x in links.items() if k not in slow_pairs],
                         "all": [x.message for x in links.values()],
                         "pass": statistics.median(passes) if passes else None,
                         "measured": b.measured if b else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=128,
                    help="samples per batch of the one-host cases (larger: passes long beside a message's cost)")
    ap.add_argument("--cases", default="schedule,link",
                    help="schedule: balanced, heavy, few (one host); link: a shaped link and a fair network; "
                         "host: host b's network shaped (3 or more stages) and a fair network (namespace hosts, root)")
    ap.add_argument("--schedule-cases", help="of the one-host cases only these (comma-separated: balanced, heavy, few)")
    ap.add_argument("--link-rate", default="20mbit", help="the shaped link's or host's rate (tc tbf)")
    ap.add_argument("--link-steps", type=int, default=8)
    ap.add_argument("--schedule", choices=("1f1b", "async"), default="1f1b",
                    help="1f1b, or the asynchronous pipeline (async_1f1b, one stream per trial) and its doctor "
                         "(cases balanced and heavy; link and host as for 1f1b)")
    ap.add_argument("--events", help="a folder to keep every asynchronous or namespace-host trial's events in")
    ap.add_argument("--hold", type=float, default=0.0, metavar="US",
                    help="each block also holds its stage US microseconds per sample in forward, B and W each "
                         "asleep, off the CPU, as a device's kernels do: stages that need no core of their own, so "
                         "that 3 and 4 stages run as on a core (or GPU) each on a machine of fewer CPUs; with a small "
                         "--width the hold is nearly all of a pass")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    hold = args.hold / 1e6
    stage_counts = [2] if args.quick else [int(s) for s in args.stages.split(",")]
    trials = 1 if args.quick else args.trials
    steps = 6 if args.quick else args.steps
    cases = {"schedule"} if args.quick else set(args.cases.split(","))
    only = set(args.schedule_cases.split(",")) if args.schedule_cases else None
    report.header("pipeline_doctor")
    if "schedule" in cases and args.schedule == "1f1b":
        schedule_table(stage_counts, trials, args.width, steps, args.batch, only, hold)
    if "schedule" in cases and (args.schedule == "async" or args.quick):
        stream_table(stage_counts, trials, args.width, steps, args.batch, only, args.events, hold)
    if cases & {"link", "host"}:
        reason = testhelpers.module("netns").can_create()
        if reason:
            print(f"link cases skipped: {reason}")
        else:
            link_table(stage_counts, trials, args.link_rate, args.link_steps, sorted(cases & {"link", "host"}),
                       args.schedule, args.events)
    report.footer()


def link_table(stage_counts: list[int], trials: int, rate: str, steps: int, kinds: list[str],
               schedule: str = "1f1b", events: str | None = None) -> None:
    rows = []
    for i, p in enumerate(stage_counts):
        pair = shaped_pair(p)
        cases = [(f"shaped link {pair[0]}-{pair[1]} ({rate})", "link")] if "link" in kinds else []
        if "host" in kinds and p >= 3:
            cases.append((f"host b's network shaped ({rate})", "host"))
        cases.append(("fair network", "fair"))
        for j, (case, kind) in enumerate(cases):
            got = link_trials(p, trials, kind, rate, 29700 + 8 * i + 2 * j, steps, schedule, events)
            cost = [c for g in got for c in g["cost"]]
            message = [m for g in got for m in g["message"]]
            others = [statistics.median(g["others"]) for g in got if g["others"]]
            # as the doctor compares: with the other links' median message wait; the one link of 2 stages, a pass
            ratio = [m / (statistics.median(g["others"]) if g["others"] else g["pass"])
                     for g in got for m in g["message"] if g["others"] or g["pass"]]
            to_pass = [m / g["pass"] for g in got if g["pass"] for m in g["all"]]
            info = sum(g["as_info"] for g in got)
            named = f"{sum(g['named'] for g in got)}" + (f" ({info} as information)" if info else "")
            rows.append([p, case, len(got), named if kind != "fair" else "-", sum(g["false"] for g in got),
                         f"{1e3 * statistics.median(cost):.1f}" if cost else "-",
                         f"{1e3 * statistics.median(message):.2f}" if message else "-",
                         f"{1e3 * statistics.median(others):.2f}" if others else "-",
                         f"{statistics.median(ratio):.1f}x ({min(ratio):.1f}-{max(ratio):.1f})" if ratio else "-",
                         f"{statistics.median(to_pass):.1f}x ({min(to_pass):.1f}-{max(to_pass):.1f})" if to_pass else "-",
                         f"{1e3 * statistics.median(g['measured'] for g in got if g['measured']):.1f}"])
            print(f"  {p} stages, {case}: {rows[-1]}", flush=True)
    print(f"schedule {schedule}" + (" (step: the period per optimizer step)" if schedule == "async" else ""))
    print(report.table(["stages", "case", "trials", "named", "false accusations",
                        "slow links: waits ms/step", "their message wait ms", "other links' message wait ms",
                        "ratio (to the other links; 2 stages: to a pass), median (range)",
                        "every link's message wait / a typical pass, median (range)", "step ms"], rows,
                       [True, False, True, True, True, True, True, True, False, False, True]))
    print("medians over the trials; a message wait is the doctor's " + ("mean (the longest tenth left out)" if schedule == "async" else "median")
          + " wait of one message of the link; slow links: the shaped pair's link, or both links of host b's stage 1")


def schedule_table(stage_counts: list[int], trials: int, width: int, steps: int, batch: int = 128,
                   only: set[str] | None = None, hold: float = 0.0) -> None:
    rows = []
    for p in stage_counts:
        even = [2] * (p - 1) + [3]  # 2 blocks per stage, the last also the head
        heavy = list(even)
        heavy[1] += 2
        cases = [("balanced", 2 * p, even), ("heavy", 2 * p, heavy), ("few", max(1, p // 2), even)]
        cases = [c for c in cases if only is None or c[0] in only]
        got = spawn(worker, p, args=(cases, trials, width, steps, batch, "1f1b", None, hold),
                    env={"OMP_NUM_THREADS": "1"})[0]
        for case, m, _ in cases:
            mine = [r for r in got if r["case"] == case]
            scores = [score(r, p) for r in mine]
            faster = [r for r in mine if r["verify"] is not None and r["measured"]]
            ratio = [r["measured"] / r["verify"] for r in faster]
            paper = (p - 1) / (m + p - 1)
            rows.append([p, case, m, len(mine), sum(s[0] for s in scores),
                         f"{sum(s[1] for s in scores)} ({sum(s[2] for s in scores)} links)",
                         f"{100 * statistics.median(r['bubble'] for r in mine):.1f}%",
                         f"{100 * paper:.1f}%",
                         f"{100 * statistics.median(r['idle'] for r in mine):.1f}%",
                         f"{100 * statistics.median(r['predicted_idle'] for r in mine):.1f}%",
                         f"{sum(abs(r['idle'] - r['predicted_idle']) <= 0.05 for r in mine)}/{len(mine)}",
                         f"{100 * statistics.median(r['measured_bubble'] for r in mine):.1f}%",
                         f"{1e3 * statistics.median(r['measured'] for r in mine):.1f}",
                         f"{statistics.median(ratio):.2f}x ({sum(x > 1 for x in ratio)}/{len(ratio)} faster)"
                         if ratio else "-",
                         ", ".join(f"{k} {v}" for k, v in sorted(collections.Counter(
                             change_kind(r["change"], m) for r in mine if r["change"]).items())) or "-"])
    print(report.table(["stages", "case", "m", "trials", "cause named", "false accusations (of which links named)",
                        "predicted bubble (median)", "paper (p-1)/(m+p-1)", "measured idle (median)",
                        "predicted idle, passes and messages (median)",
                        "measured idle within 5 points of the predicted idle",
                        "idle waiting for a computing neighbour (median)",
                        "step ms (median)", "recommended change, verified (speed-up)", "changes run (trials)"], rows,
                       [True, False, True, True, True, True, True, True, True, True, True, True, True, False, False]))



def stream_table(stage_counts: list[int], trials: int, width: int, steps: int, batch: int = 128,
                 only: set[str] | None = None, events: str | None = None, hold: float = 0.0) -> None:
    """The asynchronous cases (``balanced``, ``heavy``) on one host: ``steps`` batches of ``m = 2 p`` micro-batches
    per trial, one stream."""
    rows = []
    for p in stage_counts:
        even = [2] * (p - 1) + [3]
        heavy = list(even)
        heavy[1] += 2
        cases = [c for c in (("balanced", 2 * p, even), ("heavy", 2 * p, heavy)) if only is None or c[0] in only]
        if not cases:
            continue
        if events:
            Path(events).mkdir(parents=True, exist_ok=True)
        got = spawn(worker, p, args=(cases, trials, width, steps, batch, "async_1f1b", events, hold),
                    env={"OMP_NUM_THREADS": "1"})[0]
        for case, m, balance in cases:
            mine = [r for r in got if r["case"] == case and r["measured"]]
            scores = [score_async(r) for r in mine]
            ratio = [r["measured"] / r["verify"] for r in mine if r["verify"]]
            named = [r["measured"] / r["verify"] for r, s in zip(mine, scores, strict=True) if r["verify"] and s[4]]
            splits = collections.Counter(s[4] for s in scores if s[4])
            rows.append([p, case, str(balance), m, len(mine),
                         sum(s[0] for s in scores) if case == "heavy" else "-",
                         ", ".join(f"{v} {k}" for k, v in sorted(splits.items())) or "0",
                         f"{sum(s[1] for s in scores)} ({sum(s[2] for s in scores)} links)",
                         sum(s[3] for s in scores),
                         f"{100 * statistics.median(r['imbalance'] for r in mine):.1f}%",
                         f"{100 * statistics.median(r['transport'] for r in mine):.1f}%",
                         f"{100 * statistics.median(r['fill_drain'] for r in mine):.1f}%",
                         f"{1e3 * statistics.median(r['measured'] for r in mine):.2f}",
                         f"{statistics.median(ratio):.2f}x ({sum(x > 1 for x in ratio)}/{len(ratio)} faster)"
                         if ratio else "-",
                         f"{statistics.median(named):.2f}x ({sum(x > 1 for x in named)}/{len(named)} faster)"
                         if named else "-",
                         ", ".join(f"{k} {v}" for k, v in sorted(collections.Counter(
                             change_kind(r["change"], m) for r in mine if r["change"]).items())) or "-"])
            print(f"  async, {p} stages, {case}: {rows[-1]}", flush=True)
    print("schedule async_1f1b (one stream per trial; the period: time per optimizer step of a stage)")
    print(report.table(["stages", "case", "balance", "m", "trials", "heaviest named (stage 1, a problem)",
                        "a split named (recommended, or mentioned: hosts short of cores)",
                        "false accusations (of which links named)", "a heaviest stage as information",
                        "imbalance share (median)", "transport and other (median)", "fill and drain (median)",
                        "period ms (median)", "the split computed (named or in the evidence), trained: speed-up of the "
                        "period (median)", "of it the splits named", "splits trained (trials)"], rows,
                       [True, False, False, True, True, True, False, True, True, True, True, True, True, False, False,
                        False]))


if __name__ == "__main__":
    main()
