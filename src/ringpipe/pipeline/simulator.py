"""Single-process simulator of the asynchronous 1F1B pipeline: schedules, staleness and plumbing.

(The time any schedule's action lists imply, and their bubble fraction, come from
:mod:`ringpipe.pipeline.bubble`, re-exported here: :func:`simulate_timing`,
:func:`bubble_fraction`.)

It replays, in one process, an N-stage PipeDream pipeline without flush, stage by stage, with
the same :class:`~ringpipe.pipeline.policy.WeightPolicy` objects the multi-process executor
calls. It is good for what does not depend on those objects being right: the event order of
each stage, the staleness of every micro-batch, the order of the policy hooks, and training
curves of the mitigations where no process is wanted (``benchmarks/staleness.py``).

**What it does not check.** Because it builds its policies with
:func:`~ringpipe.pipeline.staleness.make_policy` and calls the same hooks as the executor, a
wrong mitigation formula (weight prediction, Gap Aware's penalty, its statistics, which
weights a stash holds) is wrong in the simulator too, and the two agree. Those formulas are
checked against a reference that shares no code with them: hand-made tensors in the staleness
tests, and a one-process reference of the whole pipeline written from the papers' formulas,
which the multi-process runs must match (``tests/unit/pipeline/test_pipeline_reference.py`` and
``tests/ranks/pipeline/test_pipeline_async.py``).

**Event order.** Stage ``i`` of ``N`` with ``M`` micro-batches runs
:func:`async_stage_order`: warm-up forwards ``F0 .. F(N-1-i)``, then ``B(j), F(j+N-i)``
alternately, then the remaining backwards; ``S`` (optimizer step) follows every
``step_every``-th backward and the last one. Stage ``i``'s ``F j`` runs after stage ``i-1``'s
``F j``; its ``B j`` after stage ``i+1``'s ``B j``. A stage's numbers depend only on its own order
and its inputs, so any interleaving that respects these dependencies gives the same result.
The staleness of micro-batch ``j`` on a stage is the number of ``S`` between its ``F j`` and
``B j``: ``N-1-i`` in steady state with ``step_every=1``, ``j`` for warm-up micro-batch ``j``.

**Hooks.** ``before_forward(j, d) -> forward -> after_forward(j)``;
``before_backward(j) -> [recompute] -> backward -> after_backward(j)``;
``before_step() -> optimizer.step() -> scheduler.step() -> after_step() -> zero_grad``.
The loss of each micro-batch is divided by the number of micro-batches of its step, so the
stepped gradient is the mean over the step's micro-batches.

**Stale with and without recomputation** (ALGORITHMS.md §1 "Stale"). With recomputation the
forward runs under ``no_grad`` (keeping the input and the RNG state) and is replayed right
before the backward, after ``before_backward``: activations *and* weights of the gradient are
the backward-time ones (the current weights for ``stale``, the stash for ``ws``). Without
recomputation the graph of the forward is kept: the saved activations are those of the
forward-time weights (predicted ones under ``wp``), while every weight the backward reads (the
``W`` in ``dL/dx = dL/dy W`` that carries the gradient to earlier layers of the stage) is the
value in the parameter storage at backward time. So for ``stale`` the gradient mixes old
activations with current weights; for ``ws`` both are the forward-time ones and the result
equals ``ws`` with recomputation; a stage made of one linear layer gets the same weight
gradient either way (it only needs activations).

**Autograd and in-place updates.** Optimizers and policies update parameters in place between
a forward and its backward, which autograd rejects for tensors it saved. Without
recomputation the forward therefore runs through :func:`~ringpipe.pipeline.staleness.live_forward`
(aliases sharing each parameter's storage with their own version counter, gradients flowing
into ``p.grad``); policies change weights with ``p.copy_`` only, never by rebinding ``p.data``.
Normalisation buffers are frozen during a replay so running statistics move once, and are
given fresh copies before a kept-graph forward (autograd saves them with the graph).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ringpipe.pipeline.bubble import Timing, bubble_fraction, simulate_timing
from ringpipe.pipeline.policy import WeightPolicy
from ringpipe.pipeline.recompute import RngState, frozen_buffers
from ringpipe.pipeline.stage import renew_buffers
from ringpipe.pipeline.staleness.live_params import live_forward
from ringpipe.pipeline.staleness.policy_factory import make_policy

__all__ = [
    "SimulationResult",
    "Timing",
    "bubble_fraction",
    "simulate_timing",
    "async_stage_order",
    "order_staleness",
    "simulate_async",
    "simulate_sync",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Microbatch = tuple[torch.Tensor, torch.Tensor]


def async_stage_order(
    stage: int, num_stages: int, num_microbatches: int, step_every: int = 1
) -> list[str]:
    """Stage ``stage``'s actions in the asynchronous 1F1B schedule, e.g. ``["F0","F1","B0","S",...]``."""
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not in [0, num_stages={num_stages})")
    if num_microbatches < 1 or step_every < 1:
        raise ValueError(
            f"need num_microbatches >= 1 and step_every >= 1, got {num_microbatches} and {step_every}"
        )
    warmup = min(num_stages - stage, num_microbatches)
    out = [f"F{j}" for j in range(warmup)]
    next_f = warmup
    for b in range(num_microbatches):
        out.append(f"B{b}")
        if (b + 1) % step_every == 0 or b == num_microbatches - 1:
            out.append("S")
        if next_f < num_microbatches:
            out.append(f"F{next_f}")
            next_f += 1
    return out


