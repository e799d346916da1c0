"""Gap Aware penalties and weight stashing on hand-made tensors."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from ringpipe.pipeline.staleness import (
    AdamGapAware,
    SGDGapAware,
    WeightStash,
    gap_aware_stages,
    make_policy,
)


@pytest.fixture(autouse=True)
def _float64():
    """Exact comparisons in double precision; the default dtype is restored afterwards."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _param(values):
    return torch.nn.Parameter(torch.tensor(values))


def test_sgd_running_stats_penalty_and_weight_decay_correction():
    p = _param([1.0, -2.0, 0.5])
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    ga = SGDGapAware([p], opt, big_gamma=0.99, eps=1e-8)
    assert not ga.ready
    p.grad = torch.tensor([1.0, 1.0, 1.0])
    assert ga.apply_gap([torch.ones(3)]) == [] and torch.equal(p.grad, torch.ones(3))  # not ready
    opt.step()
    ga.update_running_stats()
    v = opt.state[p]["momentum_buffer"]
    ra = 0.01 * v**2
    torch.testing.assert_close(ga.running[0], ra)
    c = 0.1 * ((ra / (1 - 0.99)).sqrt() + 1e-8)  # C = eta_max (sqrt(ra / (1 - gamma_b^1)) + eps)
    torch.testing.assert_close(ga.constants()[0], c)

    theta = p.detach().clone()
    stashed = theta - torch.tensor([0.2, 0.0, -0.05])
    g = torch.tensor([0.3, -0.4, 2.0])
    p.grad = g.clone()
    (pen,) = ga.apply_on_stashed([stashed])
    expected_pen = 1 + (theta - stashed).abs() / c
    torch.testing.assert_close(pen, expected_pen)
    assert pen[1] == 1.0  # no gap, no penalty
    torch.testing.assert_close(p.grad, g / expected_pen + theta * 0.01 * (1 - expected_pen) / expected_pen)
    # the optimizer's own +lambda*theta is thereby divided by the penalty too
    torch.testing.assert_close(p.grad + 0.01 * theta, (g + 0.01 * theta) / expected_pen)


