"""The pipeline doctor's links: the waits that messages between neighbour stages add, and which link it names slow.

Synthetic runs from :func:`unit.pipeline.test_diagnosis.run_events`: a message is sent when its
pass ends, crosses a link one at a time in ``links[s]`` ms (the link between stages ``s`` and
``s + 1``; none: at once) and arrives ``latency`` ms later. The oracle is plain arithmetic on GPipe
with equal passes (forward ``f = 1``, backward ``b = 2`` ms, 4 micro-batches): on a link of
transfer time ``T > f`` the first activation of a step waits ``T`` plus the latency (its receiver
is idle), each later one ``T - f`` (it arrives ``T`` after the previous one, whose forward took
``f``); gradients likewise with ``b``. Two slow links in a row with the same ``T`` (a host whose
network is slow: both links of its stage) wait the same: each message leaves its middle stage ``T``
after the previous one, so the second link is free when it comes.
"""

import statistics

import pytest

from ringpipe.pipeline.diagnosis import breakdown, pipeline_findings
from ringpipe.pipeline.stage_links import (
    LINK_RATIO,
    boundaries,
    median_or_zero,
    slow_links,
    slow_stage,
    trimmed_mean,
)
from unit.pipeline.test_diagnosis import run_events
from unit.pipeline.test_stream_diagnosis import doctor_json

HOSTS = ["rp-host-a", "rp-host-b", "rp-host-c", "rp-host-d"]


def _links(found):
    return [f for f in found if f.what.startswith("the link between")]


def _hosts(found):
    return [f for f in found if "'s links to both neighbours are slow" in f.what]


# GPipe, f = 1 and b = 2 ms, 4 micro-batches, T = 8 ms on a slow link, latency 0.1 ms (the module docstring)
T, F, B, LAT = 8.0, 1.0, 2.0, 0.1
SLOW_ACTS, SLOW_GRADS = [T + LAT] + [T - F] * 3, [T + LAT] + [T - B] * 3
SLOW_MESSAGE = sorted(SLOW_ACTS + SLOW_GRADS)[3:5]  # the median of eight: the mean of the middle two
PASS = (F + B) / 2  # the median of the stages' forward and backward passes (as many of each)


def test_one_slow_link_of_gpipe_waits_as_the_arithmetic_says_and_is_named_with_its_hosts():
    job = run_events(3, 4, [1.0] * 3, [2.0] * 3, latency=0.1, links={1: 5.0}, schedule="gpipe", hosts=HOSTS[:3])
    b = breakdown(job)
    got = {(x.up, x.down): x for x in b.links}
    assert sorted(got) == [(0, 1), (1, 2)]
    slow = got[(1, 2)]
    acts, grads = [5.1, 4.0, 4.0, 4.0], [5.1, 3.0, 3.0, 3.0]  # T + latency, then T - f (T - b)
    assert slow.activations * 1e3 == pytest.approx(sum(acts), abs=1e-3)
    assert slow.gradients * 1e3 == pytest.approx(sum(grads), abs=1e-3)
    assert slow.total * 1e3 == pytest.approx(sum(acts) + sum(grads), abs=1e-3)
    assert slow.message * 1e3 == pytest.approx(4.0, abs=1e-3)  # the median of the eight
    # the fast link: the first activation waits the latency (later ones arrive while the previous runs);
    # every gradient does (stage 1's backwards come every T = 5 ms, stage 0's take 2)
    fast = got[(0, 1)]
    assert fast.total * 1e3 == pytest.approx(0.1 + 4 * 0.1, abs=1e-3)
    assert fast.message * 1e3 == pytest.approx(0.1, abs=1e-3)
    assert (slow.up_host, slow.down_host) == ("rp-host-b", "rp-host-c")
    named = _links(pipeline_findings(job))
    assert len(named) == 1 and named[0].severity == "problem", named
    assert named[0].what.startswith("the link between stage 1 (host rp-host-b) and stage 2 (host rp-host-c) is slow: "
                                    "its messages wait 4.0 ms each (median), 40.0x the other links'; 31.2 ms per step")
    assert named[0].hosts == ("rp-host-b", "rp-host-c")
    assert "rp-host-b and rp-host-c" in named[0].fix