def order_staleness(order: Sequence[str]) -> dict[int, int]:
    """Per micro-batch, the number of steps ``S`` between its forward and its backward."""
    steps = 0
    at_forward: dict[int, int] = {}
    out: dict[int, int] = {}
    for a in order:
        if a == "S":
            steps += 1
        elif a[0] == "F":
            at_forward[int(a[1:])] = steps
        else:
            out[int(a[1:])] = steps - at_forward[int(a[1:])]
    return out


@dataclass
class SimulationResult:
    """What a simulation produced: per-micro-batch losses (forward-time values) and the trace."""

    losses: list[float]
    orders: list[list[str]] = field(default_factory=list)
    staleness: list[dict[int, int]] = field(default_factory=list)
    events: list[tuple[int, str]] = field(default_factory=list)


def _check(stages: Sequence[nn.Module], optimizers: Sequence[Any], schedulers: Sequence[Any] | None,
           microbatches: Sequence[Microbatch]) -> list[Any]:
    if not stages:
        raise ValueError("stages is empty; pass one nn.Module per pipeline stage")
    if len(optimizers) != len(stages):
        raise ValueError(f"{len(optimizers)} optimizers for {len(stages)} stages; pass one per stage")
    if schedulers is not None and len(schedulers) != len(stages):
        raise ValueError(f"{len(schedulers)} schedulers for {len(stages)} stages; pass one per stage (or None)")
    if not microbatches:
        raise ValueError("microbatches is empty; pass a list of (inputs, targets)")
    return list(schedulers) if schedulers is not None else [None] * len(stages)


