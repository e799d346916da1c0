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
    SutskeverSGD,
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


def test_sutskever_gap_aware_counts_the_learning_rate_once():
    """The Sutskever velocity already holds the rate: ``C = rms(v) + eta_max eps``, which at a
    constant rate equals the PyTorch form's ``eta_max (rms(v) + eps)``, and so do the penalties."""
    lr, gap, g = 0.05, torch.tensor([0.02, 0.002]), torch.tensor([0.3, -0.7])
    pens = {}
    for cls in (torch.optim.SGD, SutskeverSGD):
        p = _param([1.0, -1.0])
        opt = cls([p], lr=lr, momentum=0.9)
        ga = SGDGapAware([p], opt)
        for _ in range(3):
            p.grad = g.clone()
            opt.step()
            ga.update_running_stats()
        v = opt.state[p]["momentum_buffer"]
        # PyTorch-form buffers after steps 1..3: g (1 + 0.9 + ... + 0.9^(k-1))
        ra = sum(0.001 * 0.999 ** (2 - k) * ((1 - 0.9 ** (k + 1)) / 0.1 * g) ** 2 for k in range(3))
        rms = (ra / (1 - 0.999**3)).sqrt()
        if cls is SutskeverSGD:
            torch.testing.assert_close(v, lr * (1 - 0.9**3) / 0.1 * g)  # v_s = eta v_pytorch
            torch.testing.assert_close(ga.constants()[0], lr * rms + lr * 1e-8)
        else:
            torch.testing.assert_close(ga.constants()[0], lr * (rms + 1e-8))
        p.grad = g.clone()
        (pens[cls],) = ga.apply_gap([gap])
    torch.testing.assert_close(pens[SutskeverSGD], pens[torch.optim.SGD])
    torch.testing.assert_close(pens[SutskeverSGD], 1 + gap / (lr * (rms + 1e-8)))


@pytest.mark.parametrize("cls", [torch.optim.SGD, SutskeverSGD])
def test_sgd_gap_aware_leaves_a_group_at_lr_0_alone(cls):
    """A group whose rate has never been positive never moves: no penalty, no NaN."""
    frozen, live = _param([1.0, 2.0]), _param([3.0])
    opt = cls([{"params": [frozen], "lr": 0.0}, {"params": [live]}], lr=0.1, momentum=0.9, weight_decay=0.01)
    ga = SGDGapAware([frozen, live], opt)
    for _ in range(2):
        frozen.grad, live.grad = torch.tensor([0.5, -0.5]), torch.tensor([1.0])
        opt.step()
        ga.update_running_stats()
    frozen.grad, live.grad = torch.tensor([0.5, -0.5]), torch.tensor([1.0])
    pens = ga.apply_from_grad()
    assert torch.equal(pens[0], torch.ones(2)) and float(pens[1]) > 1.0
    assert torch.equal(frozen.grad, torch.tensor([0.5, -0.5]))  # untouched
    opt.step()
    assert torch.equal(frozen.detach(), torch.tensor([1.0, 2.0]))  # finite, unmoved


def test_adam_gap_aware_uses_the_rate_of_the_step_taken():
    """With a warm-up scheduler stepped right after the optimizer, ``C`` still uses the step's own rate."""
    p = _param([0.5, -1.0])
    opt = torch.optim.Adam([p], lr=0.01, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
    pol = make_policy("ws+ga", [p], opt, sched, stage=0, num_stages=2)
    e = torch.zeros(2)
    for _ in range(3):
        used = opt.param_groups[0]["lr"]
        p.grad = torch.tensor([0.3, -0.2])
        pol.before_step()
        opt.step()
        sched.step()
        pol.after_step()
        assert opt.param_groups[0]["lr"] > used  # warm-up: the next rate is larger
        st = opt.state[p]
        t = int(st["step"])
        step = used / (1 - 0.9**t) * st["exp_avg"] / (st["exp_avg_sq"].sqrt() / math.sqrt(1 - 0.99**t) + 1e-8)
        e = 0.99 * e + 0.01 * step**2
    torch.testing.assert_close(pol.gap_aware.running[0], e)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_apply_on_theta_corrects_weight_decay_on_the_real_weights(kind):
    """Stashed weights loaded, real ones given: the optimizer decays the real weights, so the
    correction ``lambda theta (1-pen)/pen`` uses them, making the whole step divided by ``pen``."""
    p = _param([1.0, -2.0])
    lam = 0.1
    opt = (torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=lam) if kind == "sgd"
           else torch.optim.Adam([p], lr=0.1, weight_decay=lam))
    ga = SGDGapAware([p], opt) if kind == "sgd" else AdamGapAware([p], opt)
    p.grad = torch.tensor([0.4, 0.1])
    opt.step()
    ga.update_running_stats()
    real = p.detach().clone()
    with torch.no_grad():
        p.copy_(real + torch.tensor([0.05, -0.3]))  # the stash the gradient was taken on
    g = torch.tensor([1.0, -1.0])
    p.grad = g.clone()
    (pen,) = ga.apply_on_theta([real])
    torch.testing.assert_close(pen, 1 + torch.tensor([0.05, 0.3]) / ga.constants()[0])
    torch.testing.assert_close(p.grad + lam * real, (g + lam * real) / pen)