@pytest.mark.parametrize("p", [2, 3, 4])
def test_equal_links_get_no_link_finding_even_when_messages_are_slow(p):
    job = run_events(p, 8, [1.0] * p, [2.0] * p, latency=0.5, links={s: 0.8 for s in range(p - 1)}, hosts=HOSTS[:p],
                     steps=8)
    b = breakdown(job)
    assert len(b.links) == p - 1 and all(x.total > 0 for x in b.links)
    found = pipeline_findings(job)
    assert _links(found) == [], found
    assert "waits on the links between stages per step" in found[0].evidence


def test_a_heavy_stage_is_not_taken_for_a_slow_link():
    """Stage 1 is late with its messages because it computes twice as long, not because of its links."""
    job = run_events(4, 8, [1.0, 2.0, 1.0, 1.0], [2.0, 4.0, 2.0, 2.0], latency=0.2, hosts=HOSTS)
    found = pipeline_findings(job)
    assert any("stage 1 is the heaviest" in f.what for f in found)
    assert _links(found) == []


def test_a_slow_link_in_the_middle_of_four_stages_is_the_one_named():
    job = run_events(4, 8, [1.0] * 4, [2.0] * 4, latency=0.2, links={1: 4.0}, hosts=HOSTS)
    b = breakdown(job)
    slow = slow_links(b.links, b.measured, 1.5e-3)
    assert [(s.link.up, s.link.down, s.against) for s in slow] == [(1, 2, "links")]
    assert slow[0].ratio >= LINK_RATIO
    assert len(_links(pipeline_findings(job))) == 1


def test_the_only_link_of_two_stages_is_named_when_its_messages_wait_three_typical_passes():
    # passes of 1 and 2 ms: a typical pass is 1.5 ms. T = 10: waits 10.1, 9, 9, 9 and 10.1, 8, 8, 8: median 9
    job = run_events(2, 4, [1.0, 1.0], [2.0, 2.0], latency=0.1, links={0: 10.0}, schedule="gpipe", hosts=HOSTS[:2])
    named = _links(pipeline_findings(job))
    assert len(named) == 1 and named[0].severity == "problem"
    assert named[0].what.startswith("the link between stage 0 (host rp-host-a) and stage 1 (host rp-host-b) is slow: "
                                    "its messages wait 9.0 ms each (median), 6.0x a typical pass of the stages")
    # T = 4: waits 4.1, 3, 3, 3 and 4.1, 2, 2, 2: median 3, twice a pass
    under = run_events(2, 4, [1.0, 1.0], [2.0, 2.0], latency=0.1, links={0: 4.0}, schedule="gpipe", hosts=HOSTS[:2])
    assert _links(pipeline_findings(under)) == []


def test_the_only_link_on_hosts_short_of_cores_is_information_and_on_one_such_host_not_named():
    """With one link there is no other to tell a slow link from receivers waiting for a core."""
    job = run_events(2, 4, [1.0, 1.0], [2.0, 2.0], latency=0.1, links={0: 10.0}, schedule="gpipe", hosts=HOSTS[:2])
    job.ranks[1].info.update(loadavg=9.0, cpu_count=2)
    named = _links(pipeline_findings(job))
    assert [f.severity for f in named] == ["info"]
    assert "rp-host-b ran a load average of 9.0 on 2 CPUs" in named[0].evidence
    three = run_events(3, 4, [1.0] * 3, [2.0] * 3, latency=0.1, links={1: 5.0}, schedule="gpipe", hosts=HOSTS[:3])
    for r in three.ranks:
        r.info.update(loadavg=9.0, cpu_count=2)
    assert [f.severity for f in _links(pipeline_findings(three))] == ["problem"]  # compared with the other link
    # both stages on one busy host: no network between them; the link is not named
    one = run_events(2, 4, [1.0, 1.0], [2.0, 2.0], latency=0.1, links={0: 10.0}, schedule="gpipe")
    one.ranks[0].info.update(loadavg=9.0, cpu_count=2)
    assert _links(pipeline_findings(one)) == []
    assert "waits on the links between stages per step: stage 0 and stage 1" in pipeline_findings(one)[0].evidence


