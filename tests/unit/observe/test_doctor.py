"""The doctor's verdicts on three hosts, scenario by scenario, from synthetic probes and events.

Each scenario of seed 000's setup (8 ranks on hosts a, b, c) is built from figures written
here: link bandwidths per host pair, when each rank enters each collective. The verdict must
name what was put wrong and nothing else.
"""

from __future__ import annotations

import random

import pytest

from ringpipe.comm.events import Event
from ringpipe.observe.collect import JobEvents, RankEvents
from ringpipe.observe.doctor import diagnose, late_ranks, recommend
from ringpipe.observe.links import run_links, slow_hosts, step_links
from ringpipe.observe.placement import balanced_counts, ring_model
from ringpipe.observe.regions import EXPECTED_OP

MS = 1_000_000


def _hosts(shape):
    return [f"rp-host-{h}" for h, n in zip("abc", shape, strict=False) for _ in range(n)]


def _job(hosts, events=None, infos=None):
    events = events or [[] for _ in hosts]
    infos = infos or [{} for _ in hosts]
    return JobEvents([RankEvents(r, h, events[r], infos[r]) for r, h in enumerate(hosts)], {"backend": "gloo"})


def _links(hosts, slow_host=None, same=1.1, cross=1.0, slow=0.008, seed=0):
    """Probed links of every rank pair: ``same`` GB/s inside a host, ``cross`` between hosts (+-20 % noise),
    ``slow`` for every link of ``slow_host``."""
    rnd = random.Random(seed)
    out = []
    for a in range(len(hosts)):
        for b in range(a + 1, len(hosts)):
            bw = same if hosts[a] == hosts[b] else cross
            if slow_host in (hosts[a], hosts[b]) and hosts[a] != hosts[b]:
                bw = slow
            out.append({"src": a, "dst": b, "latency_us": 80.0, "gbps": bw * rnd.uniform(0.8, 1.2)})
    return out


def _problems(findings):
    return [f for f in findings if f.severity == "problem"]


# ----------------------------------------------------------------------------- placement


def test_the_ring_model_charges_a_single_rank_host_twice_and_nothing_for_uneven_counts():
    assert balanced_counts(8, 3) == [3, 3, 2]
    assert ring_model([4, 2, 2]) == ring_model([3, 3, 2]) == ring_model([4, 4]) == 1.0
    assert ring_model([4, 3, 1]) == 2.0
    # A slow link of host c paces the ring whatever the counts: the placement is not what matters then.
    assert ring_model([4, 2, 2], [1.0, 1.0, 0.01]) == ring_model([3, 3, 2], [1.0, 1.0, 0.01]) == 100.0


@pytest.mark.parametrize("shape", [(4, 2, 2), (3, 3, 2), (2, 3, 3)])
def test_nothing_wrong_on_three_hosts_is_not_a_problem(shape):
    hosts = _hosts(shape)
    for seed in range(10):
        found = diagnose(_job(hosts), _links(hosts, seed=seed))
        assert _problems(found) == [], [f.text() for f in found]
        assert any(f.what.startswith(f"placement {'-'.join(map(str, shape))} over 3 hosts") for f in found)
        assert not any("unbalanced" in f.what for f in found)


def test_4_3_1_names_host_c_in_the_headline_and_only_the_placement():
    hosts = _hosts((4, 3, 1))
    for seed in range(10):
        found = _problems(diagnose(_job(hosts), _links(hosts, seed=seed)))
        assert len(found) == 1, [f.text() for f in found]
        f = found[0]
        assert f.what.startswith("placement 4-3-1: host rp-host-c runs a single rank") and f.hosts == ("rp-host-c",)
        assert "2.0x as long as with 3-3-2" in f.evidence
        assert "rp-host-a:3,rp-host-b:3,rp-host-c:2" in f.fix


