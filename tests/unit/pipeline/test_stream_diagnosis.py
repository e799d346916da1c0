"""The asynchronous pipeline's doctor on synthetic runs: the period set by the heaviest stage, a better split, honesty.

The events are made here as ``ringpipe train --mode async`` records them: every stage runs its windows of
the asynchronous 1F1B stream (:func:`~ringpipe.pipeline.schedules.async_1f1b_window`, one per batch,
then the drain), an action starting when the stage is free and its inputs are there (the forward of the
previous stage, the backward of the next one, each message taking ``latency`` plus ``links[s]`` ms on the
link between stages ``s`` and ``s + 1``), and each stage doing ``gap`` ms of the loop's own work
before each window; ``contention[s]``: the factor by which 3 in every 5 of stage ``s``'s passes are slowed,
their CPU time too (another process sharing the core's caches and memory). Micro-batch numbers start again at 0 after each drain.

The oracle is the steady state of a stream written plainly: with no message delay every stage steps at
the rate of the slowest, ``max over stages of (step_every x (F + B) + S)`` per optimizer step; a stage's
busy time per step is its own ``step_every x (F + B) + S`` and the rest it waits; the best split of the
layers (each costed at its stage's mean per optimizer step, passes and step) is found by trying every
contiguous split, and its period is its largest part.
"""

import argparse
import itertools
import json

import pytest

from ringpipe.comm.events import Event
from ringpipe.observe.collect import JobEvents, RankEvents, save_events
from ringpipe.observe.commands import doctor_main
from ringpipe.observe.doctor import diagnose, format_report
from ringpipe.pipeline.diagnosis import breakdown, pipeline_findings
from ringpipe.pipeline.schedules import async_1f1b_window
from ringpipe.pipeline.stream_diagnosis import stream_breakdown, stream_findings

MS = 1_000_000  # ns
STEP = 0.1  # ms, every optimizer step


