"""The pipeline doctor on synthetic runs: the bubble named as the schedule's, imbalance, too few micro-batches, transport.

The events are made here, as a run would record them: every stage runs its action list in
order, an action starting when the stage is free and its inputs are there (the forward of
the previous stage, the backward of the next one, each message taking ``latency``), each step
after the slowest stage's previous step. Pass times are chosen per stage. The oracle for the
schedule's own bubble is the paper's ``(p - 1) / (m + p - 1)`` for 1F1B with equal stages.
"""

import pytest

from ringpipe.comm.events import Event
from ringpipe.observe.collect import JobEvents, RankEvents
from ringpipe.observe.doctor import diagnose
from ringpipe.pipeline.diagnosis import breakdown, crowded_hosts, pipeline_findings
from ringpipe.pipeline.schedules import SCHEDULES

MS = 1_000_000  # ns


def run_events(p, m, forward, backward, *, latency=0.0, steps=6, schedule="1f1b", balance=None, gap=0.0, cpu=None,
               links=None, hosts=None):
    """Every stage's events for ``steps`` steps; ``forward[s]``/``backward[s]`` in ms per micro-batch;
    ``cpu``: ``(forward, backward)`` CPU times per stage, recorded with one intra-op thread; ``links``:
    ``{s: ms}`` the transfer time of a message on the link between stages ``s`` and ``s + 1``, one message
    at a time each way (a message is sent when its pass ends and the link is free), before its ``latency``;
    ``hosts``: each stage's host."""
    extra = links or {}
    arrived, link_free = {}, {}

    def arrival(k, g, mb, link):
        """When message (k, g, mb) is there for its receiver: computed once, in the order they are used."""
        if (k, g, mb) not in arrived:
            t = done[(k, g, mb)]
            if link in extra:
                t = max(t, link_free.get((k, link), 0.0)) + extra[link]
                link_free[(k, link)] = t
            arrived[(k, g, mb)] = t + latency
        return arrived[(k, g, mb)]

    lists = [SCHEDULES[schedule](p, m, s) for s in range(p)]
    info = {"schedule": schedule, "stages": p, "microbatches": m, "chunks": 1,
            "balance": balance or [2] * p, "recompute": False, "step_every": 1, "threads": 1}
    events = [[] for _ in range(p)]
    t0 = 0.0
    for _ in range(steps):
        done, free, pos = {}, [t0] * p, [0] * p
        arrived.clear()
        while any(pos[s] < len(lists[s]) for s in range(p)):
            for s in range(p):
                while pos[s] < len(lists[s]):
                    a = lists[s][pos[s]]
                    need = []
                    if a.kind == "F" and s > 0:
                        need.append(("F", s - 1, a.mb, s - 1))
                    if a.kind == "B":
                        need.append(("F", s, a.mb, None))
                        if s < p - 1:
                            need.append(("B", s + 1, a.mb, s))
                    if any((k, g, mb) not in done for k, g, mb, _ in need):
                        break
                    start = max([free[s], *(done[(k, g, mb)] if link is None else arrival(k, g, mb, link)
                                            for k, g, mb, link in need)])
                    cost = {"F": forward[s], "B": backward[s], "S": 0.1}[a.kind]
                    free[s] = start + cost
                    done[(a.kind, s, a.mb)] = free[s]
                    detail = {"mb": a.mb, "chunk": 0, **({**info, "stage": s} if a.kind == "S" else {})}
                    if cpu is not None:
                        detail["cpu_ns"] = int(MS * {"F": cpu[0][s], "B": cpu[1][s], "S": 0.1}[a.kind])
                    events[s].append(Event(f"pipeline.{a.kind}", 0, -1, int(start * MS), int(free[s] * MS), 0,
                                           "pipeline", detail))
                    pos[s] += 1
        t0 = max(free) + gap
    return JobEvents([RankEvents(s, (hosts or ["h"] * p)[s], events[s]) for s in range(p)], {"size": p})


@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_balanced_split_is_named_the_schedules_bubble_at_the_papers_fraction(p):
    m = 8
    job = run_events(p, m, [1.0] * p, [2.0] * p)
    b = breakdown(job)
    paper = (p - 1) / (m + p - 1)
    assert abs(b.measured_idle - paper) < 0.05
    assert abs(b.bubble - b.measured_idle) < 0.05
    found = pipeline_findings(job)
    assert "mostly the schedule's own bubble" in found[0].what
    named = next(f for f in found if f.what.startswith("the schedule's own bubble"))
    assert named.severity == "problem" and f"idle {100 * b.bubble:.1f}% of the step" in named.what
    assert not any("heaviest" in f.what or "longer than" in f.what for f in pipeline_findings(job))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p", [2, 4])
