"""Mitigation names: what composes, and the errors for what does not."""

from __future__ import annotations

import itertools

import pytest
import torch

from ringpipe.pipeline.policy import WeightPolicy
from ringpipe.pipeline.staleness import (
    MitigationPolicy,
    WeightStash,
    make_policy,
    parse_mitigations,
)


def _sgd():
    p = torch.nn.Parameter(torch.zeros(2))
    return [p], torch.optim.SGD([p], lr=0.1, momentum=0.9)


def test_wp_resolves_by_step_every():
    assert parse_mitigations("wp", 1) == {"msnag"}
    assert parse_mitigations("wp+ws", 4) == {"aggmsnag", "ws"}
    assert parse_mitigations(["ws", "ga"]) == {"ws", "ga"}
    assert parse_mitigations(" WP, ws ") == {"msnag", "ws"}


def test_every_meaningful_combination_composes():
    params, opt = _sgd()
    for wp, ws, ga in itertools.product(["", "wp"], ["", "ws"], ["", "ga", "ga_jfl"]):
        names = [n for n in (wp, ws, ga) if n]
        if not names or (ga == "ga_jfl" and not ws):
            continue
        for step_every in (1, 3):
            if ga == "ga" and not ws and step_every == 1:  # stage 0 of 3 has staleness 2
                with pytest.raises(ValueError, match="stage 0 of 3 has staleness up to 2"):
                    make_policy("+".join(names), params, opt, stage=0, num_stages=3, recompute=True)
                continue
            pol = make_policy("+".join(names), params, opt, stage=0, num_stages=3,
                              step_every=step_every, recompute=True)
            assert isinstance(pol, MitigationPolicy), names
            assert (pol.predictor is not None) == bool(wp)
            assert (pol.stash is not None) == bool(ws)
            assert (pol.gap_aware is not None) == bool(ga)
            assert pol.uses_recompute() == (ga == "ga_jfl")
            if wp:
                assert pol.predictor.aggregate == (step_every > 1)
    stale = make_policy("stale", params, opt, stage=0, num_stages=3)
    assert type(stale) is WeightPolicy


def test_ga_stage_policy_limits_gap_aware_to_chosen_stages():
    params, opt = _sgd()
    on = [make_policy("ws+ga", params, opt, stage=s, num_stages=4, ga_stages="almost_last_partition")
          .gap_aware is not None for s in range(4)]
    assert on == [False, False, True, False]


@pytest.mark.parametrize(
    ("names", "kwargs", "match"),
    [
        ("sgd", {}, r"unknown staleness mitigation 'sgd'; valid names: stale, ws, wp"),
        ("", {}, "no staleness mitigation given"),
        ("stale+ws", {}, "'stale' means no mitigation"),
        ("ws+ws", {}, "repeat"),
        ("wp+msnag", {}, "choose one weight predictor"),
        ("ws+ga+ga_jfl", {"recompute": True}, "choose one"),
        ("ga_jfl", {"recompute": True}, "add 'ws'"),
        ("ws+ga_jfl", {"recompute": False}, "recompute=True"),
        ("aggmsnag", {}, "step_every > 1"),
    ],
)
def test_nonsense_combinations_raise(names, kwargs, match):
    params, opt = _sgd()
    with pytest.raises(ValueError, match=match):
        make_policy(names, params, opt, stage=0, num_stages=2, **kwargs)


def test_optimizer_and_stage_errors():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="RMSprop.*supported: torch.optim.SGD"):
        make_policy("wp", [p], torch.optim.RMSprop([p]), stage=0, num_stages=2)
    with pytest.raises(ValueError, match="add 'ws'"):
        make_policy("ga", [p], torch.optim.Adam([p]), stage=0, num_stages=2)
    with pytest.raises(ValueError, match="maximize"):
        make_policy("wp", [p], torch.optim.SGD([p], lr=0.1, maximize=True), stage=0, num_stages=2)
    with pytest.raises(ValueError, match=r"stage 2 is not in \[0, num_stages=2\)"):
        make_policy("ws", [p], torch.optim.SGD([p], lr=0.1), stage=2, num_stages=2)
    other = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=r"not in the optimizer's param groups"):
        make_policy("wp", [other], torch.optim.SGD([p], lr=0.1), stage=0, num_stages=2)
    assert make_policy("stale", [p], torch.optim.RMSprop([p]), stage=0, num_stages=2).__class__ is WeightPolicy