def test_on_one_host_the_link_is_named_by_its_stages_only():
    job = run_events(3, 4, [1.0] * 3, [2.0] * 3, latency=0.1, links={0: 5.0}, schedule="gpipe")
    named = _links(pipeline_findings(job))
    assert [f.what.split(" is slow")[0] for f in named] == ["the link between stage 0 and stage 1"]
    assert named[0].hosts == ()


def test_interleaved_boundaries_are_grouped_by_the_rank_pair_they_cross():
    # virtual stage g is chunk g // p of rank g % p and sends to g + 1
    assert boundaries(3, 1) == {(0, 1): [(0, 0, 1, 0)], (1, 2): [(1, 0, 2, 0)]}
    assert boundaries(3, 2) == {(0, 1): [(0, 0, 1, 0), (0, 1, 1, 1)], (1, 2): [(1, 0, 2, 0), (1, 1, 2, 1)],
                                (0, 2): [(2, 0, 0, 1)]}
    # two ranks: one link, both directions
    assert boundaries(2, 2) == {(0, 1): [(0, 0, 1, 0), (1, 0, 0, 1), (0, 1, 1, 1)]}


def test_the_doctors_json_holds_every_links_figures_and_marks_the_slow_one(tmp_path, capsys):
    job = run_events(3, 4, [1.0] * 3, [2.0] * 3, latency=0.1, links={1: 5.0}, schedule="gpipe", hosts=HOSTS[:3])
    pipe = doctor_json(job, tmp_path, capsys)["pipeline"]
    assert (pipe["schedule"], pipe["per"], pipe["stages"], pipe["microbatches"]) == ("gpipe", "step", 3, 4)
    links = pipe["links"]
    assert [(x["up"], x["down"], x["up_host"], x["down_host"], x["slow"]) for x in links] == \
        [(0, 1, "rp-host-a", "rp-host-b", False), (1, 2, "rp-host-b", "rp-host-c", True)]
    acts, grads = [5.1, 4.0, 4.0, 4.0], [5.1, 3.0, 3.0, 3.0]  # as in the first test: T + latency, then T - f (T - b)
    assert links[1]["activations_s"] * 1e3 == pytest.approx(sum(acts), abs=1e-3)
    assert links[1]["gradients_s"] * 1e3 == pytest.approx(sum(grads), abs=1e-3)
    assert links[1]["total_s"] * 1e3 == pytest.approx(sum(acts) + sum(grads), abs=1e-3)
    assert links[1]["message_s"] * 1e3 == pytest.approx(4.0, abs=1e-3)
    assert links[0]["total_s"] * 1e3 == pytest.approx(0.1 + 4 * 0.1, abs=1e-3)
    assert [row["forward_s"] * 1e3 for row in pipe["per_stage"]] == pytest.approx([1.0] * 3)