def test_sgd_apply_from_grad_and_on_theta():
    p = _param([1.0, 2.0])
    opt = torch.optim.SGD([p], lr=0.5)
    ga = SGDGapAware([p], opt)
    p.grad = torch.tensor([0.2, -0.4])
    opt.step()
    ga.update_running_stats()  # without momentum, ra tracks g^2
    torch.testing.assert_close(ga.running[0], 0.001 * torch.tensor([0.04, 0.16]))
    c = ga.constants()[0]
    g = torch.tensor([1.0, -3.0])
    p.grad = g.clone()
    (pen,) = ga.apply_from_grad()
    torch.testing.assert_close(pen, 1 + 0.5 * g.abs() / c)  # Gap = eta |g|
    torch.testing.assert_close(p.grad, g / pen)
    real = [p.detach() + torch.tensor([0.1, 0.1])]
    p.grad = g.clone()
    (pen2,) = ga.apply_on_theta(real)
    torch.testing.assert_close(pen2, 1 + 0.1 / c)


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_running_stats_and_penalty(decoupled):
    p = _param([0.5, -1.0, 2.0])
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([p], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    ga = AdamGapAware([p], opt)
    e = torch.zeros(3)
    for _ in range(2):
        p.grad = torch.tensor([0.3, -0.2, 0.1])
        opt.step()
        ga.update_running_stats()
        st = opt.state[p]
        t = int(st["step"])
        step = 0.01 / (1 - 0.9**t) * st["exp_avg"] / (st["exp_avg_sq"].sqrt() / math.sqrt(1 - 0.99**t) + 1e-8)
        e = 0.99 * e + 0.01 * step**2
    torch.testing.assert_close(ga.running[0], e)
    c = e.sqrt() + 1e-8
    theta = p.detach().clone()
    stashed = theta + torch.tensor([0.001, 0.0, -0.02])
    g = torch.tensor([1.0, 1.0, 1.0])
    p.grad = g.clone()
    (pen,) = ga.apply_on_stashed([stashed])
    torch.testing.assert_close(pen, 1 + (theta - stashed).abs() / c)
    corr = 0 if decoupled else theta * 0.1 * (1 - pen) / pen  # AdamW's decay is not in the gradient
    torch.testing.assert_close(p.grad, g / pen + corr)
    with pytest.raises(ValueError, match="SGD only"):
        ga.apply_from_grad()


def test_gap_aware_stage_policies():
    assert gap_aware_stages("almost_last_partition", 4) == {2}
    assert gap_aware_stages("all_except_last", 4) == {0, 1, 2}
    assert gap_aware_stages("all_except_last_two", 4) == {0, 1}
    assert gap_aware_stages("almost_last_partition", 1) == set()
    with pytest.raises(ValueError, match="all_except_last_two"):
        gap_aware_stages("first", 4)


def _refs(tensors):
    return [weakref.ref(t) for t in tensors]


def _alive(refs):
    """How many of the referenced tensors are still alive (after a garbage collection)."""
    gc.collect()
    return sum(r() is not None for r in refs)


def test_stash_is_a_copy_and_memory_returns_to_zero():
    p, q = _param([1.0, 2.0]), _param([[3.0]])
    stash = WeightStash([p, q])
    stash.stash(0)
    with torch.no_grad():
        p.add_(10.0)
    stash.stash(1)
    assert len(stash) == 2 and stash.nbytes == 2 * 3 * 8
    clones = _refs(stash.get(0)) + _refs(stash.get(1))
    torch.testing.assert_close(stash.get(0)[0], torch.tensor([1.0, 2.0]))
    stash.load(0)
    true_copies = _refs(stash._true)  # the true weights kept aside while the stash is loaded
    torch.testing.assert_close(p.detach(), torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(stash.gap(0)[0], torch.tensor([10.0, 10.0]))  # vs the true weights
    stash.restore()
    torch.testing.assert_close(p.detach(), torch.tensor([11.0, 12.0]))
    assert _alive(true_copies) == 0  # restore drops the copy of the true weights
    assert _alive(clones) == 4  # still held by the stash
    stash.pop(0)
    stash.pop(1)
    assert len(stash) == 0 and stash.nbytes == 0
    assert _alive(clones) == 0  # the clones themselves are freed, not just unaccounted
    with pytest.raises(KeyError, match="no stash for 0"):
        stash.load(0)


def test_ws_policy_hooks_stash_only_stale_microbatches():
    p = _param([1.0])
    opt = torch.optim.SGD([p], lr=1.0)
    pol = make_policy("ws", [p], opt, stage=0, num_stages=3)
    pol.before_forward(0, 0)
    pol.after_forward(0)
    assert pol.stash_count == 0  # d = 0: nothing to stash
    pol.before_forward(1, 2)
    pol.after_forward(1)
    assert pol.stash_count == 1 and pol.stashed_bytes == 8
    clones = _refs(pol.stash.get(1))
    with torch.no_grad():
        p.sub_(0.5)  # a step taken in between
    pol.before_backward(1)
    assert p.item() == 1.0  # backward sees the forward's weights
    pol.after_backward(1)
    assert p.item() == 0.5 and pol.stash_count == 0 and pol.stashed_bytes == 0
    assert _alive(clones) == 0  # the consumed stash is freed


def test_wp_ws_stashes_the_predicted_weights():
    p = _param([1.0])
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.5)
    p.grad = torch.tensor([1.0])
    opt.step()  # v = 1, p = 0.9
    p.grad = None
    pol = make_policy("wp+ws", [p], opt, stage=0, num_stages=2)
    pol.before_forward(7, 1)
    assert p.item() == pytest.approx(0.9 - 0.1 * 0.5)  # predicted during forward
    pol.after_forward(7)
    assert p.item() == pytest.approx(0.9)
    pol.before_backward(7)
    assert p.item() == pytest.approx(0.85)  # the stash holds the predicted weights, not a reference
    pol.after_backward(7)
    assert p.item() == pytest.approx(0.9) and pol.stash_count == 0


def test_one_stash_serves_every_microbatch_of_a_step():
    """step_every=2: micro-batches 2 and 3 form one step; the stash taken by 2 serves 3 as well."""
    p = _param([1.0])
    opt = torch.optim.SGD([p], lr=1.0)
    pol = make_policy("ws", [p], opt, stage=0, num_stages=2, step_every=2)
    seen = []
    pol.before_forward(2, 1)  # stale: stashes the weights 1.0 for its step
    seen.append(p.item())
    pol.after_forward(2)
    with torch.no_grad():
        p.sub_(0.5)  # the step closing micro-batches 0 and 1
    pol.before_forward(3, 0)  # same step: runs on the stash, not on the newer weights
    seen.append(p.item())
    pol.after_forward(3)
    assert seen == [1.0, 1.0] and p.item() == 0.5
    assert pol.stash_count == 1 and pol.stashed_bytes == 8  # one stash for the step
    clones = _refs(pol.stash.get(1))
    for mb in (2, 3):
        pol.before_backward(mb)
        assert p.item() == 1.0  # both backwards on the step's weights
        pol.after_backward(mb)
        assert p.item() == 0.5
        assert _alive(clones) == (1 if mb == 2 else 0)  # kept for micro-batch 3, then freed
    assert pol.stash_count == 0  # released once the whole step is done
    # a shorter last group is released by its step
    pol.before_forward(4, 1)
    pol.after_forward(4)
    clones = _refs(pol.stash.get(2))
    pol.before_backward(4)
    pol.after_backward(4)
    assert pol.stash_count == 1 and _alive(clones) == 1
    pol.before_step()
    opt.step()
    pol.after_step()
    assert pol.stash_count == 0 and _alive(clones) == 0