def test_hosts_of_one_machine_sharing_its_cores_are_information_a_real_oversubscribed_host_a_problem():
    hosts = _hosts((4, 2, 2))
    shared = [{"cpus": [0, 1], "cpu_count": 2, "threads": 1, "machine": "m0"} for _ in hosts]
    found = diagnose(_job(hosts, infos=shared), _links(hosts))
    assert _problems(found) == []
    assert any(f.severity == "info" and "share one machine with 2 CPUs for 8 threads" in f.what for f in found)
    # Three machines; host a runs 4 single-threaded ranks on 2 CPUs, the others have a CPU per rank.
    apart = [{"cpus": [0, 1] if h.endswith("a") else [0, 1, 2, 3], "cpu_count": 4 if not h.endswith("a") else 2,
              "threads": 1, "machine": h} for h in hosts]
    found = _problems(diagnose(_job(hosts, infos=apart), _links(hosts)))
    assert [f.what for f in found] == ["host rp-host-a is oversubscribed: 4 ranks x threads = 4 on 2 CPUs"]


def test_a_slow_computing_rank_is_named_alone():
    hosts = _hosts((4, 2, 2))
    infos = [{"compute_ms": 40.0 + r % 3} for r in range(8)]
    infos[6]["compute_ms"] = 95.0
    found = _problems(diagnose(_job(hosts, infos=infos), _links(hosts)))
    assert [(f.rank, f.what) for f in found] == [(6, "rank 6 (host rp-host-c) computes slowly")]


def test_a_rank_that_only_waited_for_a_core_is_not_said_to_compute_slowly():
    """Wall time 3x the others' (other processes held the core), CPU time as theirs: no accusation."""
    hosts = _hosts((4, 2, 2))
    infos = [{"compute_ms": 40.0 + r % 3, "compute_cpu_ms": 39.0 + r % 3} for r in range(8)]
    infos[1]["compute_ms"] = 120.0
    assert _problems(diagnose(_job(hosts, infos=infos), _links(hosts))) == []
    infos[1]["compute_cpu_ms"] = 110.0  # the CPU itself is slow
    found = _problems(diagnose(_job(hosts, infos=infos), _links(hosts)))
    assert [(f.rank, f.what) for f in found] == [(1, "rank 1 (host rp-host-a) computes slowly")]
    assert "CPU time" in found[0].evidence


def test_a_host_whose_every_rank_computes_slowly_is_named_once():
    hosts = _hosts((4, 2, 2))
    infos = [{"compute_ms": 40.0 + r % 3} for r in range(8)]
    infos[6]["compute_ms"], infos[7]["compute_ms"] = 90.0, 97.0
    found = _problems(diagnose(_job(hosts, infos=infos), _links(hosts)))
    assert [(f.rank, f.hosts, f.what) for f in found] == [(None, ("rp-host-c",),
                                                           "the ranks of host rp-host-c compute slowly")]


# ----------------------------------------------------------------------------- links


@pytest.mark.parametrize("shape", [(4, 2, 2), (3, 3, 2)])
def test_a_shaped_link_of_host_c_is_named_as_host_cs_link_with_a_fix_that_leaves_it_out(shape):
    hosts = _hosts(shape)
    for seed in range(10):
        links = _links(hosts, slow_host="rp-host-c", seed=seed)
        assert slow_hosts(_job(hosts), links) == ["rp-host-c"]
        timings = {"ring": 75.0, "hierarchical": 49.0, "native": 76.0, "without rp-host-c": 3.0}
        found = diagnose(_job(hosts), links, timings, 256 << 10)
        problems = _problems(found)
        assert len(problems) == 1, [f.text() for f in problems]
        f = problems[0]
        assert f.what.startswith("host rp-host-c's network link is slow") and f.hosts == ("rp-host-c",)
        assert "between rp-host-a and rp-host-b" in f.what and "run without rp-host-c" in f.fix
        fix = next(x for x in found if x.severity == "fix")
        assert fix.what == "leave host rp-host-c out until its link is fixed"
        assert "took 3.00 ms against 75.00 ms with rp-host-c (25.0x faster)" in fix.evidence
        assert not any("hierarchical" in x.what for x in found)