def test_with_the_messages_latency_learned_from_the_run_the_schedule_predicts_the_measured_idle(p, schedule):
    """Each message takes 0.3 ms in the generated run: the doctor learns that from the messages whose receiver waited
    (GPipe hides most of its messages behind work: their waits are 0) and, simulating the schedule with it, predicts
    the stages' idle share the run measured, which the bubble without messages does not."""
    m = 2 * p
    b = breakdown(run_events(p, m, [1.0] * p, [2.0] * p, latency=0.3, schedule=schedule, hosts=["a", "b", "c", "d"][:p]))
    assert b.detail["message"] * 1e3 == pytest.approx(0.3, abs=1e-6)
    assert abs(b.predicted_idle - b.measured_idle) < 0.005
    assert b.measured_idle - b.bubble > 0.025
    quiet = breakdown(run_events(p, m, [1.0] * p, [2.0] * p, schedule=schedule))  # no latency: the bubble itself
    assert quiet.predicted_idle == pytest.approx(quiet.bubble, abs=0.005) == pytest.approx((p - 1) / (m + p - 1), abs=0.005)


def test_the_measured_bubble_leaves_out_the_waits_for_messages_in_transit():
    """With a 0.3 ms latency per message the stages idle 6 points more than the paper's bubble on 2 stages; what
    they idle waiting for a neighbour still computing stays within 2 points of it."""
    p, m = 2, 4
    paper = (p - 1) / (m + p - 1)
    b = breakdown(run_events(p, m, [1.0] * p, [2.0] * p, latency=0.3, hosts=["a", "b"]))
    assert b.measured_idle - paper > 0.05
    assert abs(b.measured_bubble - paper) < 0.02 and b.measured_bubble < b.measured_idle
    assert all(w > 0 for w in b.message_waits)
    named = next(f for f in pipeline_findings(run_events(p, m, [1.0] * p, [2.0] * p, latency=0.3, hosts=["a", "b"]))
                 if f.what.startswith("the schedule's own bubble"))
    assert (f"stages idle {100 * b.measured_idle:.1f}% of the step, {100 * b.measured_bubble:.1f}% of the step "
            "waiting for a neighbour still computing") in named.evidence


def test_one_stage_twice_as_heavy_is_named_and_a_better_split_recommended():
    job = run_events(3, 8, [1.0, 2.0, 1.0], [2.0, 4.0, 2.0], balance=[2, 2, 2])
    found = pipeline_findings(job)
    heavy = next(f for f in found if "heaviest" in f.what)
    assert heavy.severity == "problem" and "stage 1" in heavy.what
    assert "pipeline.balance=" in heavy.fix and "[2, 2, 2]" in heavy.fix
    new = [int(x) for x in heavy.fix.split("pipeline.balance=[")[1].split("]")[0].split(",")]
    assert sum(new) == 6 and new[1] < 2
    assert "x)" in heavy.evidence  # the predicted gain


def test_too_few_micro_batches_for_the_stages_get_more_or_interleaving():
    job = run_events(4, 4, [1.0] * 4, [2.0] * 4)
    b = breakdown(job)
    assert b.bubble > 0.3  # 3 / 7 idle
    fix = next(f for f in pipeline_findings(job) if f.severity == "fix")
    assert "micro-batches" in fix.what or "interleaving" in fix.what
    assert "microbatches=" in fix.fix or "interleaved" in fix.fix


def test_slow_messages_are_named_transport_not_bubble():
    job = run_events(2, 8, [1.0, 1.0], [2.0, 2.0], latency=2.0)
    found = pipeline_findings(job)
    assert any("longer than their schedule explains" in f.what for f in found)
    assert "transport" in found[0].what


def test_a_run_without_pipeline_events_gets_no_pipeline_finding():
    job = JobEvents([RankEvents(0, "h", [Event("allreduce", 4, -1, 0, MS, 0, "world")])], {"size": 1})
    assert pipeline_findings(job) == [] and breakdown(job) is None