def _group_size(mb: int, step_every: int, num_microbatches: int) -> int:
    start = (mb // step_every) * step_every
    return min(step_every, num_microbatches - start)


def simulate_async(
    stages: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    loss_fn: LossFn,
    microbatches: Sequence[Microbatch],
    mitigations: str | Sequence[str] = "stale",
    *,
    step_every: int = 1,
    recompute: bool = False,
    schedulers: Sequence[Any] | None = None,
    policies: Sequence[WeightPolicy] | None = None,
    **policy_options: Any,
) -> SimulationResult:
    """Train ``stages`` in place on ``microbatches`` as the asynchronous pipeline would.

    ``policies`` (one per stage) overrides the ones built by
    :func:`~ringpipe.pipeline.staleness.make_policy` from ``mitigations`` and
    ``policy_options`` (``nag_with_predictor``, ``ga_stages``, ...).
    """
    scheds = _check(stages, optimizers, schedulers, microbatches)
    n, m = len(stages), len(microbatches)
    if policies is None:
        policies = [
            make_policy(mitigations, list(stages[i].parameters()), optimizers[i], scheds[i],
                        stage=i, num_stages=n, step_every=step_every, recompute=recompute,
                        **policy_options)
            for i in range(n)
        ]
    elif len(policies) != n:
        raise ValueError(f"{len(policies)} policies for {n} stages; pass one per stage")
    orders = [async_stage_order(i, n, m, step_every) for i in range(n)]
    stale = [order_staleness(o) for o in orders]
    result = SimulationResult([float("nan")] * m, orders, stale)
    acts: dict[tuple[int, int], torch.Tensor] = {}
    grads: dict[tuple[int, int], torch.Tensor | None] = {}
    saved: list[dict[int, tuple[torch.Tensor, Any, RngState]]] = [{} for _ in range(n)]
    pos = [0] * n

    def forward(i: int, j: int) -> None:
        x = microbatches[j][0] if i == 0 else acts.pop((i - 1, j))
        if i > 0 and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        policies[i].before_forward(j, stale[i][j])
        rng = RngState.capture()
        if recompute:
            with torch.no_grad():
                out = stages[i](x)
        else:
            renew_buffers(stages[i])
            out = live_forward(stages[i], x)
        policies[i].after_forward(j)
        if i == n - 1:
            loss = loss_fn(out, microbatches[j][1])
            result.losses[j] = float(loss.detach())
            out = loss
        else:
            acts[(i, j)] = out.detach()
        saved[i][j] = (x, out, rng)

    def backward(i: int, j: int) -> None:
        x, out, rng = saved[i].pop(j)
        policies[i].before_backward(j)
        if recompute:
            with rng.replay(), frozen_buffers(stages[i]):
                out = stages[i](x)
            if i == n - 1:
                out = loss_fn(out, microbatches[j][1])
        if i == n - 1:
            (out / _group_size(j, step_every, m)).backward()
        else:
            out.backward(grads.pop((i + 1, j)))
        if i > 0:
            grads[(i, j)] = x.grad
        policies[i].after_backward(j)

    def step(i: int) -> None:
        policies[i].before_step()
        optimizers[i].step()
        if scheds[i] is not None:
            scheds[i].step()
        policies[i].after_step()
        optimizers[i].zero_grad(set_to_none=True)

    progress = True
    while progress:
        progress = False
        for i in range(n):
            while pos[i] < len(orders[i]):
                a = orders[i][pos[i]]
                if a == "S":
                    step(i)
                else:
                    j = int(a[1:])
                    if a[0] == "F":
                        if i > 0 and (i - 1, j) not in acts:
                            break
                        forward(i, j)
                    else:
                        if i < n - 1 and (i + 1, j) not in grads:
                            break
                        backward(i, j)
                result.events.append((i, a))
                pos[i] += 1
                progress = True
    stuck = [f"stage {i} at {orders[i][pos[i]]}" for i in range(n) if pos[i] < len(orders[i])]
    if stuck:
        raise RuntimeError(f"the simulated pipeline deadlocked: {', '.join(stuck)}")
    return result


def simulate_sync(
    stages: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    loss_fn: LossFn,
    microbatches: Sequence[Microbatch],
    *,
    step_every: int = 1,
    schedulers: Sequence[Any] | None = None,
) -> SimulationResult:
    """The synchronous reference (GPipe-equivalent): gradient accumulation, no staleness.

    Every ``step_every`` micro-batches (and at the end) all stages step together; each
    micro-batch's forward and backward see the same weights.
    """
    scheds = _check(stages, optimizers, schedulers, microbatches)
    m = len(microbatches)
    losses: list[float] = []
    for start in range(0, m, step_every):
        group = microbatches[start:start + step_every]
        for x, y in group:
            out = x
            for s in stages:
                out = s(out)
            loss = loss_fn(out, y)
            losses.append(float(loss.detach()))
            (loss / len(group)).backward()
        for opt, sched in zip(optimizers, scheds, strict=True):
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad(set_to_none=True)
    return SimulationResult(losses)