def test_a_shaped_link_of_the_single_rank_host_is_not_explained_away_as_core_contention():
    hosts = _hosts((4, 3, 1))
    busy = [{"cpus": [0, 1], "cpu_count": 2, "threads": 1, "machine": "m0"} for _ in hosts]
    found = _problems(diagnose(_job(hosts, infos=busy), _links(hosts, slow_host="rp-host-c")))
    whats = sorted(f.what.split(":")[0] for f in found)
    assert whats == ["host rp-host-c's network link is slow", "placement 4-3-1"], [f.text() for f in found]


def test_a_single_bad_rank_pair_is_named_but_crossing_hosts_is_only_information():
    hosts = _hosts((4, 2, 2))
    links = _links(hosts, same=8.0, cross=1.0)
    bad = next(x for x in links if (x["src"], x["dst"]) == (1, 4))
    bad["gbps"] = 0.05
    found = diagnose(_job(hosts), links)
    assert [f.what for f in _problems(found)] == ["slow link: rank 1 (rp-host-a) <-> rank 4 (rp-host-b)"]
    crossing = next(f for f in found if f.what.startswith("crossing hosts"))
    assert crossing.severity == "info" and crossing.what.startswith("crossing hosts costs ") and "in bandwidth" in crossing.what


def test_crossing_hosts_faster_than_staying_is_worded_as_faster():
    hosts = _hosts((2, 2))
    found = diagnose(_job(hosts), _links(hosts, same=0.9, cross=1.0, seed=3))
    crossing = next(f for f in found if f.what.startswith("crossing hosts"))
    assert "faster" in crossing.what or crossing.what == "crossing hosts costs nothing measurable in bandwidth"
    assert "costs 0." not in crossing.what


# ----------------------------------------------------------------------------- from a run's events


def _ring_events(hosts, gbps, late_ms=(), reps=6, nbytes=1 << 20, announce=False):
    """Ring allreduces timed from per-hop bandwidths ``gbps(src, dst)``; rank r starts each ``late_ms[r]`` late.

    With ``announce``, every allreduce is preceded by a 104-byte native allreduce (a join announcement)
    that starts when the rank arrives and ends when the last rank has arrived.
    """
    p = len(hosts)
    late = list(late_ms) + [0.0] * (p - len(late_ms))
    events = [[] for _ in range(p)]
    t0 = 0.0
    for cid in range(1, reps + 1):
        if announce:
            arrive = [t0 + late[r] for r in range(p)]
            for r in range(p):
                events[r].append(Event("allreduce", 104, -1, int(arrive[r] * MS), int((max(arrive) + 0.1) * MS), 0,
                                       "world", {}))
            start = [max(arrive) + 0.1] * p
        else:
            start = [t0 + late[r] for r in range(p)]
        done = {}
        for step in range(2 * (p - 1)):
            for r in range(p):
                pred = (r - 1) % p
                posted = start[r] if step == 0 else done[(r, step - 1)]
                sent = start[pred] if step == 0 else done[(pred, step - 1)]
                done[(r, step)] = max(posted, sent) + nbytes / p / gbps(pred, r) / MS
                events[r].append(Event("allreduce.step", nbytes // p, pred, int(posted * MS), int(done[(r, step)] * MS),
                                       0, "world", {"collective": "allreduce", "cid": cid, "step": step,
                                                    "algorithm": "ring", "reduce_ns": 0}))
        end = max(done.values())
        for r in range(p):
            events[r].append(Event("allreduce", nbytes, -1, int(start[r] * MS), int(end * MS), 0, "world",
                                   {"collective": "allreduce", "cid": cid, "algorithm": "ring"}))
        t0 = end + 100.0
    return _job(hosts, events)


def _bw(hosts, slow_host=None):
    def gbps(a, b):
        if hosts[a] == hosts[b]:
            return 1.2
        return 0.008 if slow_host in (hosts[a], hosts[b]) else 1.0
    return gbps


def test_events_of_a_clean_run_accuse_nobody():
    hosts = _hosts((4, 2, 2))
    assert _problems(diagnose(_ring_events(hosts, _bw(hosts)))) == []


def test_events_name_host_cs_slow_link_from_the_ring_hops():
    hosts = _hosts((4, 2, 2))
    found = _problems(diagnose(_ring_events(hosts, _bw(hosts, "rp-host-c"))))
    assert [f.hosts for f in found] == [("rp-host-c",)], [f.text() for f in found]
    assert "collective steps of this job" in found[0].evidence


