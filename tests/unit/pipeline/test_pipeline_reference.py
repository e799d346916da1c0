"""A one-process reference of the asynchronous 1F1B pipeline, written plainly from the papers' formulas.

It shares no code with what it checks: nothing from ``ringpipe.pipeline.staleness`` nor the
simulator, no ``torch.optim``, no autograd. A stage is a list of explicit tensors (``W, b`` of
each linear layer) and its forward and backward are written out by hand, so every number can be
followed. The formulas are those of the design notes' reference facts (asynchronous pipeline
and staleness) and the papers behind them:

- **schedule** (PipeDream's asynchronous 1F1B): stage ``i`` of ``N`` runs forwards ``F0 ..
  F(N-1-i)``, then ``B j`` and ``F j+N-i`` alternately, then the remaining backwards; an
  optimizer step ``S`` follows every ``step_every``-th backward and the last. The staleness
  ``d`` of a micro-batch is the number of ``S`` between its ``F`` and its ``B``. Each
  micro-batch's loss is divided by the number of micro-batches of its step.
- **stale**: the forward uses the weights current then; the backward reads the weights current
  at backward time, with the forward's activations (no recomputation) or with activations
  replayed on those weights (recomputation).
- **weight stashing** (PipeDream): a micro-batch with ``d > 0`` runs its backward on exactly the
  weights its forward used (no other micro-batch's).
- **weight prediction** (SpecTrain-style msnag, FTPipe's aggmsnag): the forward of a micro-batch
  of staleness ``d`` runs on the weights ``d`` steps ahead with future gradients 0 (``aggmsnag``:
  the first predicted step also uses the gradient accumulated so far), at the rates the LR
  schedule will give; ``nag_with_predictor``: one step ahead at ``d = 0``, a Nesterov look-ahead
  whose backward also runs on the look-ahead weights.
- **Gap Aware** (Barkai, Hakimi, Schuster, ICLR 2020): on a step with a stale micro-batch, once a
  step has been taken, ``g <- g / (1 + Gap/C)`` elementwise (plus ``lambda theta (1-pen)/pen``
  for L2 decay), skipping groups whose largest rate is 0; ``Gap`` is the elementwise largest
  ``|theta_now - theta_used|`` over the step's stale micro-batches (with a stash) or ``eta |g|``
  (without one, staleness 1 only); ``C``: SGD ``eta_max (rms(v) + eps)``, Sutskever SGD
  ``rms(v) + eta_max eps`` (its velocity holds the rate), Adam ``sqrt(e) + eps`` with
  ``e`` the running mean of the squared Adam step at the step's own rate. ``ga_jfl``: the
  backward runs on the current weights; the stash only measures the gap.
- **optimizers**: PyTorch SGD ``v <- gamma v + (g + lambda theta); theta -= eta v``; Sutskever
  ``v <- gamma v + eta (g + lambda theta); theta -= v``; Adam (L2) and AdamW (decoupled).
- **LR warm-up**: ``eta(s) = eta_0 (f + (1 - f) min(s, T) / T)`` after ``s`` scheduler steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["Config", "Opt", "reference_async"]


@dataclass(frozen=True)
class Opt:
    """Optimizer hyper-parameters: ``kind`` is ``sgd``, ``sutskever``, ``adam`` or ``adamw``."""

    kind: str
    lr: float
    weight_decay: float
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup: tuple[float, int] | None = None  # (start factor, iterations) of a linear warm-up
    lr0_first: bool = False  # each stage's first parameter in a group at rate 0


@dataclass(frozen=True)
class Config:
    """What to run: mitigation flags, as plain booleans."""

    ws: bool = False  # weight stashing
    predict: str | None = None  # None, "msnag" or "aggmsnag"
    nag: bool = False
    ga: str | None = None  # None, "ga" or "ga_jfl"
    ga_stages: str = "all_except_last"
    step_every: int = 1
    recompute: bool = False


@dataclass
class _Stage:
    layers: list[str]  # "linear" or "tanh"
    theta: list[torch.Tensor]  # W, b of each linear layer, in order
    base_lr: list[float]  # per parameter
    v: list[torch.Tensor | None] = field(default_factory=list)  # momentum buffers
    m: list[torch.Tensor] = field(default_factory=list)
    u: list[torch.Tensor] = field(default_factory=list)
    t: int = 0  # Adam steps
    s: int = 0  # scheduler steps
    grad: list[torch.Tensor | None] = field(default_factory=list)
    ga_stat: list[torch.Tensor] = field(default_factory=list)  # SGD: ra; Adam: e
    ga_n: int = 0
    eta_max: list[float] = field(default_factory=list)
    gaps: list[torch.Tensor] | None = None
    stale_in_step: bool = False


def _lr(opt: Opt, base: float, s: int) -> float:
    if opt.warmup is None:
        return base
    f, total = opt.warmup
    return base * (f + (1 - f) * min(s, total) / total)


def _order(i: int, n: int, m: int, k: int) -> list[tuple[str, int]]:
    warm = min(n - i, m)
    out = [("F", j) for j in range(warm)]
    nxt = warm
    for b in range(m):
        out.append(("B", b))
        if (b + 1) % k == 0 or b == m - 1:
            out.append(("S", -1))
        if nxt < m:
            out.append(("F", nxt))
            nxt += 1
    return out


def _staleness(order: list[tuple[str, int]]) -> dict[int, int]:
    steps, at_f, out = 0, {}, {}
    for kind, j in order:
        if kind == "S":
            steps += 1
        elif kind == "F":
            at_f[j] = steps
        else:
            out[j] = steps - at_f[j]
    return out


def _forward(st: _Stage, w: list[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and the activations each layer saves: its input (linear) or its output (tanh)."""
    saved, h, p = [], x, 0
    for kind in st.layers:
        if kind == "linear":
            saved.append(h)
            h = h @ w[p].T + w[p + 1]
            p += 2
        else:
            h = torch.tanh(h)
            saved.append(h)
    return h, saved