def test_the_doctor_reports_the_pipeline_bubble_instead_of_no_problem():
    job = run_events(2, 2, [1.0, 1.0], [2.0, 2.0])
    found = diagnose(job)
    assert any(f.what.startswith("the schedule's own bubble") and f.severity == "problem" for f in found)


def test_a_heavy_stage_is_named_even_when_slow_messages_dominate_the_step():
    job = run_events(2, 8, [1.0, 2.0], [2.0, 4.0], latency=6.0, balance=[2, 2])
    found = pipeline_findings(job)
    assert any("stage 1 is the heaviest" in f.what for f in found)
    assert any("longer than their schedule explains" in f.what for f in found)


def test_on_a_host_short_of_cores_a_bubble_change_is_mentioned_not_recommended():
    job = run_events(4, 4, [1.0] * 4, [2.0] * 4, hosts=["a", "b", "c", "d"])  # a rank per host: the load decides
    for r in job.ranks:
        r.info.update(loadavg=9.0, cpu_count=2)
    found = pipeline_findings(job)
    assert not any(f.severity == "fix" for f in found)
    assert any(f.what.startswith("once every stage has a core") and "load average of 9.0 on 2 CPUs" in f.evidence
               for f in found)


def test_a_stage_slowed_by_waiting_for_a_core_is_not_called_heavy_when_its_cpu_time_is_equal():
    # stage 1's passes take twice the wall time (preempted), the same CPU time as stage 0's
    job = run_events(2, 8, [1.0, 2.0], [2.0, 4.0], balance=[2, 2], cpu=([1.0, 1.0], [2.0, 2.0]))
    assert breakdown(job).detail["cpu"]
    assert not any("heaviest" in f.what for f in pipeline_findings(job))
    assert any("heaviest" in f.what for f in pipeline_findings(
        run_events(2, 8, [1.0, 2.0], [2.0, 4.0], balance=[2, 2], cpu=([1.0, 2.0], [2.0, 4.0]))))


@pytest.mark.parametrize("latency", [0.0, 1.0, 3.0])
def test_more_micro_batches_are_recommended_only_where_they_make_the_step_shorter(latency):
    # The oracle: this file's simulated run itself, with the same batch in 2x and 4x as many micro-batches
    # (each pass that many times shorter, each message the same latency). With slow messages the extra
    # messages cost more than the smaller bubble saves: the doctor must not recommend them there.
    job = run_events(2, 4, [1.0, 1.0], [2.0, 2.0], latency=latency)
    step = breakdown(job).measured
    more = {k * 4: breakdown(run_events(2, k * 4, [1.0 / k] * 2, [2.0 / k] * 2, latency=latency)).measured
            for k in (2, 4)}
    fixes = [f.fix for f in pipeline_findings(job) if f.severity == "fix"]
    for m2, t in more.items():
        if any(f"pipeline.microbatches={m2}" in f for f in fixes):
            assert t < step, (m2, t, step, fixes)
    if latency == 0.0:  # nothing but the bubble: more micro-batches do help, and are recommended
        assert min(more.values()) < step and any("pipeline.microbatches=" in f for f in fixes), fixes


def test_more_ranks_than_cpus_on_a_host_is_crowded_whatever_its_load_average():
    # the load average lags a job that has just started; three ranks on two CPUs share them already
    job = run_events(3, 6, [1.0] * 3, [2.0] * 3)
    for r in job.ranks:
        r.info.update(loadavg=0.2, cpu_count=2, cpus=[0, 1])
    assert crowded_hosts(job) == "host h runs 3 of the job's ranks on 2 CPUs"
    assert not any(f.severity == "fix" for f in pipeline_findings(job))
    for r in job.ranks:
        r.info.update(cpu_count=4, cpus=[0, 1, 2, 3])
    assert crowded_hosts(job) == ""


def test_hosts_that_are_one_machine_share_its_cpus():
    """Namespace hosts (or containers) of one machine share one boot id and its CPUs."""
    job = run_events(3, 6, [1.0] * 3, [2.0] * 3, hosts=["rp-host-a", "rp-host-b", "rp-host-c"])
    for r in job.ranks:
        r.info.update(loadavg=0.2, cpu_count=2, cpus=[0, 1], machine="boot-1")
    assert crowded_hosts(job) == ("hosts rp-host-a, rp-host-b, rp-host-c are one machine (one boot id) and run 3 of "
                                  "the job's ranks on 2 CPUs")
    for i, r in enumerate(job.ranks):  # three machines: a rank each
        r.info.update(machine=f"boot-{i}")
    assert crowded_hosts(job) == ""