def test_a_late_rank_is_named_and_the_hop_into_it_is_not_a_slow_link():
    hosts = _hosts((4, 2, 2))
    rnd = random.Random(5)
    job = _ring_events(hosts, _bw(hosts), late_ms=[0, 0, 0, 0, 0, rnd.uniform(30, 50)], reps=10)
    found = _problems(diagnose(job))
    assert [(f.rank, f.what) for f in found] == [(5, "rank 5 (host rp-host-b) arrives late at allreduce (ring) "
                                                     "of 1.0 MiB on world")]
    assert "last to enter in 10 of 10 calls" in found[0].evidence


def test_bookkeeping_collectives_are_judged_apart_from_the_data_collectives():
    """A 104-byte announcement before each allreduce (Horovod-style): rank 5 is last in every one of them."""
    hosts = _hosts((4, 2, 2))
    job = _ring_events(hosts, _bw(hosts), late_ms=[0, 0, 0, 0, 0, 40.0], reps=10, announce=True)
    found = late_ranks(job)
    assert [f.rank for f in found] == [5]
    assert "allreduce of 104 B" in found[0].what and "last to enter in 10 of 10 calls" in found[0].evidence


def test_lateness_at_ringpipes_own_announcement_says_it_is_lateness_for_the_programs_collectives():
    hosts = _hosts((4, 2, 2))
    job = _ring_events(hosts, _bw(hosts), late_ms=[0, 0, 0, 0, 0, 40.0], reps=10, announce=True)
    for r in job.ranks:  # the announcement marked as ringpipe's own, as the choke point marks it
        r.events[:] = [Event(e.op, e.nbytes, e.peer, e.start_ns, e.end_ns, e.tag, e.comm, {**e.detail, "internal": True})
                       if e.nbytes == 104 else e for e in r.events]
    found = late_ranks(job)
    assert [f.rank for f in found] == [5]
    assert "(ringpipe's own) of 104 B" in found[0].what
    assert "so the rank is late for the program's collectives" in found[0].evidence


def _scattered(work_ms, reps=10, scatter_ms=100.0, seed=3):
    """Allreduces whose ranks leave each call scattered over ``scatter_ms`` (ranks that spin while they
    wait, on fewer cores than ranks), then work ``work_ms[r]()`` ms before the next call."""
    rnd = random.Random(seed)
    p = len(work_ms)
    events = [[] for _ in range(p)]
    left = [0.0] * p
    for _ in range(reps):
        start = [left[r] + work_ms[r](rnd) for r in range(p)]
        done = max(start) + 5.0
        left = [done + rnd.uniform(0, scatter_ms) for _ in range(p)]
        for r in range(p):
            events[r].append(Event("allreduce", 1 << 18, -1, int(start[r] * MS), int(left[r] * MS), 0, "world",
                                   {"algorithm": "ring"}))
    return _job(_hosts((4, 2, 2)), events)


def test_a_late_rank_is_found_by_its_work_between_calls_when_finishing_times_scatter():
    """Arrival order is noise here (rank 5 is not last in most calls); its 30-50 ms of work per call is not."""
    work = [lambda rnd: 0.1] * 8
    work[5] = lambda rnd: rnd.uniform(30, 50)
    job = _scattered(work)
    found = _problems(diagnose(job))
    assert [(f.rank, f.hosts) for f in found] == [(5, ("rp-host-b",))], [f.text() for f in found]
    assert "worked a median" in found[0].evidence


def test_a_rank_computing_more_is_named_though_other_ranks_waiting_for_a_core_outwork_it_now_and_then():
    """8 ranks on 2 busy cores: each computes 40-80 ms between calls, rank 5 (four times the work) 120-200 ms;
    in 3 of 9 intervals another rank waits for a core and takes 250 ms. Rank 5 then is not the last to
    arrive, nor the one that worked the most, in most calls; it still works more than the others' median
    in every interval."""
    hiccup = {2: 1, 5: 6, 8: 3}  # interval -> the rank that waited for a core
    calls = {"n": -1}

    def other(r):
        def work(rnd):
            return 250.0 if hiccup.get(calls["n"]) == r else rnd.uniform(40, 80)
        return work

    def counted(f):
        def work(rnd):
            calls["n"] += 1
            return f(rnd)
        return work

    work = [other(r) for r in range(8)]
    work[5] = lambda rnd: rnd.uniform(120, 200)
    work[0] = counted(work[0])
    job = _scattered(work, scatter_ms=60.0)
    found = _problems(diagnose(job))
    assert [(f.rank, f.hosts) for f in found] == [(5, ("rp-host-b",))], [f.text() for f in found]