@pytest.mark.parametrize("p", [3, 4])
def test_a_host_whose_links_to_both_neighbours_are_slow_is_named_once_instead_of_its_links(p):
    """Host b's network slow: the links of stage 1 to stages 0 and 2 both slow, each as slow as the other."""
    job = run_events(p, 4, [F] * p, [B] * p, latency=LAT, links={0: T, 1: T}, schedule="gpipe", hosts=HOSTS[:p])
    b = breakdown(job)
    got = {(x.up, x.down): x for x in b.links}
    message = sum(SLOW_MESSAGE) / 2
    for pair in ((0, 1), (1, 2)):
        assert got[pair].message * 1e3 == pytest.approx(message, abs=1e-3)
        assert got[pair].total * 1e3 == pytest.approx(sum(SLOW_ACTS) + sum(SLOW_GRADS), abs=1e-3)
    # the old rule alone (each against the other links' median) names neither: 1x on 3 stages, under 3x on 4
    others = [(x.message, statistics.median(y.message for y in b.links if y is not x)) for x in b.links[:2]]
    assert all(m < LINK_RATIO * o for m, o in others)
    slow = slow_links(b.links, b.measured, PASS * 1e-3)
    assert [(s.link.up, s.link.down) for s in slow] == [(0, 1), (1, 2)] and slow_stage(slow) == 1
    # (1, 2) shares a stage with every other link: it is compared with a pass, 7 / 1.5 = 4.7x
    assert (slow[1].against, slow[1].ratio) == ("pass", pytest.approx(message / PASS))
    if p == 4:  # (0, 1) with (2, 3), the link that shares no stage with it: its messages wait the latency
        assert got[(2, 3)].message * 1e3 == pytest.approx(LAT, abs=1e-3)
        assert (slow[0].against, slow[0].ratio) == ("apart", pytest.approx(message / LAT))
    found = pipeline_findings(job)
    assert _links(found) == [], _links(found)
    named = _hosts(found)
    assert len(named) == 1 and named[0].severity == "problem" and named[0].hosts == ("rp-host-b",)
    assert named[0].what.startswith("host rp-host-b's links to both neighbours are slow: the link between stage 0 "
                                    "(host rp-host-a) and stage 1 (host rp-host-b): its messages wait 7.0 ms each")
    assert f"{message / PASS:.1f}x a typical pass of the stages" in named[0].what
    assert "check host rp-host-b's network" in named[0].fix and "`tc qdisc show`" in named[0].fix
    assert "place stage 1 on another host" in named[0].fix


def test_a_slow_host_on_hosts_short_of_cores_is_information_when_a_link_was_compared_with_a_pass():
    job = run_events(3, 4, [F] * 3, [B] * 3, latency=LAT, links={0: T, 1: T}, schedule="gpipe", hosts=HOSTS[:3])
    job.ranks[1].info.update(loadavg=9.0, cpu_count=2)
    named = _hosts(pipeline_findings(job))
    assert [f.severity for f in named] == ["info"]
    assert "rp-host-b ran a load average of 9.0 on 2 CPUs" in named[0].evidence


def test_a_link_three_times_faster_than_its_slow_neighbour_is_not_named_against_a_pass():
    """One slow link of three stages: its neighbour, though its waits read 3 passes, is the fair one of the two."""
    job = run_events(3, 4, [F] * 3, [B] * 3, latency=LAT, links={0: 6.0, 1: 30.0}, schedule="gpipe", hosts=HOSTS[:3])
    b = breakdown(job)
    fair, slow = b.links
    assert fair.message >= LINK_RATIO * PASS * 1e-3 and slow.message >= LINK_RATIO * fair.message
    found = pipeline_findings(job)
    assert _hosts(found) == []
    assert [f.what.split(" is slow")[0] for f in _links(found)] == [
        "the link between stage 1 (host rp-host-b) and stage 2 (host rp-host-c)"]
    assert "x the other links'" in _links(found)[0].what


def test_two_slow_links_that_share_no_stage_are_each_named():
    """Four stages, links 0-1 and 2-3 slow: each compared with the other (as slow) would not be named; with a pass,
    both are, as links (they share no stage, so no host is common to them)."""
    job = run_events(4, 4, [F] * 4, [B] * 4, latency=LAT, links={0: T, 2: T}, schedule="gpipe", hosts=HOSTS)
    found = pipeline_findings(job)
    assert _hosts(found) == []
    assert [f.what.split(" is slow")[0] for f in _links(found)] == [
        "the link between stage 0 (host rp-host-a) and stage 1 (host rp-host-b)",
        "the link between stage 2 (host rp-host-c) and stage 3 (host rp-host-d)"]
    assert all(f"{sum(SLOW_MESSAGE) / 2 / PASS:.1f}x a typical pass" in f.what for f in _links(found))