def test_on_a_host_with_more_ranks_than_cpus_a_new_split_is_mentioned_not_recommended():
    # three stages on one host of two CPUs, stage 1 twice as heavy
    job = run_events(3, 6, [1.0, 2.0, 1.0], [2.0, 4.0, 2.0], balance=[2, 4, 2])
    for r in job.ranks:
        r.info.update(loadavg=0.2, cpu_count=2, cpus=[0, 1])
    heavy = next(f for f in pipeline_findings(job) if "stage 1 is the heaviest" in f.what)
    assert heavy.severity == "problem"
    assert heavy.fix.startswith("once every stage has a core of its own: ringpipe train --set pipeline.balance=")
    assert "not recommended now: host h runs 3 of the job's ranks on 2 CPUs" in heavy.fix
    # a core per rank: the split is the fix
    for r in job.ranks:
        r.info.update(cpu_count=4, cpus=[0, 1, 2, 3])
    heavy = next(f for f in pipeline_findings(job) if "stage 1 is the heaviest" in f.what)
    assert heavy.fix.startswith("ringpipe train --set pipeline.balance=")


def test_stages_computing_off_the_cpu_need_no_core_and_are_timed_by_the_wall_clock():
    """A GPU's passes (or a device held for a fixed time): the calling thread is on a CPU for a small part
    of each pass. Three such stages on a host of two CPUs are not short of cores, their wall times are
    their passes (their CPU times would make every pass nearly free), and the new split is recommended."""
    job = run_events(3, 6, [1.0, 2.0, 1.0], [2.0, 4.0, 2.0], balance=[2, 4, 2],
                     cpu=([0.02, 0.04, 0.02], [0.04, 0.08, 0.04]))
    for r in job.ranks:
        r.info.update(loadavg=0.2, cpu_count=2, cpus=[0, 1])
    assert crowded_hosts(job) == ""
    b = breakdown(job)
    assert not b.detail["cpu"]
    assert b.per_stage[1].forward[0] == pytest.approx(0.002) and b.per_stage[1].backward[0] == pytest.approx(0.004)
    heavy = next(f for f in pipeline_findings(job) if "stage 1 is the heaviest" in f.what)
    assert heavy.fix.startswith("ringpipe train --set pipeline.balance=")
    # the same stages computing on the CPU (a tenth of each pass or more on it) share the two CPUs
    on_cpu = run_events(3, 6, [1.0, 2.0, 1.0], [2.0, 4.0, 2.0], balance=[2, 4, 2],
                        cpu=([0.1, 0.2, 0.1], [0.2, 0.4, 0.2]))
    for r in on_cpu.ranks:
        r.info.update(loadavg=0.2, cpu_count=2, cpus=[0, 1])
    assert crowded_hosts(on_cpu) == "host h runs 3 of the job's ranks on 2 CPUs"
    assert breakdown(on_cpu).detail["cpu"]


def test_passes_timed_on_a_gpu_are_read_from_their_device_time():
    """A GPU pass returns once its kernels are queued: its wall and CPU times are the queueing, its
    ``gpu_ns`` (CUDA events) the work. The doctor reads ``gpu_ns``, and such stages need no core."""
    job = run_events(3, 6, [1.0, 2.0, 1.0], [2.0, 4.0, 2.0], balance=[2, 4, 2],
                     cpu=([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]))  # queueing only: a third of the lightest pass
    for r in job.ranks:
        r.info.update(loadavg=0.2, cpu_count=2, cpus=[0, 1])
        for e in r.events:
            if e.op != "pipeline.S":  # the device's time of each pass, a tenth under its wall time
                e.detail["gpu_ns"] = int(0.9 * (e.end_ns - e.start_ns))
    b = breakdown(job)
    assert not b.detail["cpu"] and crowded_hosts(job) == ""
    assert b.per_stage[1].forward[0] == pytest.approx(0.0018) and b.per_stage[1].backward[0] == pytest.approx(0.0036)
    assert b.per_stage[0].forward[0] == pytest.approx(0.0009)
    heavy = next(f for f in pipeline_findings(job) if "stage 1 is the heaviest" in f.what)
    assert heavy.fix.startswith("ringpipe train --set pipeline.balance=")
