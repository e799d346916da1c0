"""The single-process asynchronous-pipeline simulator against hand derivations and plain training."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from ringpipe.pipeline.schedules import async_1f1b, format_actions
from ringpipe.pipeline.simulator import (
    async_stage_order,
    order_staleness,
    simulate_async,
    simulate_sync,
)
from ringpipe.pipeline.staleness import live_forward, make_policy

DT = torch.float64


class Scale(nn.Module):
    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w], dtype=DT))

    def forward(self, x):
        return self.w * x


def _half_sq(z, t):
    return 0.5 * ((z - t) ** 2).sum()


@pytest.mark.parametrize(("n", "m", "k"), [(1, 3, 1), (2, 5, 1), (3, 7, 2), (4, 9, 3), (4, 2, 1)])
def test_order_matches_the_async_schedule(n, m, k):
    for i in range(n):
        order = async_stage_order(i, n, m, k)
        assert " ".join(order) == format_actions(async_1f1b(n, m, i, k))


def test_order_and_staleness_by_hand():
    assert async_stage_order(0, 2, 3) == ["F0", "F1", "B0", "S", "F2", "B1", "S", "B2", "S"]
    assert async_stage_order(1, 2, 3) == ["F0", "B0", "S", "F1", "B1", "S", "F2", "B2", "S"]
    assert order_staleness(async_stage_order(0, 4, 8)) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 3, 5: 3, 6: 3, 7: 3}
    assert set(order_staleness(async_stage_order(3, 4, 8)).values()) == {0}
    # step_every=2: staleness counts steps, not micro-batches
    assert order_staleness(async_stage_order(0, 3, 8, 2)) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1}


def _reference(mode, x, t, a, b, c, lr, mom):
    """Two stages ``h = b*(a*x)`` | ``z = c*h``, SGD with momentum, loss 0.5 (z-t)^2, M=3, by hand.

    Stage 0 order: F0 F1 B0 S F2 B1 S B2 S (staleness 0, 1, 1); stage 1 has staleness 0.
    """
    st = {"a": a, "b": b, "c": c, "va": None, "vb": None, "vc": None}
    fw, h, losses = {}, {}, []

    def sgd(w, g):
        v = g if st["v" + w] is None else mom * st["v" + w] + g
        st["v" + w], st[w] = v, st[w] - lr * v

    def f0(j, d):
        au, bu = st["a"], st["b"]
        if mode == "wp" and d > 0 and st["va"] is not None:
            au, bu = au - lr * mom * st["va"], bu - lr * mom * st["vb"]
        fw[j] = (au, bu)
        h[j] = bu * au * x[j]

    def s1(j):
        z = st["c"] * h[j]
        losses.append(0.5 * (z - t[j]) ** 2)
        dz = z - t[j]
        dh = dz * st["c"]
        sgd("c", dz * h[j])
        return dh

    def b0(j, dh):
        au, bu = fw[j]
        a_act, b_bw = {
            "stale": (au, st["b"]),          # saved activation a_f*x, current b carries the grad
            "stale_recompute": (st["a"], st["b"]),
            "ws": (au, bu),
            "wp": (au, st["b"]),
        }[mode]
        ga, gb = dh * b_bw * x[j], dh * a_act * x[j]
        sgd("a", ga)
        sgd("b", gb)

    f0(0, 0)
    f0(1, 1)
    b0(0, s1(0))
    f0(2, 1)
    b0(1, s1(1))
    b0(2, s1(2))
    return st, losses


@pytest.mark.parametrize("mode", ["stale", "stale_recompute", "ws", "wp"])
def test_two_stage_scalar_pipeline_matches_hand_derivation(mode):
    x, t = [1.0, -2.0, 0.5], [3.0, 1.0, -1.0]
    a, b, c, lr, mom = 0.7, 1.3, 0.9, 0.1, 0.5
    stages = [nn.Sequential(Scale(a), Scale(b)), Scale(c)]
    opts = [torch.optim.SGD(s.parameters(), lr=lr, momentum=mom) for s in stages]
    mbs = [(torch.tensor([xi], dtype=DT), torch.tensor([ti], dtype=DT)) for xi, ti in zip(x, t, strict=True)]
    names = {"stale_recompute": "stale"}.get(mode, mode)
    res = simulate_async(stages, opts, _half_sq, mbs, names, recompute=mode == "stale_recompute")
    st, losses = _reference(mode, x, t, a, b, c, lr, mom)
    got = [stages[0][0].w.item(), stages[0][1].w.item(), stages[1].w.item()]
    assert got == pytest.approx([st["a"], st["b"], st["c"]], rel=1e-12, abs=1e-12)
    assert res.losses == pytest.approx(losses, rel=1e-12)
    assert res.staleness == [{0: 0, 1: 1, 2: 1}, {0: 0, 1: 0, 2: 0}]


def test_the_modes_really_differ_on_that_pipeline():
    finals = {}
    for mode in ["stale", "stale_recompute", "ws", "wp"]:
        st, _ = _reference(mode, [1.0, -2.0, 0.5], [3.0, 1.0, -1.0], 0.7, 1.3, 0.9, 0.1, 0.5)
        finals[mode] = (st["a"], st["b"])
    assert len({tuple(round(v, 12) for v in f) for f in finals.values()}) == 4



# Stage 0 of a 2-stage pipeline, by hand: warm-up F0 F1, then B j and F j+2 alternately, S
# after every k-th backward and the last; staleness = number of S between F j and B j.
_STAGE0 = {
    (4, 1): ("F0 F1 B0 S F2 B1 S F3 B2 S B3 S", [0, 1, 1, 1]),
    (4, 2): ("F0 F1 B0 F2 B1 S F3 B2 B3 S", [0, 0, 1, 0]),
    (6, 2): ("F0 F1 B0 F2 B1 S F3 B2 F4 B3 S F5 B4 B5 S", [0, 0, 1, 0, 1, 0]),
}
_X = [1.0, -2.0, 0.5, 1.5, -0.7, 0.9]
_T = [3.0, 1.0, -1.0, 0.4, 2.0, -0.5]
_W0 = (0.7, 1.3, 0.9)  # a, b (stage 0) and c (stage 1)


def _hand_mitigated(names, m, k, *, lr, mom, wd, recompute=False, gb=0.999, eps=1e-8):
    """Stages ``h = b*(a*x)`` | ``z = c*h``, loss ``0.5 (z-t)^2``, SGD in PyTorch form, by hand.

    Stage 1 has staleness 0 and trains plainly (the loss of a micro-batch is divided by the
    size of its step). Stage 0 follows ``_STAGE0[(m, k)]`` with the formulas of ALGORITHMS.md §1:

    - ``ws``: every forward runs on the current weights; a stale one clones them, and its
      backward runs on that clone (a micro-batch is never staler than without stashing).
    - ``aggmsnag`` (staleness 1 here): the forward runs on
      ``(1 - eta lam) theta - eta gamma v - eta g_partial`` (``v``, ``g_partial``: 0 if absent).
    - Gap Aware on stage 0 (the only stage of ``all_except_last`` with two stages): on a step
      with a stale micro-batch, once ``C`` exists, ``g <- g/pen + lam theta (1-pen)/pen`` with
      ``pen = 1 + Gap/C``, ``C = eta (sqrt(ra / (1 - gb^n)) + eps)``; ``Gap = eta |g|`` without a
      stash, else the elementwise largest ``|theta_at_backward - theta_stash|`` of the step's
      stale micro-batches. After every step ``ra <- gb ra + (1-gb) s^2``, ``s`` the momentum
      buffer (or the stepped gradient without momentum).
    - Backward weights: the stash (``ws``, not ``ga_jfl``); else the current weights when
      replayed (recompute); else the forward's activation ``a x`` with the current ``b``.

    Returns the final ``[a, b, c]``, the losses, the penalties per penalised step and the
    number of forwards that ran on predicted weights.
    """
    chosen = set(names.split("+"))
    ws, predict, jfl = "ws" in chosen, "aggmsnag" in chosen, "ga_jfl" in chosen
    gap_aware = jfl or "ga" in chosen
    order, stale = _STAGE0[(m, k)]
    x, t = _X[:m], _T[:m]
    w = dict(zip("abc", _W0, strict=True))
    v = dict.fromkeys("abc")  # momentum buffers
    g = dict.fromkeys("abc")  # accumulated gradients (None once zeroed)
    ra, updates = {"a": 0.0, "b": 0.0}, 0
    h, fw, stashes, used, losses = {}, {}, {}, {}, [None] * m
    penalties, predicted = [], 0
    gaps, stale_step = None, False

    def size(j):
        return min(k, m - j // k * k)

    def add(name, value):
        g[name] = value if g[name] is None else g[name] + value

    def sgd(name):
        d_p = g[name] + wd * w[name]
        if mom:
            v[name] = d_p if v[name] is None else mom * v[name] + d_p
            d_p = v[name]
        w[name] -= lr * d_p

    def stage1(j):
        z = w["c"] * h[j]
        losses[j] = 0.5 * (z - t[j]) ** 2
        dz = (z - t[j]) / size(j)
        dh = dz * w["c"]
        add("c", dz * h[j])
        if (j + 1) % k == 0 or j == m - 1:
            sgd("c")
            g["c"] = None
        return dh

    for ev in order.split():
        if ev == "S":
            if gap_aware and stale_step and updates > 0:
                pens = {}
                for p in "ab":
                    c_p = lr * (math.sqrt(ra[p] / (1 - gb**updates)) + eps)
                    gap = gaps[p] if ws else lr * abs(g[p])
                    pens[p] = 1 + gap / c_p
                    g[p] = g[p] / pens[p] + w[p] * wd * (1 - pens[p]) / pens[p]
                penalties.append(pens)
            sgd("a")
            sgd("b")
            if gap_aware:
                updates += 1
                for p in "ab":
                    s = v[p] if mom else g[p]
                    ra[p] = gb * ra[p] + (1 - gb) * s * s
            g["a"] = g["b"] = None
            gaps, stale_step = None, False
            continue
        j = int(ev[1:])
        if ev[0] == "F":
            d = stale[j]
            a_f, b_f = w["a"], w["b"]
            if predict and d > 0:
                assert d == 1
                a_f, b_f = (
                    (1 - lr * wd) * w[p] - lr * mom * (v[p] or 0.0) - lr * (g[p] or 0.0) for p in "ab"
                )
                predicted += 1
            if ws and d > 0:
                stashes[j] = (a_f, b_f)
            used[j] = (j if ws and d > 0 else None, d)
            fw[j] = (a_f, b_f)
            h[j] = b_f * (a_f * x[j])
        else:
            dh = stage1(j)
            key, d = used.pop(j)
            if key is not None and not jfl:
                a_act, b_bw = stashes[key][:2]
            elif recompute:
                a_act, b_bw = w["a"], w["b"]
            else:
                a_act, b_bw = fw[j][0], w["b"]
            add("a", dh * b_bw * x[j])
            add("b", dh * a_act * x[j])
            stale_step |= d > 0
            if gap_aware and key is not None and d > 0:
                gap = {p: abs(w[p] - stashes[key][i]) for i, p in enumerate("ab")}
                gaps = gap if gaps is None else {p: max(gaps[p], gap[p]) for p in "ab"}
    return [w["a"], w["b"], w["c"]], losses, penalties, predicted


def _simulate_two_stage(names, m, k, *, lr, mom, wd, recompute=False):
    a, b, c = _W0
    stages = [nn.Sequential(Scale(a), Scale(b)), Scale(c)]
    opts = [torch.optim.SGD(s.parameters(), lr=lr, momentum=mom, weight_decay=wd) for s in stages]
    mbs = [(torch.tensor([xi], dtype=DT), torch.tensor([ti], dtype=DT)) for xi, ti in zip(_X[:m], _T[:m], strict=True)]
    res = simulate_async(stages, opts, _half_sq, mbs, names, step_every=k, recompute=recompute)
    order, stale = _STAGE0[(m, k)]
    assert " ".join(res.orders[0]) == order
    assert res.staleness[0] == dict(enumerate(stale))
    return [stages[0][0].w.item(), stages[0][1].w.item(), stages[1].w.item()], res.losses


def _assert_matches_hand(names, m, k, *, lr, mom, wd, recompute=False):
    got, losses = _simulate_two_stage(names, m, k, lr=lr, mom=mom, wd=wd, recompute=recompute)
    want, want_losses, penalties, predicted = _hand_mitigated(
        names, m, k, lr=lr, mom=mom, wd=wd, recompute=recompute
    )
    assert got == pytest.approx(want, rel=1e-12, abs=1e-14)
    assert losses == pytest.approx(want_losses, rel=1e-12, abs=1e-14)
    # the mitigation changed the result: the test would notice it being skipped
    plain, _, _, _ = _hand_mitigated("stale", m, k, lr=lr, mom=mom, wd=wd, recompute=recompute)
    assert abs(got[0] - plain[0]) + abs(got[1] - plain[1]) > 1e-4
    return penalties, predicted


_SGD_CASES = pytest.mark.parametrize(
    ("mom", "wd"), [(0.0, 0.0), (0.5, 0.0), (0.5, 0.01)], ids=["plain", "momentum", "momentum-wd"]
)


@_SGD_CASES
@pytest.mark.parametrize(("m", "k"), [(4, 1), (4, 2)])
def test_gap_aware_from_the_gradient_matches_hand_derivation(m, k, mom, wd):
    """``ga`` without a stash: ``Gap = eta |g|`` on every step with a stale micro-batch."""
    penalties, _ = _assert_matches_hand("ga", m, k, lr=0.1, mom=mom, wd=wd)
    # stale steps once C exists: S2..S4 with k=1 (S1 closes micro-batch 0, not stale); S2 with k=2
    assert len(penalties) == (3 if k == 1 else 1)
    assert all(pen[p] > 1.03 for pen in penalties for p in "ab")


@_SGD_CASES
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize(("m", "k"), [(4, 1), (4, 2)])
def test_gap_aware_on_the_stash_matches_hand_derivation(m, k, recompute, mom, wd):
    """``ws+ga``: backward on the stash, ``Gap = |theta_current - theta_stashed|``."""
    penalties, _ = _assert_matches_hand("ws+ga", m, k, lr=0.1, mom=mom, wd=wd, recompute=recompute)
    assert len(penalties) == (3 if k == 1 else 1)
    assert all(pen[p] > 1.03 for pen in penalties for p in "ab")


@_SGD_CASES
@pytest.mark.parametrize(("m", "k"), [(4, 1), (4, 2)])
def test_gap_aware_just_for_loss_matches_hand_derivation(m, k, mom, wd):
    """``ws+ga_jfl``: the replayed backward runs on the current weights; the stash only sizes the gap."""
    penalties, _ = _assert_matches_hand("ws+ga_jfl", m, k, lr=0.1, mom=mom, wd=wd, recompute=True)
    assert len(penalties) == (3 if k == 1 else 1)
    assert all(pen[p] > 1.03 for pen in penalties for p in "ab")
    # different from the same penalties with the backward on the stash
    jfl, _, _, _ = _hand_mitigated("ws+ga_jfl", m, k, lr=0.1, mom=mom, wd=wd, recompute=True)
    ws_ga, _, _, _ = _hand_mitigated("ws+ga", m, k, lr=0.1, mom=mom, wd=wd, recompute=True)
    assert abs(jfl[0] - ws_ga[0]) + abs(jfl[1] - ws_ga[1]) > 1e-4


@_SGD_CASES
@pytest.mark.parametrize("m", [4, 6])
def test_aggmsnag_with_step_every_2_matches_hand_derivation(m, mom, wd):
    """The stale forward of a step's first micro-batch runs on weights predicted one step ahead
    with the gradient the step has accumulated so far (micro-batch 2: that of micro-batch 0)."""
    _, predicted = _assert_matches_hand("aggmsnag", m, 2, lr=0.1, mom=mom, wd=wd)
    assert predicted == m // 2 - 1  # F2 (and F4): the stale forwards


@_SGD_CASES
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("m", [4, 6])
def test_weight_stashing_with_step_every_2_matches_hand_derivation(m, recompute, mom, wd):
    """F2 stashes theta_0 for B2; F3 runs after S1 on theta_1, and B3 (before S2) as well."""
    _assert_matches_hand("ws", m, 2, lr=0.1, mom=mom, wd=wd, recompute=recompute)


def _mlp_stages(n, seed=0, width=6):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width, dtype=DT), nn.Tanh(), nn.Linear(width, width, dtype=DT))
            for _ in range(n)]


def _data(m, width=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, width, generator=gen, dtype=DT), torch.randn(4, width, generator=gen, dtype=DT))
            for _ in range(m)]


def _mse(out, y):
    return ((out - y) ** 2).mean()


@pytest.mark.parametrize("names", ["stale", "ws", "wp", "wp+ws+ga", "ws+ga_jfl"])
@pytest.mark.parametrize("step_every", [1, 2])
def test_one_stage_equals_plain_training(names, step_every):
    (stage,) = _mlp_stages(1)
    ref = copy.deepcopy(stage)
    data = _data(5)
    opt = torch.optim.SGD(stage.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    res = simulate_async([stage], [opt], _mse, data, names, step_every=step_every,
                         recompute="jfl" in names)
    losses = []
    for start in range(0, len(data), step_every):
        group = data[start:start + step_every]
        for x, y in group:
            loss = _mse(ref(x), y)
            losses.append(loss.item())
            (loss / len(group)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(stage.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    assert res.losses == pytest.approx(losses, rel=1e-12)


def test_sync_reference_equals_plain_training_on_three_stages():
    stages = _mlp_stages(3)
    ref = nn.Sequential(*copy.deepcopy(stages))
    data = _data(6)
    opts = [torch.optim.Adam(s.parameters(), lr=1e-2) for s in stages]
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    simulate_sync(stages, opts, _mse, data, step_every=3)
    for start in (0, 3):
        for x, y in data[start:start + 3]:
            (_mse(ref(x), y) / 3).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(nn.Sequential(*stages).parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


@pytest.mark.parametrize("step_every", [1, 2])
def test_weight_stashing_is_the_same_with_and_without_recompute(step_every):
    """With stashing the backward sees the forward's weights whether or not the graph was kept
    (with step_every=2, one stash per step: forward and backward of the whole step on it)."""
    results = []
    for recompute in (False, True):
        stages = _mlp_stages(3)
        opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
        simulate_async(stages, opts, _mse, _data(8), "ws", recompute=recompute, step_every=step_every)
        results.append(torch.cat([p.detach().flatten() for s in stages for p in s.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-12)
    stale = []
    for recompute in (False, True):
        stages = _mlp_stages(3)
        opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
        simulate_async(stages, opts, _mse, _data(8), "stale", recompute=recompute)
        stale.append(torch.cat([p.detach().flatten() for s in stages for p in s.parameters()]))
    assert not torch.allclose(stale[0], stale[1])  # stale: old activations vs replayed ones


@pytest.mark.parametrize(
    ("names", "recompute", "opt_name"),
    [("wp", False, "sgd"), ("wp+ws", False, "adamw"), ("ws+ga", False, "adam"), ("wp+ws+ga", True, "sgd"),
     ("ws+ga_jfl", True, "sgd"), ("wp+ga", False, "sgd")],
)
def test_three_stage_combinations_run_and_free_their_stashes(names, recompute, opt_name):
    stages = _mlp_stages(3)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
            "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-4),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[opt_name]
    opts = [make(s.parameters()) for s in stages]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in opts]
    policies = [make_policy(names, list(s.parameters()), o, sc, stage=i, num_stages=3, step_every=2,
                            recompute=recompute) for i, (s, o, sc) in enumerate(zip(stages, opts, scheds, strict=True))]
    before = [p.detach().clone() for s in stages for p in s.parameters()]
    res = simulate_async(stages, opts, _mse, _data(9), step_every=2, recompute=recompute,
                         schedulers=scheds, policies=policies)
    assert all(torch.isfinite(torch.tensor(res.losses)))
    assert all(getattr(p, "stash_count", 0) == 0 for p in policies)
    after = [p.detach() for s in stages for p in s.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    if "ga" in names:
        assert policies[0].gap_aware is not None and policies[0].gap_aware.ready
        assert policies[2].gap_aware is None


def test_live_forward_gives_module_gradients_and_survives_in_place_updates():
    (stage,) = _mlp_stages(1)
    x = torch.randn(3, 6, dtype=DT)
    stage(x).sum().backward()
    expected = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    out = live_forward(stage, x)
    with torch.no_grad():
        for p in stage.parameters():
            p.mul_(1.0)  # an in-place update bumps the parameter's version
    out.sum().backward()
    for p, g in zip(stage.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-12)


def test_bad_arguments_are_named():
    stages = _mlp_stages(2)
    opts = [torch.optim.SGD(s.parameters(), lr=0.1) for s in stages]
    with pytest.raises(ValueError, match="1 optimizers for 2 stages"):
        simulate_async(stages, opts[:1], _mse, _data(2))
    with pytest.raises(ValueError, match="microbatches is empty"):
        simulate_async(stages, opts, _mse, [])
    with pytest.raises(ValueError, match="unknown staleness mitigation 'pd'"):
        simulate_async(stages, opts, _mse, _data(2), "pd")


def test_batchnorm_stages_with_and_without_recompute_agree_under_stashing():
    """Kept graphs survive running-statistic updates; a replay moves the statistics only once."""
    states = []
    for recompute in (False, True):
        torch.manual_seed(3)
        stages = [nn.Sequential(nn.Linear(6, 6, dtype=DT), nn.BatchNorm1d(6, dtype=DT), nn.Tanh()) for _ in range(3)]
        opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
        simulate_async(stages, opts, _mse, _data(6), "ws", recompute=recompute)
        states.append({f"{i}.{k}": v.clone() for i, s in enumerate(stages) for k, v in s.state_dict().items()})
    assert states[0]["0.1.num_batches_tracked"].item() == 6
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=0, atol=1e-12, msg=name)