def test_nag_with_predictor_keeps_the_look_ahead_through_the_backward():
    """At staleness 0 the forward and the backward both run one step ahead, ``theta - eta gamma v``;
    the true weights come back after the backward, before the step."""
    p = _param([1.0])
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.5)
    p.grad = torch.tensor([1.0])
    opt.step()  # v = 1, p = 0.9
    p.grad = None
    for nag, expected in ((True, 0.9 - 0.1 * 0.5), (False, 0.9)):
        pol = make_policy("wp", [p], opt, stage=1, num_stages=2, nag_with_predictor=nag)
        pol.before_forward(0, 0)
        at_forward = p.item()
        pol.after_forward(0)
        assert p.item() == pytest.approx(0.9)
        pol.before_backward(0)
        at_backward = p.item()
        pol.after_backward(0)
        assert (at_forward, at_backward) == (pytest.approx(expected), pytest.approx(expected))
        assert p.item() == pytest.approx(0.9) and pol.stash_count == 0


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
    clones = _refs(pol.stash.get(pol.stash.keys()[0]))
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


def _step(pol, opt, p, delta):
    """An optimizer step between the hooks that moves ``p`` by ``-delta``."""
    pol.before_step()
    with torch.no_grad():
        p.sub_(delta)
    pol.after_step()


def test_stashing_with_step_every_2_follows_each_forwards_own_weights():
    """Stage 0 of 2, step_every=2: ``F0 F1 B0 F2 B1 S F3 B2 F4 B3 S F5 B4 B5 S``, staleness 0 0 1 0 1 0.

    Each forward runs on the weights current at that moment and its backward on the same ones:
    F2 runs on theta_0 (before the first step) and B2 takes its gradient there; F3 runs after
    the step, on theta_1, and so does B3, which is no staler than without stashing. A stash is
    shared only by forwards that saw the same weights (here F4's is its own: a step came first).
    """
    p = _param([1.0])
    opt = torch.optim.SGD([p], lr=1.0)
    pol = make_policy("ws", [p], opt, stage=0, num_stages=2, step_every=2)
    fwd, bwd = {}, {}
    stale = {0: 0, 1: 0, 2: 1, 3: 0, 4: 1, 5: 0}

    def forward(mb):
        pol.before_forward(mb, stale[mb])
        fwd[mb] = p.item()
        pol.after_forward(mb)

    def backward(mb):
        pol.before_backward(mb)
        bwd[mb] = p.item()
        pol.after_backward(mb)
        assert p.item() == true[0]  # the true weights are back after every backward

    true = [1.0]
    for ev in ["F0", "F1", "B0", "F2", "B1", "S", "F3", "B2", "F4", "B3", "S", "F5", "B4", "B5", "S"]:
        if ev == "S":
            _step(pol, opt, p, 0.5)
            true[0] = p.item()
        elif ev[0] == "F":
            forward(int(ev[1:]))
            if ev == "F2":
                assert pol.stash_count == 1
        else:
            backward(int(ev[1:]))
    assert fwd == {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.5, 4: 0.5, 5: 0.0}
    assert bwd == fwd  # every backward on its own forward's weights, none older
    assert pol.stash_count == 0 and pol.stashed_bytes == 0


def test_forwards_on_the_same_weights_share_one_stash():
    """Stage 0 of 3 with step_every=2: forwards with no step between them share a stash."""
    p = _param([1.0])
    opt = torch.optim.SGD([p], lr=1.0)
    pol = make_policy("ws", [p], opt, stage=0, num_stages=3, step_every=2)
    pol.before_forward(2, 1)
    pol.after_forward(2)
    pol.before_forward(3, 1)  # no step since F2: the same weights, the same stash
    pol.after_forward(3)
    assert pol.stash_count == 1
    clones = _refs(pol.stash.get(pol.stash.keys()[0]))
    _step(pol, opt, p, 0.25)
    for mb in (2, 3):
        pol.before_backward(mb)
        assert p.item() == 1.0
        pol.after_backward(mb)
        assert p.item() == 0.75
        assert _alive(clones) == (1 if mb == 2 else 0)  # freed after its last user
    assert pol.stash_count == 0


def test_gap_aware_state_round_trips():
    p = _param([1.0, -1.0])
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    ga = SGDGapAware([p], opt)
    p.grad = torch.tensor([0.5, 0.25])
    opt.step()
    ga.update_running_stats()
    state = ga.state_dict()
    fresh = SGDGapAware([p], opt)
    fresh.load_state_dict(state)
    assert fresh.updates == 1 and fresh.eta_max == ga.eta_max
    torch.testing.assert_close(fresh.constants()[0], ga.constants()[0])
    with pytest.raises(ValueError, match="same model and pipeline split"):
        fresh.load_state_dict({"updates": 1, "running": [], "eta_max": [0.1]})
