"""The time a schedule implies, and its bubble, against the papers' formulas written here.

Costs in units of a whole stage's forward ``tF = 1``. GPipe and 1F1B (Huang et al. 2019;
Narayanan et al. 2021) idle ``(p - 1) * (tF + tB)`` per step, a ratio ``(p - 1) / m`` of the
ideal time ``m * (tF + tB)``; interleaved 1F1B with ``v`` chunks per rank ``(p - 1) / (v * m)``
(Narayanan et al. 2021, section 2.2.2); ZB-H1 idles ``(p - 1) * (tF + tB - tW)`` (Qi et al. 2024,
section 2.1), where 1F1B idles ``(p - 1) * (tF + tB + tW)`` with the backward split into an
input-gradient pass ``tB`` and a weight-gradient pass ``tW``. ZB-H2 (same paper, section 3.1)
idles ``(p - 1) * (tF + tB - 2 tW)`` per step from one step to the next, nothing with equal
passes: its steps tile (a stage steps on its own, so the next step's forwards start as soon as
the first stage is done), which is measured here on several consecutive steps.
"""

import pytest

from ringpipe.pipeline.schedules import Action, get_schedule, parse
from ringpipe.pipeline.simulator import bubble_fraction, simulate_timing

SHAPES = [(2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 16), (8, 16)]


def per_stage(name, p, m, **kw):
    return [get_schedule(name)(p, m, s, **kw) for s in range(p)]


@pytest.mark.parametrize(("p", "m"), SHAPES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(name, p, m):
    t = simulate_timing(per_stage(name, p, m), forward=1, backward_input=1, backward_weight=1)
    assert t.makespan == pytest.approx((m + p - 1) * 3)
    assert t.bubble_ratio == pytest.approx((p - 1) / m)
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m"), SHAPES)
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_is_1f1b_bubble_over_v(p, m, v):
    t = simulate_timing(per_stage("interleaved_1f1b", p, m, chunks=v), forward=1, backward_input=1, backward_weight=1)
    assert t.bubble_ratio == pytest.approx((p - 1) / (v * m))
    ofob = simulate_timing(per_stage("1f1b", p, m), forward=1, backward_input=1, backward_weight=1)
    assert t.bubble_ratio == pytest.approx(ofob.bubble_ratio / v)


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_zb_h1_bubble_is_p_minus_1_times_tf_plus_tb_minus_tw(p, m):
    tf = tb = tw = 1.0
    t = simulate_timing(per_stage("zb_h1", p, m), forward=tf, backward_input=tb, backward_weight=tw)
    assert t.makespan - m * (tf + tb + tw) == pytest.approx((p - 1) * (tf + tb - tw))
    assert t.bubble_ratio == pytest.approx((p - 1) / (3 * m))  # the paper's "(p-1)/3m" for equal passes
    ofob = simulate_timing(per_stage("1f1b", p, m), forward=tf, backward_input=tb, backward_weight=tw)
    assert ofob.makespan - m * (tf + tb + tw) == pytest.approx((p - 1) * (tf + tb + tw))


def test_zb_h1_with_unequal_passes_beats_1f1b():
    # tB > tW: the formula's (p - 1)(tF + tB - tW) is a lower bound the hand-made order need not reach;
    # it still idles less than 1F1B's (p - 1)(tF + tB + tW)
    p, m = 4, 8
    zb = simulate_timing(per_stage("zb_h1", p, m), forward=1, backward_input=1.2, backward_weight=0.8)
    ofob = simulate_timing(per_stage("1f1b", p, m), forward=1, backward_input=1.2, backward_weight=0.8)
    work = m * 3.0
    assert (p - 1) * (1 + 1.2 - 0.8) - 1e-9 <= zb.makespan - work < ofob.makespan - work
    assert ofob.makespan - work == pytest.approx((p - 1) * 3.0)


def test_single_stage_has_no_bubble_and_latency_adds_to_it():
    assert bubble_fraction(per_stage("1f1b", 1, 4)) == 0
    assert bubble_fraction(per_stage("zb_h1", 1, 4)) == 0
    # one micro-batch crosses the boundary twice (forward, backward): 1 + 0.5 + 1 + 2 + 0.5 + 2
    assert simulate_timing(per_stage("seq", 2, 1), latency=0.5).makespan == pytest.approx(7.0)
    assert simulate_timing(per_stage("1f1b", 2, 4), latency=0.5).bubble_ratio > simulate_timing(
        per_stage("1f1b", 2, 4)).bubble_ratio


def test_spans_follow_dependencies():
    t = simulate_timing([parse("F0 B0 S"), parse("F0 B0 S")], forward=1, backward_input=1, backward_weight=1)
    (f0, s0, e0), (b0, sb, eb), _ = t.spans[0]
    assert (s0, e0) == (0, 1) and (sb, eb) == (4, 6)  # stage 1 runs F0 over [1, 2], B0 over [2, 4]
    assert t.makespan == 6 and t.busy == (3, 3)


def steps(per_stage_lists, m, k):
    """``k`` consecutive steps of a schedule, micro-batches of step ``i`` numbered ``i * m + mb``."""
    return [[Action(a.kind, a.mb + i * m if a.kind != "S" else -1, a.chunk) for i in range(k) for a in acts]
            for acts in per_stage_lists]


def period(name, p, m, **costs):
    """Time one more step adds to a run of consecutive steps (the steady state)."""
    ps = per_stage(name, p, m)
    t3, t4 = (simulate_timing(steps(ps, m, k), **costs).makespan for k in (3, 4))
    return t4 - t3


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16), (8, 16)])
def test_zb_h2_steady_state_has_the_papers_bubble(p, m):
    tf = tb = tw = 1.0
    assert m >= 2 * p - 1
    # the paper's (p - 1)(tF + tB - 2 tW): no idle time at all from step to step
    assert period("zb_h2", p, m, forward=tf, backward_input=tb, backward_weight=tw) == pytest.approx(
        m * (tf + tb + tw) + (p - 1) * max(0.0, tf + tb - 2 * tw))
    # ZB-H1 steps do not tile (its first stage ends last): (p - 1)(tF + tB - tW) every step
    assert period("zb_h1", p, m, forward=tf, backward_input=tb, backward_weight=tw) == pytest.approx(
        m * (tf + tb + tw) + (p - 1) * (tf + tb - tw))
    # one step alone idles as ZB-H1 does: the parallelogram's ends
    one = simulate_timing(per_stage("zb_h2", p, m), forward=tf, backward_input=tb, backward_weight=tw)
    assert one.makespan == pytest.approx(m * (tf + tb + tw) + (p - 1) * (tf + tb - tw))


def test_zb_h2_with_too_few_microbatches_keeps_zb_h1s_bubble():
    p, m = 4, 4  # fewer than 2p - 1: the warm-up cannot fill the gap
    assert period("zb_h2", p, m, forward=1, backward_input=1, backward_weight=1) <= period(
        "zb_h1", p, m, forward=1, backward_input=1, backward_weight=1)