@pytest.mark.parametrize("names", ["ws+ga_jfl", "wp+ws+ga_jfl"])
def test_ga_jfl_backward_runs_on_current_weights_on_every_stage(names):
    """ga_jfl never switches to weight stashing: outside ga_stages there is just no gap to measure."""
    for stage in range(4):
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        pol = make_policy(names, [p], opt, stage=stage, num_stages=4, ga_stages="almost_last_partition",
                          recompute=True)
        assert pol.just_for_loss and pol.uses_recompute()
        gap_here = stage == 2
        assert (pol.gap_aware is not None) == gap_here
        assert (pol.stash is not None) == gap_here  # the stash only sizes the gap
        pol.before_forward(1, 3 - stage)
        pol.after_forward(1)
        with torch.no_grad():
            p.sub_(0.5)  # a step between forward and backward
        pol.before_backward(1)
        assert torch.equal(p.detach(), torch.full((2,), 0.5)), stage  # current weights, not a stash
        pol.after_backward(1)
        assert pol.stash_count == 0


def test_ga_jfl_policy_needs_stash_and_gap_together():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="both a weight stash and a Gap Aware object, or neither"):
        MitigationPolicy(stash=WeightStash([p]), just_for_loss=True)
    assert MitigationPolicy(just_for_loss=True).stash is None


def test_gap_aware_without_a_stash_is_refused_beyond_staleness_1():
    """``Gap = eta |g|`` is the gap of staleness 1: deeper stages must stash, and the error says so."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    # 4 stages, step_every=2: stage 0 has depth 3, staleness up to 2; stage 1 depth 2, staleness 1
    with pytest.raises(ValueError, match=r"stage 0 of 4 has staleness up to 2 \(step_every=2\).*Add 'ws'"):
        make_policy("ga", [p], opt, stage=0, num_stages=4, step_every=2)
    assert make_policy("ga", [p], opt, stage=1, num_stages=4, step_every=2).gap_aware is not None
    assert make_policy("ws+ga", [p], opt, stage=0, num_stages=4).gap_aware is not None
    assert make_policy("ga", [p], opt, stage=0, num_stages=4, ga_stages="almost_last_partition").gap_aware is None
    # a policy built by hand still refuses a micro-batch it cannot penalise correctly
    pol = make_policy("ga", [p], opt, stage=1, num_stages=4, step_every=2)
    with pytest.raises(ValueError, match="stage 1: micro-batch 5 has staleness 2.*add 'ws'"):
        pol.before_forward(5, 2)


def test_a_mirror_is_stashed_but_never_predicted():
    # a stage's own weight and the mirror of a tied weight owned by an earlier stage: the mirror gets no
    # gradient at the step (the owner steps it), so its optimizer keeps no state for it, and prediction,
    # which decays it with weight decay even without momentum, must leave it as received
    own, mirror = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([own, mirror], lr=0.1, momentum=0.9, weight_decay=0.01)
    policy = make_policy("wp+ws", [own, mirror], opt, stage=0, num_stages=3, mirrors=[mirror])
    own.grad = torch.ones(2)
    opt.step()
    assert mirror not in opt.state or not opt.state[mirror]
    before_own, before_mirror = own.detach().clone(), mirror.detach().clone()
    policy.before_forward(0, 2)
    assert not torch.equal(own.detach(), before_own)  # predicted two steps ahead
    assert torch.equal(mirror.detach(), before_mirror)  # as received
    policy.after_forward(0)
    with torch.no_grad():
        mirror.copy_(torch.full((2,), 5.0))  # the owner's update lands on the current weights
    policy.before_backward(0)
    assert torch.equal(mirror.detach(), before_mirror)  # the stash: the mirror the forward used
    policy.after_backward(0)
    assert torch.equal(mirror.detach(), torch.full((2,), 5.0))  # and the update is back, not undone