def test_ranks_that_wait_for_a_core_at_random_accuse_nobody():
    """Every interval one rank at random takes 250 ms instead of 40-80 ms: nobody works more consistently."""
    for seed in range(5):
        pick = random.Random(100 + seed)
        state = {"slow": None, "n": 0}

        def work_of(r):
            def work(rnd):
                if state["n"] % 8 == 0:
                    state["slow"] = pick.randrange(8)
                state["n"] += 1
                return 250.0 if state["slow"] == r else rnd.uniform(40, 80)
            return work

        job = _scattered([work_of(r) for r in range(8)], scatter_ms=60.0, seed=seed)
        assert _problems(diagnose(job)) == [], seed


def test_scattered_finishing_times_alone_accuse_nobody():
    for seed in range(5):
        job = _scattered([lambda rnd: rnd.uniform(0.05, 0.5)] * 8, seed=seed)
        assert _problems(diagnose(job)) == [], seed


def test_declared_expected_work_is_not_lateness():
    """Rank 0 writes a checkpoint before every barrier: late by design, marked, so not a problem."""
    events = [[] for _ in range(2)]
    for k in range(8):
        t = 100.0 * k
        events[0].append(Event(EXPECTED_OP, 0, -1, int(t * MS), int((t + 30) * MS), 0, "expected work",
                               {"work": "checkpoint"}))
        events[0].append(Event("barrier", 0, -1, int((t + 30.2) * MS), int((t + 31) * MS), 0, "world", {}))
        events[1].append(Event("barrier", 0, -1, int((t + 0.1) * MS), int((t + 31) * MS), 0, "world", {}))
    job = _job(["h0", "h0"], events)
    assert late_ranks(job) == []
    unmarked = _job(["h0", "h0"], [[e for e in events[0] if e.op != EXPECTED_OP], events[1]])
    assert [f.rank for f in late_ranks(unmarked)] == [0]


def test_the_first_stage_last_at_a_tied_weights_gradient_sum_is_the_schedule_not_a_late_rank():
    """Two pipeline stages sum a tied weight's gradient after each step's passes: in 1F1B stage 0's last
    backward ends last, so stage 0 enters every sum about a backward later. The pipeline doctor explains
    that wait (the bubble); the late-rank view, made for ranks doing the same work, names nobody. The
    same calls between two data-parallel ranks (no pipeline stages) still name rank 0."""
    events = [[] for _ in range(2)]
    for k in range(8):
        t = 100.0 * k
        for stage in (0, 1):
            enter = t + (40.0 if stage == 0 else 30.0)
            events[stage].append(Event("pipeline.B", 0, -1, int((enter - 10) * MS), int(enter * MS), 0, "pipeline",
                                       {"mb": 3, "chunk": 0}))
            events[stage].append(Event("allreduce", 8192, -1, int(enter * MS), int((t + 40.5) * MS), 0,
                                       "world/tied0-1r0", {}))
            events[stage].append(Event("pipeline.S", 0, -1, int((t + 40.5) * MS), int((t + 41) * MS), 0, "pipeline",
                                       {"schedule": "1f1b", "stage": stage, "stages": 2, "microbatches": 4}))
    assert late_ranks(_job(["h0", "h0"], events)) == []
    data_parallel = [[e for e in rank if not e.op.startswith("pipeline.")] for rank in events]
    assert [f.rank for f in late_ranks(_job(["h0", "h0"], data_parallel))] == [0]