def test_the_doctors_json_names_the_slow_host(tmp_path, capsys):
    job = run_events(3, 4, [F] * 3, [B] * 3, latency=LAT, links={0: T, 1: T}, schedule="gpipe", hosts=HOSTS[:3])
    pipe = doctor_json(job, tmp_path, capsys)["pipeline"]
    assert [x["slow"] for x in pipe["links"]] == [True, True]
    assert pipe["slow_hosts"] == [{"host": "rp-host-b", "stage": 1}]
    one = run_events(3, 4, [F] * 3, [B] * 3, latency=LAT, links={1: 5.0}, schedule="gpipe", hosts=HOSTS[:3])
    assert doctor_json(one, tmp_path, capsys)["pipeline"]["slow_hosts"] == []


def test_on_hosts_short_of_cores_a_link_must_wait_a_pass_longer_than_the_others_to_be_named():
    """A receiver waiting for a core after its message arrived waits about a pass: on crowded hosts a link whose
    messages wait less than a pass longer than the other links' is not named, however many times theirs."""
    # T = 2.5: activations wait 2.6, 1.5, 1.5, 1.5, gradients 2.6, 0.5, 0.5, 0.5: median 1.5 ms against 0.1
    near = run_events(3, 4, [F] * 3, [B] * 3, latency=LAT, links={1: 2.5}, schedule="gpipe", hosts=HOSTS[:3])
    b = breakdown(near)
    assert b.links[1].message * 1e3 == pytest.approx(1.5, abs=1e-3) and b.links[0].message * 1e3 == pytest.approx(LAT)
    assert [(s.link.up, s.against) for s in slow_links(b.links, b.measured, PASS * 1e-3)] == [(1, "links")]
    assert slow_links(b.links, b.measured, PASS * 1e-3, crowded=True) == []  # 1.4 ms more than the other: < 1.5
    for r in near.ranks:  # three namespace hosts of one 2-CPU machine: crowded
        r.info.update(machine="boot-1", cpus=[0, 1], cpu_count=2, loadavg=0.5)
    assert _links(pipeline_findings(near)) == []
    # T = 5: 4.0 ms a message, 3.9 more than the other link's, over a pass: named on crowded hosts too
    far = run_events(3, 4, [F] * 3, [B] * 3, latency=LAT, links={1: 5.0}, schedule="gpipe", hosts=HOSTS[:3])
    for r in far.ranks:
        r.info.update(machine="boot-1", cpus=[0, 1], cpu_count=2, loadavg=0.5)
    named = _links(pipeline_findings(far))
    assert [(f.severity, f.hosts) for f in named] == [("problem", ("rp-host-b", "rp-host-c"))]


def test_median_or_zero_is_the_middle_value_the_mean_of_the_middle_two_and_zero_for_nothing():
    assert median_or_zero([5.0, 1.0, 3.0]) == 3.0  # sorted 1, 3, 5: the middle one
    assert median_or_zero([4.0, 1.0, 3.0, 2.0]) == 2.5  # sorted 1, 2, 3, 4: (2 + 3) / 2
    assert median_or_zero([]) == 0.0  # nothing measured: a figure of zero, not statistics' error


def test_the_streams_message_figure_leaves_out_a_few_long_waits_but_not_a_slow_links_share():
    # a fair link: 19 of 20 messages wait 0.1 ms, one waited 70 ms for a core on a crowded host
    fair = [0.1] * 19 + [70.0]
    assert trimmed_mean(fair) == pytest.approx(0.1) and statistics.fmean(fair) > 3.5
    # a slow link in the stream: half of its messages find the receiver idle and wait the whole 12 ms, half none;
    # the longest tenth of all left out, the rest's mean: 8 of 18 wait 12 ms
    slow = [0.0] * 10 + [12.0] * 10
    assert trimmed_mean(slow) == pytest.approx(8 / 18 * 12.0)
    assert trimmed_mean([]) == 0.0 and trimmed_mean([5.0]) == 5.0
