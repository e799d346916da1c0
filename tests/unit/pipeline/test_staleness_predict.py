"""Weight prediction against the real torch optimizers stepped with zero gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ringpipe.pipeline.staleness import (
    SutskeverSGD,
    WeightPredictor,
    future_lrs,
    momentum_coefficient,
)


@pytest.fixture(autouse=True)
def _float64():
    """Exact comparisons in double precision; the default dtype is restored afterwards."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _trained(make_opt, steps=3, shape=(4, 3), seed=0, sched=None):
    """A parameter and its optimizer after ``steps`` real steps on random gradients."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    opt = make_opt([p])
    scheduler = sched(opt) if sched else None
    for _ in range(steps):
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    p.grad = None
    return p, opt, scheduler


def _future_with_torch(p, opt, scheduler, d, first_grad=None):
    """What the optimizer really does over ``d`` steps with zero (or one partial) gradient."""
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = copy.deepcopy(opt)
    opt2.param_groups[0]["params"] = [q]
    opt2.state = {q: copy.deepcopy(opt.state[p])} if p in opt.state else {}
    sched2 = None
    if scheduler is not None:
        sched2 = copy.deepcopy(scheduler)
        sched2.optimizer = opt2
    for k in range(d):
        q.grad = first_grad.clone() if (k == 0 and first_grad is not None) else torch.zeros_like(q)
        opt2.step()
        if sched2 is not None:
            sched2.step()
    return q.detach()


SGD_CASES = {
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.05),
    "plain_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.05),
    "dampening_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, dampening=0.3, weight_decay=0.01),
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sutskever": lambda ps: SutskeverSGD(ps, lr=0.1, momentum=0.9),
    "sutskever_wd": lambda ps: SutskeverSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.05),
}


@pytest.mark.parametrize("case", sorted(SGD_CASES))
@pytest.mark.parametrize("d", [1, 2, 4])
def test_sgd_prediction_equals_real_steps(case, d):
    p, opt, _ = _trained(SGD_CASES[case])
    (pred,) = WeightPredictor([p], opt).predict(d)
    expected = _future_with_torch(p, opt, None, d)
    if pred is None:  # only when nothing would move
        pred = p.detach()
    torch.testing.assert_close(pred, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("d", [1, 2, 3, 5])
def test_sgd_closed_form_coefficient(d):
    p, opt, _ = _trained(SGD_CASES["momentum"])
    v = opt.state[p]["momentum_buffer"]
    (pred,) = WeightPredictor([p], opt).predict(d)
    c_d = (0.9 - 0.9 ** (d + 1)) / (1 - 0.9)
    assert momentum_coefficient(0.9, d) == pytest.approx(c_d)
    assert momentum_coefficient(0.9, 1) == pytest.approx(0.9)
    torch.testing.assert_close(pred, p.detach() - 0.1 * c_d * v, rtol=0, atol=1e-12)
    ps, opts, _ = _trained(SGD_CASES["sutskever"])
    (pred_s,) = WeightPredictor([ps], opts).predict(d)
    torch.testing.assert_close(pred_s, ps.detach() - c_d * opts.state[ps]["momentum_buffer"], rtol=0, atol=1e-12)


def test_sgd_weight_decay_d1_formula_with_partial_gradient():
    """``theta_hat = (1 - eta lambda) theta - eta gamma v - eta g_partial`` (aggmsnag, d=1)."""
    p, opt, _ = _trained(SGD_CASES["momentum_wd"])
    g = torch.randn_like(p)
    p.grad = g.clone()
    (pred,) = WeightPredictor([p], opt, aggregate=True).predict(1)
    v = opt.state[p]["momentum_buffer"]
    expected = (1 - 0.1 * 0.05) * p.detach() - 0.1 * 0.9 * v - 0.1 * g
    torch.testing.assert_close(pred, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(pred, _future_with_torch(p, opt, None, 1, first_grad=g), rtol=0, atol=1e-12)
    (pred3,) = WeightPredictor([p], opt, aggregate=True).predict(3)
    torch.testing.assert_close(pred3, _future_with_torch(p, opt, None, 3, first_grad=g), rtol=0, atol=1e-12)


def _adam_formula(p, opt, eta, g_partial=None, decoupled=False):
    """ALGORITHMS.md §1 Adam/AdamW prediction written out literally."""
    st, grp = opt.state[p], opt.param_groups[0]
    (b1, b2), eps, lam, t = grp["betas"], grp["eps"], grp["weight_decay"], int(st["step"])
    theta, m, u = p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"]
    for k, lr in enumerate(eta, start=1):
        if decoupled:
            theta = theta * (1 - lr * lam)
            g = g_partial if k == 1 and g_partial is not None else torch.zeros_like(theta)
        else:
            g = (g_partial if k == 1 and g_partial is not None else 0) + lam * theta
        m = b1 * m + (1 - b1) * g
        theta = theta - lr / (1 - b1 ** (t + k)) * m / (u.sqrt() / math.sqrt(1 - b2 ** (t + k)) + eps)
    return theta


ADAM_CASES = {
    "adam": (lambda ps: torch.optim.Adam(ps, lr=0.01), False),
    "adam_l2": (lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01), False),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), True),
}


@pytest.mark.parametrize("case", sorted(ADAM_CASES))
@pytest.mark.parametrize("d", [1, 3])
def test_adam_prediction_formula_and_real_steps(case, d):
    make, decoupled = ADAM_CASES[case]
    p, opt, _ = _trained(make, steps=5)
    (pred,) = WeightPredictor([p], opt).predict(d)
    torch.testing.assert_close(pred, _adam_formula(p, opt, [0.01] * d, decoupled=decoupled), rtol=0, atol=1e-12)
    if case == "adam":  # no decay: m_k = beta1^k m exactly
        m, t = opt.state[p]["exp_avg"], int(opt.state[p]["step"])
        b1, b2 = opt.param_groups[0]["betas"]
        denom = opt.state[p]["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** (t + 1)) + 1e-8
        if d == 1:
            torch.testing.assert_close(pred, p.detach() - 0.01 / (1 - b1 ** (t + 1)) * b1 * m / denom)
    # The real optimizer also decays u by beta2 per zero-gradient step (the formula freezes it),
    # so the displacement agrees to about d*(1-beta2)/2 relative.
    real = _future_with_torch(p, opt, None, d)
    torch.testing.assert_close(pred - p.detach(), real - p.detach(), rtol=5e-3, atol=1e-7)


@pytest.mark.parametrize("case", sorted(ADAM_CASES))
def test_aggmsnag_adam_uses_partial_gradient(case):
    make, decoupled = ADAM_CASES[case]
    p, opt, _ = _trained(make, steps=4)
    g = torch.randn_like(p) * 0.1
    p.grad = g.clone()
    (pred,) = WeightPredictor([p], opt, aggregate=True).predict(2)
    torch.testing.assert_close(pred, _adam_formula(p, opt, [0.01] * 2, g_partial=g, decoupled=decoupled),
                               rtol=0, atol=1e-12)


def _step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)


def _lambda_lr(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


@pytest.mark.parametrize("sched", [_step_lr, _lambda_lr])
@pytest.mark.parametrize("case", ["momentum", "momentum_wd", "sutskever_wd"])
def test_scheduler_aware_sgd_prediction(sched, case):
    p, opt, scheduler = _trained(SGD_CASES[case], steps=3, sched=sched)
    lr_before = opt.param_groups[0]["lr"]
    (pred,) = WeightPredictor([p], opt, scheduler).predict(4)
    torch.testing.assert_close(pred, _future_with_torch(p, opt, scheduler, 4), rtol=0, atol=1e-12)
    assert opt.param_groups[0]["lr"] == lr_before  # the real scheduler did not move
    # without the scheduler, the prediction assumes a constant rate and differs
    (flat,) = WeightPredictor([p], opt).predict(4)
    assert not torch.allclose(flat, pred)


def test_scheduler_aware_adam_prediction():
    p, opt, scheduler = _trained(lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
                                 steps=3, sched=_step_lr)
    lrs = future_lrs(opt, scheduler, 3)[0]
    assert lrs == pytest.approx([0.001, 0.0001, 0.0001])  # after 3 steps: epochs 3, 4, 5
    (pred,) = WeightPredictor([p], opt, scheduler).predict(3)
    torch.testing.assert_close(pred, _adam_formula(p, opt, lrs, decoupled=True), rtol=0, atol=1e-12)
    real = _future_with_torch(p, opt, scheduler, 3)
    torch.testing.assert_close(pred - p.detach(), real - p.detach(), rtol=5e-3, atol=1e-9)


@pytest.mark.parametrize("case", ["momentum_wd", "adam_l2", "adamw"])
def test_prediction_never_touches_grad_and_reverts_exactly(case):
    make = SGD_CASES[case] if case in SGD_CASES else ADAM_CASES[case][0]
    p, opt, _ = _trained(make, steps=3)
    g = torch.randn_like(p)
    p.grad = g.clone()
    grad_obj, theta = p.grad, p.detach().clone()
    wp = WeightPredictor([p], opt, aggregate=True)
    (pred,) = wp.predict(3)
    assert wp.setup(3)
    torch.testing.assert_close(p.detach(), pred, rtol=0, atol=0)
    assert pred.data_ptr() != p.data_ptr() and pred.data_ptr() != p.grad.data_ptr()
    wp.revert()
    assert p.grad is grad_obj
    torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    torch.testing.assert_close(p.detach(), theta, rtol=0, atol=0)


def test_nag_with_predictor_and_fresh_optimizer():
    p, opt, _ = _trained(SGD_CASES["momentum"])
    assert WeightPredictor([p], opt).horizon(0) == 0
    nag = WeightPredictor([p], opt, nag_with_predictor=True)
    assert nag.horizon(0) == 1
    (pred,) = nag.predict(0)
    torch.testing.assert_close(pred, _future_with_torch(p, opt, None, 1), rtol=0, atol=1e-12)
    q = torch.nn.Parameter(torch.ones(3))
    fresh = WeightPredictor([q], torch.optim.Adam([q], lr=0.1))
    assert fresh.predict(2) == [None] and not fresh.setup(2)