def test_recursive_doubling_steps_give_links_too():
    """Both sides of a step record it with each other as peer; the slower side's wait is not the link's."""
    events = [[] for _ in range(4)]
    nbytes = 1 << 20
    for cid in range(4):
        t = 1000.0 * cid
        for step, dist in enumerate((1, 2)):
            for r in range(4):
                peer = r ^ dist
                gb = 0.1 if {r, peer} == {0, 2} else 1.0
                posted = t + 10 * step + (5.0 if r == 3 else 0.0)  # rank 3 posts late: not the link's fault
                start = max(posted, t + 10 * step + (5.0 if peer == 3 else 0.0))
                end = start + nbytes / gb / MS
                events[r].append(Event("allreduce.step", nbytes, peer, int(posted * MS), int(end * MS), 0, "world",
                                       {"collective": "allreduce", "cid": cid, "step": step,
                                        "algorithm": "recursive_doubling", "reduce_ns": 0}))
    job = _job(["h0"] * 4, events)
    links = {(x["src"], x["dst"]): x["gbps"] for x in step_links(job)}
    assert links == pytest.approx({(0, 1): 1.0, (2, 3): 1.0, (0, 2): 0.1, (1, 3): 1.0}, rel=1e-3)
    assert {(x["src"], x["dst"]) for x in run_links(job)} == set(links)


# ----------------------------------------------------------------------------- measured fixes


def test_the_fix_is_the_one_the_timings_favour_at_the_probed_size():
    job = _job(_hosts((4, 3, 1)))
    faster = recommend(job, {"ring": 10.0, "hierarchical": 5.5, "native": 8.0}, 1 << 20, [])
    assert [f.what for f in faster] == ["use the hierarchical allreduce (algorithm='hierarchical') for allreduces "
                                        "of about 1.0 MiB"]
    assert "hierarchical 5.50 ms against ring 10.00 ms (1.8x faster)" in faster[0].evidence
    native = recommend(job, {"ring": 10.0, "hierarchical": 9.5, "native": 4.0}, 4 << 20, [])
    assert "algorithm='native'" in native[0].what and native[0].severity == "fix"
    same = recommend(job, {"ring": 10.0, "hierarchical": 9.0, "native": 9.5}, 4 << 20, [])
    assert same[0].severity == "info" and same[0].what == "the ring allreduce is as fast as the alternatives at 4.0 MiB"
    verified = recommend(job, {"ring": 10.0, "native": 4.0}, 4 << 20, [],
                         {"fix": "native", "runs": 5, "before_ms": 10.5, "after_ms": 4.2})
    assert "verified with 5 more interleaved runs: 10.50 ms before, 4.20 ms after (2.5x)" in verified[0].evidence


def test_a_busy_machine_is_said_as_information_and_accuses_nobody():
    hosts = _hosts((4, 2, 2))
    infos = [{"loadavg": 30.0, "cpu_count": 2, "machine": "m"} for _ in hosts]
    found = diagnose(_job(hosts, infos=infos), _links(hosts))
    assert _problems(found) == []
    busy = [f for f in found if "busy: load average 30.0 on 2 CPUs" in f.what]
    assert len(busy) == 1 and busy[0].severity == "info" and busy[0].hosts == ("rp-host-a", "rp-host-b", "rp-host-c")


def test_the_json_report_under_an_mpi_launcher_is_the_same_object_in_short_lines():
    """Under mpirun every line is short (each reaches --tag-output whole); elsewhere one line; same JSON."""
    import json

    from ringpipe.observe.commands import json_text

    report = {"ranks": 8, "hosts": ["rp-host-a"] * 8,
              "links": [{"src": s, "dst": d, "latency_us": 15.0, "gbps": 1.5} for s in range(8) for d in range(s + 1, 8)],
              "findings": [{"severity": "problem", "what": "host c's link is slow " + "x" * 200, "evidence": "e" * 300}]}
    one = json_text(report, short_lines=False)
    assert one.endswith("\n") and one.count("\n") == 1 and len(one) > 2000
    short = json_text(report, short_lines=True)
    assert short.startswith('{"ranks": 8,\n')
    assert max(len(line) for line in short.splitlines()) < 400
    assert json.loads(short) == json.loads(one) == report