def _backward(st: _Stage, w: list[torch.Tensor], saved: list[torch.Tensor], dy: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Parameter gradients and the input gradient; weights ``w`` carry the gradient, ``saved`` are the activations."""
    grads: list[torch.Tensor] = [torch.zeros(0)] * len(w)
    p = len(w)
    for kind, a in zip(reversed(st.layers), reversed(saved), strict=True):
        if kind == "tanh":
            dy = dy * (1 - a * a)
        else:
            p -= 2
            grads[p], grads[p + 1] = dy.T @ a, dy.sum(0)
            dy = dy @ w[p]
    return grads, dy


def _predict(st: _Stage, opt: Opt, horizon: int, aggregate: bool) -> list[torch.Tensor]:
    out = []
    for i, theta in enumerate(st.theta):
        lam, gamma = opt.weight_decay, opt.momentum
        etas = [_lr(opt, st.base_lr[i], st.s + k) for k in range(horizon)]
        g0 = st.grad[i] if aggregate else None
        th = theta.clone()
        if opt.kind in ("sgd", "sutskever"):
            vh = st.v[i]
            for k, eta in enumerate(etas):
                dp = lam * th + (g0 if k == 0 and g0 is not None else 0)
                if opt.kind == "sgd":
                    vh = dp if vh is None else gamma * vh + dp
                    th = th - eta * vh
                else:
                    vh = eta * dp if vh is None else gamma * vh + eta * dp
                    th = th - vh
        elif st.t > 0:  # Adam / AdamW, u frozen
            b1, b2 = opt.betas
            m = st.m[i]
            for k, eta in enumerate(etas, start=1):
                if opt.kind == "adamw":
                    th = th * (1 - eta * lam)
                gk = g0 if k == 1 else None
                if opt.kind == "adam" and lam:
                    gk = lam * th if gk is None else gk + lam * th
                m = b1 * m if gk is None else b1 * m + (1 - b1) * gk
                denom = st.u[i].sqrt() / math.sqrt(1 - b2 ** (st.t + k)) + opt.eps
                th = th - eta / (1 - b1 ** (st.t + k)) * m / denom
        out.append(th)
    return out


def _ga_constant(st: _Stage, opt: Opt, i: int) -> torch.Tensor:
    if opt.kind in ("adam", "adamw"):
        return st.ga_stat[i].sqrt() + 1e-8
    rms = (st.ga_stat[i] / (1 - 0.999**st.ga_n)).sqrt()
    if opt.kind == "sutskever":
        return rms + st.eta_max[i] * 1e-8
    return st.eta_max[i] * (rms + 1e-8)


def _step(st: _Stage, opt: Opt, gap_aware: bool, measured: bool) -> None:
    lam = opt.weight_decay
    lrs = [_lr(opt, b, st.s) for b in st.base_lr]
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(st.grad, st.theta, strict=True)]
    if gap_aware and st.stale_in_step and st.ga_n > 0:
        for i, theta in enumerate(st.theta):
            if st.eta_max[i] <= 0:
                continue
            gap = st.gaps[i] if measured else lrs[i] * grads[i].abs()
            pen = 1 + gap / _ga_constant(st, opt, i)
            grads[i] = grads[i] / pen
            if opt.kind != "adamw":
                grads[i] = grads[i] + lam * theta * (1 - pen) / pen
    if opt.kind in ("adam", "adamw"):
        st.t += 1
    b1, b2 = opt.betas
    for i, (theta, g, eta) in enumerate(zip(st.theta, grads, lrs, strict=True)):
        if opt.kind == "sgd":
            d = g + lam * theta
            st.v[i] = d if st.v[i] is None else opt.momentum * st.v[i] + d
            st.theta[i] = theta - eta * st.v[i]
        elif opt.kind == "sutskever":
            v = st.v[i] if st.v[i] is not None else torch.zeros_like(theta)
            st.v[i] = opt.momentum * v + eta * (g + lam * theta)
            st.theta[i] = theta - st.v[i]
        else:
            if opt.kind == "adamw":
                theta = theta * (1 - eta * lam)
            else:
                g = g + lam * theta
            st.m[i] = b1 * st.m[i] + (1 - b1) * g
            st.u[i] = b2 * st.u[i] + (1 - b2) * g * g
            size = eta / (1 - b1**st.t)
            step = size * st.m[i] / (st.u[i].sqrt() / math.sqrt(1 - b2**st.t) + opt.eps)
            st.theta[i] = theta - step
            if gap_aware:
                st.ga_stat[i] = b2 * st.ga_stat[i] + (1 - b2) * step * step
    st.s += 1
    if gap_aware:
        if opt.kind in ("sgd", "sutskever"):
            for i, v in enumerate(st.v):
                st.ga_stat[i] = 0.999 * st.ga_stat[i] + 0.001 * v * v
        st.eta_max = [max(e, _lr(opt, b, st.s)) for e, b in zip(st.eta_max, st.base_lr, strict=True)]
        st.ga_n += 1
    st.grad = [None] * len(st.theta)
    st.gaps, st.stale_in_step = None, False


def reference_async(
    stages: list[tuple[list[str], list[torch.Tensor]]],
    opt: Opt,
    cfg: Config,
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[list[torch.Tensor]]:
    """Train ``stages`` (layer kinds, initial ``W, b`` tensors) on ``microbatches`` with MSE loss.

    Returns each stage's final parameters. ``cfg`` says which mitigations run where.
    """
    n, m, k = len(stages), len(microbatches), cfg.step_every
    ga_on = {
        "all_except_last": set(range(n - 1)),
        "all_except_last_two": set(range(n - 2)),
        "almost_last_partition": {n - 2} if n >= 2 else set(),
    }[cfg.ga_stages] if cfg.ga else set()
    sts = []
    for layers, theta in stages:
        base = [opt.lr] * len(theta)
        if opt.lr0_first:
            base[0] = 0.0
        st = _Stage(layers, [t.clone() for t in theta], base)
        st.v = [None] * len(theta)
        st.m = [torch.zeros_like(t) for t in theta]
        st.u = [torch.zeros_like(t) for t in theta]
        st.grad = [None] * len(theta)
        st.ga_stat = [torch.zeros_like(t) for t in theta]
        st.eta_max = [_lr(opt, b, 0) for b in base]
        sts.append(st)
    orders = [_order(i, n, m, k) for i in range(n)]
    stale = [_staleness(o) for o in orders]
    last_group = (m - 1) // k
    weight = [1.0 / (k if j // k < last_group else m - last_group * k) for j in range(m)]
    acts: dict[tuple[int, int], torch.Tensor] = {}
    grads_in: dict[tuple[int, int], torch.Tensor] = {}
    kept: list[dict[int, tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]]] = [{} for _ in range(n)]

    def forward(i: int, j: int) -> None:
        st, d = sts[i], stale[i][j]
        x = microbatches[j][0] if i == 0 else acts.pop((i - 1, j))
        horizon = d if d > 0 else (1 if cfg.nag else 0)
        w = _predict(st, opt, horizon, cfg.predict == "aggmsnag") if cfg.predict and horizon else list(st.theta)
        out, saved = _forward(st, w, x)
        if i < n - 1:
            acts[(i, j)] = out
        kept[i][j] = (x, w, saved, out)

    def backward(i: int, j: int) -> None:
        st, d = sts[i], stale[i][j]
        x, w_fwd, saved, out = kept[i].pop(j)
        stash_here = cfg.ws and (cfg.ga != "ga_jfl" or i in ga_on)
        if d == 0 or (stash_here and cfg.ga != "ga_jfl"):
            w = w_fwd  # no step since the forward (a look-ahead stays), or the stash
        else:
            w = list(st.theta)  # the current weights
        if cfg.recompute:
            out, saved = _forward(st, w, x)
        if i == n - 1:
            dy = 2 * (out - microbatches[j][1]) / out.numel() * weight[j]
        else:
            dy = grads_in.pop((i + 1, j))
        grads, dx = _backward(st, w, saved, dy)
        st.grad = [g if a is None else a + g for a, g in zip(st.grad, grads, strict=True)]
        if i > 0:
            grads_in[(i, j)] = dx
        if d > 0:
            st.stale_in_step = True
            if i in ga_on and stash_here:
                gap = [(t - s).abs() for t, s in zip(st.theta, w_fwd, strict=True)]
                st.gaps = gap if st.gaps is None else [torch.maximum(a, b) for a, b in zip(st.gaps, gap, strict=True)]

    pos = [0] * n
    progress = True
    while progress:
        progress = False
        for i in range(n):
            while pos[i] < len(orders[i]):
                kind, j = orders[i][pos[i]]
                if kind == "F" and i > 0 and (i - 1, j) not in acts:
                    break
                if kind == "B" and i < n - 1 and (i + 1, j) not in grads_in:
                    break
                if kind == "F":
                    forward(i, j)
                elif kind == "B":
                    backward(i, j)
                else:
                    _step(sts[i], opt, i in ga_on, cfg.ws)
                pos[i] += 1
                progress = True
    assert all(pos[i] == len(orders[i]) for i in range(n)), "the reference schedule deadlocked"
    return [st.theta for st in sts]


# ---------------------------------------------------------------- the reference against its peers


def _peer_stage(seed: int = 0) -> tuple[list[str], list[torch.Tensor], torch.nn.Sequential]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    return ["linear", "tanh", "linear"], [p.detach().clone() for p in net.parameters()], net


def _peer_optimizer(opt: Opt, net: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    ps = list(net.parameters())
    groups = [{"params": ps[:1], "lr": 0.0}, {"params": ps[1:]}] if opt.lr0_first else [{"params": ps}]
    if opt.kind in ("sgd", "sutskever"):
        o = torch.optim.SGD(groups, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    elif opt.kind == "adam":
        o = torch.optim.Adam(groups, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
    else:
        o = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
    sched = None
    if opt.warmup is not None:
        sched = torch.optim.lr_scheduler.LinearLR(o, start_factor=opt.warmup[0], total_iters=opt.warmup[1])
    return o, sched


def _micro(m: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 3, generator=g, dtype=torch.float64))
            for _ in range(m)]


OPTS = {
    "sgd": Opt("sgd", lr=0.1, weight_decay=0.01),
    "adam": Opt("adam", lr=0.02, weight_decay=0.01),
    "adamw": Opt("adamw", lr=0.02, weight_decay=0.05),
}


def test_one_stage_reference_is_plain_training_with_torch():
    """One stage has no staleness: the reference is autograd plus torch.optim (and LinearLR) on the
    mean loss of each step's micro-batches, for every optimizer, warm-up and a group at rate 0."""
    import dataclasses
    import itertools

    for (name, opt), k, warm, lr0 in itertools.product(OPTS.items(), (1, 2), (None, (0.1, 4)), (False, True)):
        opt = dataclasses.replace(opt, warmup=warm, lr0_first=lr0)
        layers, theta, net = _peer_stage()
        data = _micro(5)
        (got,) = reference_async([(layers, theta)], opt, Config(step_every=k, recompute=k == 2), data)
        peer, sched = _peer_optimizer(opt, net)
        for start in range(0, len(data), k):
            group = data[start:start + k]
            for x, y in group:
                (torch.nn.functional.mse_loss(net(x), y) / len(group)).backward()
            peer.step()
            if sched is not None:
                sched.step()
            peer.zero_grad()
        for a, b in zip(got, net.parameters(), strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-12, msg=f"{name} k={k} warm={warm} lr0={lr0}")
        if lr0:
            assert torch.equal(got[0], theta[0])


def test_sutskever_reference_equals_pytorch_form_at_a_constant_rate():
    """At a constant rate the two momentum forms give the same weights (``v_s = eta v``)."""
    layers, theta, _ = _peer_stage()
    data = _micro(4)
    runs = [reference_async([(layers[:2], theta[:2]), (layers[2:], theta[2:])], Opt(kind, 0.1, 0.01), Config(), data)
            for kind in ("sgd", "sutskever")]
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_reference_schedule_and_staleness_by_hand():
    assert " ".join(f"{k}{j}" if k != "S" else "S" for k, j in _order(0, 2, 4, 2)) == "F0 F1 B0 F2 B1 S F3 B2 B3 S"
    assert _staleness(_order(0, 2, 6, 2)) == {0: 0, 1: 0, 2: 1, 3: 0, 4: 1, 5: 0}
    assert _staleness(_order(0, 4, 8, 1)) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 3, 5: 3, 6: 3, 7: 3}