def stream_events(p, m, forward, backward, *, batches=8, streams=1, step_every=1, latency=0.0, links=None, gap=0.0,
                  balance=None, hosts=None, contention=None, cpu_share=1.0):
    """Every stage's events of ``streams`` streams of ``batches`` batches of ``m`` micro-batches each; ``cpu_share``:
    the share of each action the calling thread spent on a CPU (the rest on a device)."""
    extra = links or {}
    info = {"schedule": "async_1f1b", "stages": p, "microbatches": m, "chunks": 1, "balance": balance or [2] * p,
            "recompute": False, "step_every": step_every, "threads": 1}
    lists = []
    for s in range(p):
        acts = []
        for st in range(streams):
            for b in range(batches):
                acts += [(a, st, b) for a in async_1f1b_window(p, s, b * m, (b + 1) * m, step_every)]
            total = batches * m
            acts += [(a, st, batches) for a in async_1f1b_window(p, s, total, total, step_every, total=total)]
        lists.append(acts)
    events = [[] for _ in range(p)]
    done, free, pos, window = {}, [0.0] * p, [0] * p, [None] * p
    while any(pos[s] < len(lists[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(lists[s]):
                a, st, w = lists[s][pos[s]]
                need = []  # (kind, stage, mb, link the message crosses or None)
                if a.kind == "F" and s > 0:
                    need.append(("F", s - 1, a.mb, s - 1))
                if a.kind == "B":
                    need.append(("F", s, a.mb, None))
                    if s < p - 1:
                        need.append(("B", s + 1, a.mb, s))
                if any((k, g, st, mb) not in done for k, g, mb, _ in need):
                    break
                if (st, w) != window[s]:  # a new window: the loop's own work first
                    free[s] += gap
                    window[s] = (st, w)
                start = max([free[s], *(done[(k, g, st, mb)] + (0.0 if link is None else latency + extra.get(link, 0.0))
                                        for k, g, mb, link in need)])
                cost = {"F": forward[s], "B": backward[s], "S": STEP}[a.kind]
                if a.kind != "S" and a.mb % 5 < 3:
                    cost *= (contention or {}).get(s, 1.0)
                free[s] = start + cost
                done[(a.kind, s, st, a.mb)] = free[s]
                detail = {"mb": a.mb, "chunk": 0, "cpu_ns": int(cost * cpu_share * MS),
                          **({**info, "stage": s} if a.kind == "S" else {})}
                events[s].append(Event(f"pipeline.{a.kind}", 0, -1, int(start * MS), int(free[s] * MS), 0, "pipeline",
                                       detail))
                pos[s] += 1
    return JobEvents([RankEvents(s, (hosts or ["h"] * p)[s], events[s]) for s in range(p)], {"size": p})


def best_split(layer_costs, parts):
    """(the smallest largest part, a split reaching it) of ``layer_costs`` into ``parts`` contiguous parts, every
    split tried."""
    n, best = len(layer_costs), None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        edges = (0, *cuts, n)
        loads = [sum(layer_costs[a:b]) for a, b in zip(edges, edges[1:], strict=False)]
        if best is None or max(loads) < best[0]:
            best = (max(loads), [b - a for a, b in zip(edges, edges[1:], strict=False)])
    return best


@pytest.mark.parametrize("step_every", [1, 2])
def test_one_stage_twice_as_heavy_sets_the_period_and_a_better_split_is_recommended(step_every):
    f, b, balance = [1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [4, 4, 4]
    job = stream_events(3, 4, f, b, step_every=step_every, balance=balance)
    got = stream_breakdown(job)
    k = step_every
    per_step = [k * (f[s] + b[s]) + STEP for s in range(3)]
    period = max(per_step)  # the slowest stage sets every stage's rate
    assert got.measured * 1e3 == pytest.approx(period, rel=1e-3)
    assert got.predicted * 1e3 == pytest.approx(period, rel=1e-3)
    for s in range(3):
        assert got.per_stage[s].busy * 1e3 == pytest.approx(per_step[s], rel=1e-3)
        assert got.idle(s) * 1e3 == pytest.approx(period - per_step[s], abs=1e-3)  # no message delay: all waiting
    mean = sum(per_step) / 3
    assert got.imbalance == pytest.approx((period - mean) / period, abs=0.01)
    assert got.transport < 0.01

    found = stream_findings(job)
    heavy = next(f_ for f_ in found if "heaviest" in f_.what)
    assert heavy.severity == "problem" and "pipeline stage 1 is the heaviest" in heavy.what
    # each layer costs its stage's mean per optimizer step: its share of k forwards and backwards, and of the step
    layers = [(k * (f[s] + b[s]) + STEP) / balance[s] for s in range(3) for _ in range(balance[s])]
    best, _ = best_split(layers, 3)
    assert heavy.fix.startswith("ringpipe train --set pipeline.balance=[") and heavy.fix.endswith(f"(now {balance})")
    split = [int(x) for x in heavy.fix.split("balance=[")[1].split("]")[0].split(",")]
    edges = list(itertools.accumulate([0, *split]))
    assert sum(split) == 12 and max(sum(layers[a:b]) for a, b in zip(edges, edges[1:], strict=False)) == pytest.approx(best)
    predicted = best
    assert f"predicted {predicted:.1f} ms instead of {period:.1f} ms ({period / predicted:.2f}x)" in heavy.evidence
    assert "mostly imbalance between stages" in found[0].what
    assert breakdown(job) is None and pipeline_findings(job) == []  # the synchronous doctor leaves it alone


def test_a_balanced_stream_gets_no_false_finding_and_the_report_says_no_problem():
    job = stream_events(3, 4, [1.0] * 3, [2.0] * 3, batches=10, balance=[2, 2, 2])
    got = stream_breakdown(job)
    assert got.measured * 1e3 == pytest.approx(3.0 + STEP, rel=1e-3)
    assert got.imbalance < 0.01 and got.transport < 0.01
    found = stream_findings(job)
    assert [x.severity for x in found] == ["info"], found
    assert "no part above 10% of the period" in found[0].what
    # fill and drain of one stream of 40 micro-batches, stages balanced: the first stage waits 2 (F + B) to fill and
    # the last 2 (F + B) at the end, in mean 2 (F + B) of idle per stage against 40 (F + B + S) of work
    assert got.stream == 40 and got.fill_drain == pytest.approx(2 * 3.0 / (2 * 3.0 + 40 * 3.1), rel=0.05)
    assert "no problem found" in format_report(job, diagnose(job))


def test_a_stream_drained_often_is_named_for_its_fill_and_drain():
    job = stream_events(4, 4, [1.0] * 4, [2.0] * 4, batches=1, streams=6)
    got = stream_breakdown(job)
    assert got.detail["streams"] == 6 and got.stream == 4
    named = [x for x in stream_findings(job) if "drained often" in x.what]
    assert len(named) == 1 and named[0].severity == "problem", named


def test_slow_messages_are_transport_and_a_slow_link_is_named():
    job = stream_events(3, 4, [1.0] * 3, [2.0] * 3, latency=0.05, links={1: 4.0}, hosts=["a", "b", "c"])
    got = stream_breakdown(job)
    assert got.transport > 0.1
    links = {(x.up, x.down): x for x in got.links}
    assert links[(1, 2)].message > 3 * links[(0, 1)].message
    named = [x for x in stream_findings(job) if x.what.startswith("the link between")]
    assert [x.hosts for x in named] == [("b", "c")], named
    assert "the mean over" in named[0].evidence


def doctor_json(job, tmp_path, capsys):
    """What `ringpipe doctor --json EVENTS` prints for ``job``, read back."""
    save_events(tmp_path / "events.json", job)
    args = argparse.Namespace(events=str(tmp_path / "events.json"), json=True, verify=0, strict=False)
    assert doctor_main(args) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_doctors_json_holds_the_stream_breakdown_and_its_links(tmp_path, capsys):
    f, b = [1.0, 2.0, 1.0], [2.0, 4.0, 2.0]
    job = stream_events(3, 4, f, b, balance=[4, 4, 4], hosts=["a", "b", "c"])
    pipe = doctor_json(job, tmp_path, capsys)["pipeline"]
    assert (pipe["schedule"], pipe["per"], pipe["step_every"], pipe["stream_microbatches"]) == \
        ("async_1f1b", "optimizer step", 1, 32)
    period = max(f[s] + b[s] + STEP for s in range(3))
    assert pipe["measured_s"] * 1e3 == pytest.approx(period, rel=1e-3)
    for s, row in enumerate(pipe["per_stage"]):
        assert row["stage"] == s and row["forward_s"] * 1e3 == pytest.approx(f[s])
        assert row["busy_s"] * 1e3 == pytest.approx(f[s] + b[s] + STEP, rel=1e-3)
        assert row["idle_s"] * 1e3 == pytest.approx(period - (f[s] + b[s] + STEP), abs=1e-3)
    assert pipe["shares"]["imbalance"] == pytest.approx((period - (3.0 + 6.0 + 3.0) / 3 - STEP) / period, abs=0.01)
    assert [(x["up"], x["down"], x["up_host"], x["down_host"], x["slow"]) for x in pipe["links"]] == \
        [(0, 1, "a", "b", False), (1, 2, "b", "c", False)]
    assert pipe["slow_hosts"] == []


def crowded(job, load=5.0, cpus=2):
    """``job`` as gathered on hosts short of cores: a load average of ``load`` on ``cpus`` CPUs."""
    for r in job.ranks:
        r.info.update(loadavg=load, cpu_count=cpus)
    return job


@pytest.mark.parametrize(("p", "stage"), [(3, 1), (4, 2)])
def test_a_host_whose_network_is_slow_is_named_once_not_one_of_its_links(p, stage):
    # every message to and from ``stage``'s host takes 12 ms more (both its links), a pass 1-2 ms: in the stream
    # a stage holds micro-batches in flight, so some of its messages arrive while it is busy (no wait) and the
    # rest wait about the whole delay, in proportions the schedule sets per link and direction (half of each
    # link's messages, here); each link's figure per message must read as slow as the other's
    hosts = "abcd"[:p]
    job = stream_events(p, 4, [1.0] * p, [2.0] * p, latency=0.05, links={stage - 1: 12.0, stage: 12.0}, hosts=hosts)
    got = stream_breakdown(job)
    links = {(x.up, x.down): x for x in got.links}
    figures = [links[pair].message for pair in ((stage - 1, stage), (stage, stage + 1))]
    assert figures[0] == pytest.approx(figures[1], rel=0.2), links
    # the oracle: half of the messages wait the 12 ms, the longest tenth of all left out: 0.4 / 0.9 of 12 ms each
    for x in figures:
        assert x * 1e3 == pytest.approx(0.4 / 0.9 * 12.0, rel=0.2)
        assert x * 1e3 > 3 * 1.5  # 3 typical passes (F 1 ms, B 2 ms)
    found = stream_findings(job)
    named = [x for x in found if x.what.startswith("the link between") or "neighbours are slow" in x.what]
    assert len(named) == 1 and named[0].what.startswith(f"host {hosts[stage]}'s links to both neighbours are slow"), \
        [x.what for x in named]
    assert named[0].severity == "problem" and named[0].hosts == (hosts[stage],)
    assert "(mean, the longest tenth left out)" in named[0].what


def test_on_one_host_short_of_cores_no_link_between_its_stages_is_named():
    # all three stages on host h, with more runnable processes than its CPUs: a message between two of them
    # crosses no network, and a receiver that waits long for it waited for a core
    job = crowded(stream_events(3, 4, [1.0] * 3, [2.0] * 3, latency=0.05, links={1: 4.0}))
    found = stream_findings(job)
    assert not [x for x in found if x.what.startswith("the link between")], [x.what for x in found]
    # the same waits between stages on hosts of their own are a link named
    job = crowded(stream_events(3, 4, [1.0] * 3, [2.0] * 3, latency=0.05, links={1: 4.0}, hosts=["a", "b", "c"]))
    named = [x for x in stream_findings(job) if x.what.startswith("the link between")]
    assert [x.hosts for x in named] == [("b", "c")], named


def test_passes_slowed_by_other_processes_do_not_make_a_stage_the_heaviest():
    # every stage does the same work (F 1 ms, B 2 ms), but 3 in every 5 of stage 0's passes run 1.5 times longer,
    # CPU time too (another process sharing its core's caches and memory): the stage's work is its unhindered
    # passes, and what the slowed ones add is time outside the work (a busy CPU), not a heavier split
    job = crowded(stream_events(3, 4, [1.0] * 3, [2.0] * 3, contention={0: 1.5}, balance=[2, 2, 2]))
    got = stream_breakdown(job)
    assert sum(got.per_stage[0].forward.values()) * 1e3 == pytest.approx(1.0)
    assert sum(got.per_stage[0].backward.values()) * 1e3 == pytest.approx(2.0)
    assert got.imbalance < 0.01
    found = stream_findings(job)
    assert not [x for x in found if "heaviest" in x.what], [x.what for x in found]
    assert got.transport > 0.1  # the slowed passes lengthen the period: time outside the work
    # a stage whose every pass is 1.5 times longer is the heaviest (4 layers a stage: a split can move one)
    job = crowded(stream_events(3, 4, [1.5, 1.0, 1.0], [3.0, 2.0, 2.0], balance=[4, 4, 4]))
    heavy = [x for x in stream_findings(job) if "heaviest" in x.what]
    assert [x.severity for x in heavy] == ["problem"] and "pipeline stage 0 is the heaviest" in heavy[0].what


@pytest.mark.parametrize(("balance", "f", "b"), [([1, 1], [1.0, 1.3], [2.0, 2.6]), ([2, 3], [1.2, 1.5], [2.0, 2.7])])
def test_an_imbalance_no_split_of_the_layers_betters_is_information(balance, f, b):
    # stage 1 is 10-20% heavier, but its layers are as few as they can be (one layer a stage), or moving one
    # layer off it makes stage 0 heavier still: the oracle tries every contiguous split of the layers (each costed
    # at its stage's mean per optimizer step) and none shortens the period 1.1 times
    job = stream_events(2, 4, f, b, balance=balance)
    got = stream_breakdown(job)
    assert (got.predicted - got.balanced) / got.predicted >= 0.10  # as heavy as the rule's problem threshold
    layers = [(f[s] + b[s] + STEP) / balance[s] for s in range(2) for _ in range(balance[s])]
    best, _ = best_split(layers, 2)
    assert max(f[s] + b[s] + STEP for s in range(2)) / best < 1.1
    heavy = [x for x in stream_findings(job) if "heaviest" in x.what]
    assert len(heavy) == 1 and heavy[0].severity == "info", heavy
    assert "pipeline stage 1 is the heaviest" in heavy[0].what
    assert "no split of its layers" in heavy[0].evidence and "pipeline.balance=" not in heavy[0].fix


def test_stages_computing_off_the_cpu_on_a_host_of_fewer_cpus_get_the_split_recommended():
    """Three stages on two CPUs whose passes ran on a device (2 % of each on the CPU): no core is short, the wall
    clock times the passes, and the better split is recommended, not only mentioned."""
    off = stream_events(3, 4, [1.0, 2.0, 1.0], [2.0, 4.0, 2.0], balance=[4, 4, 4], cpu_share=0.02)
    for r in off.ranks:
        r.info.update(loadavg=0.2, cpu_count=2, cpus=[0, 1])
    got = stream_breakdown(off)
    assert not got.detail["cpu"]
    assert sum(got.per_stage[1].backward.values()) * 1e3 == pytest.approx(4.0)
    heavy = next(x for x in stream_findings(off) if "heaviest" in x.what)
    assert heavy.fix.startswith("ringpipe train --set pipeline.balance=[")
    # on the CPU, the same three stages share the two CPUs: the split is only mentioned
    on = stream_events(3, 4, [1.0, 2.0, 1.0], [2.0, 4.0, 2.0], balance=[4, 4, 4])
    for r in on.ranks:
        r.info.update(loadavg=0.2, cpu_count=2, cpus=[0, 1])
    heavy = next(x for x in stream_findings(on) if "heaviest" in x.what)
    assert heavy.fix.startswith("once every stage has a core of its own")
