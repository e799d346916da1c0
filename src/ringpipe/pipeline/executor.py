"""The executor: runs any schedule's actions for one stage over a communicator.

For each action of the stage's list: ``F m`` takes the input (the first stage from its data,
the others from the previous stage), runs the stage forward and sends the output on; ``B m``
takes the output gradient (the last stage starts from its loss), runs the backward and sends
the input gradient back; ``S`` averages gradients over the stage's replicas, then runs the
weight policy's ``before_step``, ``optimizer.step()``, the LR scheduler, ``after_step`` and
clears the gradients. Receives are posted one action ahead so transfers overlap compute.

Each micro-batch's staleness (optimizer steps between its forward and its backward on this
stage, 0 for flushing schedules) is given to the weight policy at forward time.

A run may also be one window of a longer stream (``keep_open``): micro-batches forwarded in
it are backwarded by a later run, micro-batch numbers go on from window to window, and the
sends of a window are not waited for at its end (their receives are posted by the neighbour's
next window). Only the run that closes the stream waits for them and checks that nothing is
left in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ringpipe.comm.base import Communicator
from ringpipe.pipeline.channel import (
    ActivationReceiver,
    ActivationSender,
    GradReceiver,
    GradSender,
    Meta,
)
from ringpipe.pipeline.recompute import microbatch_seed
from ringpipe.pipeline.replicas import average_gradients, share_first_tied_gradients, sum_tied_gradients
from ringpipe.pipeline.schedules import Action
from ringpipe.pipeline.model_io import batch_to
from ringpipe.pipeline.stage import StageError, StageRuntime

__all__ = ["PipelineExecutor", "RunResult", "staleness_of"]

log = logging.getLogger(__name__)

InputFn = Callable[[int], Any]


@dataclass
class RunResult:
    """What one run of a schedule produced on this stage (losses and metrics on the last stage)."""

    losses: dict[int, float] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    steps: int = 0

    def mean_loss(self) -> float | None:
        """Loss of the run: micro-batch losses weighted like their gradients, normalised."""
        if not self.losses:
            return None
        total = sum(self.weights.get(m, 1.0) for m in self.losses)
        return sum(v * self.weights.get(m, 1.0) for m, v in self.losses.items()) / total

    def mean_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if not self.metrics:
            return out
        total = sum(self.weights.get(m, 1.0) for m in self.metrics)
        for m, vals in self.metrics.items():
            for k, v in vals.items():
                out[k] = out.get(k, 0.0) + v * self.weights.get(m, 1.0) / total
        return out


def staleness_of(actions: Sequence[Action]) -> dict[int, int]:
    """Optimizer steps between each micro-batch's forward and backward in a stage's action list."""
    steps = 0
    at_fwd: dict[int, int] = {}
    out: dict[int, int] = {}
    for a in actions:
        if a.kind == "S":
            steps += 1
        elif a.kind == "F":
            at_fwd[a.mb] = steps
        else:
            out[a.mb] = steps - at_fwd[a.mb]
    return {mb: out.get(mb, 0) for mb in at_fwd}


class PipelineExecutor:
    """Runs schedules for one stage: compute from :class:`StageRuntime`, messages over ``comm``.

    ``prev_rank`` / ``next_rank`` are ranks of ``comm`` (``None`` on the first / last stage);
    ``replica_comm`` groups this stage's replicas for gradient averaging (``None``: no
    replicas). ``seed``: when given, every forward of micro-batch ``m`` runs with the
    generators seeded by ``microbatch_seed(seed, stage, m + offset)``, so dropout masks do
    not depend on how the model is split (a single-process reference can reproduce them).
    """

    def __init__(
        self,
        comm: Communicator,
        runtime: StageRuntime,
        optimizer: torch.optim.Optimizer,
        prev_rank: int | None,
        next_rank: int | None,
        scheduler: Any = None,
        replica_comm: Communicator | None = None,
        seed: int | None = None,
        device: torch.device | None = None,
        tied: Sequence[tuple[Sequence[torch.nn.Parameter], Communicator]] = (),
        tied_after_policy: bool = False,
    ) -> None:
        self.comm = comm
        self.rt = runtime
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.replica_comm = replica_comm
        self.seed = seed
        self.device = device or torch.device("cpu")
        self.tied = list(tied)
        #: asynchronous schedules: after the policy's before_step, the holders of a tied weight take the
        #: first holder's gradient (decided alike on every holder, whatever each stage's policy is)
        self.tied_after_policy = tied_after_policy
        self.stage = runtime.stage
        self.params = [p for p in runtime.module.parameters() if p.requires_grad]
        self.act_in = ActivationReceiver(comm, prev_rank, self.device) if prev_rank is not None else None
        self.act_out = ActivationSender(comm, next_rank, self.stage) if next_rank is not None else None
        self.grad_in = GradReceiver(comm, next_rank, self.device) if next_rank is not None else None
        self.grad_out = GradSender(comm, prev_rank) if prev_rank is not None else None
        self.steps_taken = 0
        self.microbatches_seen = 0
        self._metas: dict[int, Meta] = {}  # output shapes of micro-batches in flight (for their gradients)
        self._stream_base: int | None = None  # microbatches_seen when the open stream began

    # ------------------------------------------------------------------ step

    def step(self) -> None:
        """Average over replicas, then the policy hooks around optimizer (and scheduler) step."""
        sum_tied_gradients(self.tied)
        if self.replica_comm is not None:
            average_gradients(self.params, self.replica_comm)
        self.rt.policy.before_step()
        if self.tied and self.tied_after_policy:  # a mitigation may have rescaled them, differently per stage
            share_first_tied_gradients(self.tied)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.rt.policy.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1

    # ------------------------------------------------------------------ run

    def run(
        self,
        actions: Sequence[Action],
        inputs: InputFn | None = None,
        targets: InputFn | None = None,
        weights: Callable[[int], float] | None = None,
        run_length: Callable[[int], int] | None = None,
        *,
        staleness: Mapping[int, int] | None = None,
        keep_open: bool = False,
    ) -> RunResult:
        """Run one stage's ``actions``.

        ``inputs(m)`` (first stage) and ``targets(m)`` (last stage) give micro-batch ``m``'s data;
        they are called in forward order. ``weights(m)`` scales micro-batch ``m``'s loss (e.g.
        its share of the batch). ``run_length(m)`` (first stage): how many micro-batches from
        ``m`` on have the same input shapes (default 1: a shape header with every micro-batch);
        a run of shapes must not go past the end of ``actions``' forwards.

        ``staleness`` (micro-batch -> steps between its forward and its backward) defaults to
        what ``actions`` imply; a window of a stream passes the stream's values. ``keep_open``:
        ``actions`` are one window of a stream and micro-batches may stay in flight until a
        later run; the stream's last window is run with ``keep_open=False``.
        """
        self.rt.module.train()
        if staleness is None:
            staleness = staleness_of(actions)
        if self._stream_base is None:
            self._stream_base = self.microbatches_seen
        base = self._stream_base
        fwd_order = [a.mb for a in actions if a.kind == "F"]
        bwd_order = [a.mb for a in actions if a.kind == "B"]
        f_pos = b_pos = 0
        metas = self._metas
        result = RunResult()
        self._reset_channels()
        if self.act_in is not None and fwd_order:
            self.act_in.prefetch()
        try:
            for a in actions:
                if a.kind == "F":
                    mb = a.mb
                    f_pos += 1
                    if self.act_in is None:
                        if inputs is None:
                            raise ValueError(f"stage {self.stage} is the first stage and needs inputs")
                        x = batch_to(inputs(mb), self.device)
                        run = max(1, run_length(mb)) if run_length is not None else 1
                    else:
                        x, run = self.act_in.get(prefetch_next=f_pos < len(fwd_order))
                    target = None
                    if self.rt.is_last:
                        if targets is None:
                            raise ValueError(f"stage {self.stage} is the last stage and needs targets")
                        target = targets(mb)
                    w = weights(mb) if weights is not None else 1.0
                    seed = None if self.seed is None else microbatch_seed(self.seed, self.stage, base + mb)
                    out, loss, metrics = self.rt.forward(mb, x, staleness.get(mb, 0), target, w, seed)
                    if self.act_out is not None:
                        metas[mb] = Meta.of(out)
                        self.act_out.send(out, run)
                    if loss is not None:
                        result.losses[mb], result.weights[mb] = loss, w
                        if metrics:
                            result.metrics[mb] = metrics
                    self._prefetch_grad(bwd_order, b_pos, metas)
                elif a.kind == "B":
                    mb = a.mb
                    b_pos += 1
                    g = None
                    if self.grad_in is not None:
                        g = self.grad_in.get(mb, metas.pop(mb))
                        self._prefetch_grad(bwd_order, b_pos, metas)
                    grads_in = self.rt.backward(mb, g)
                    if self.grad_out is not None:
                        self.grad_out.send(grads_in)
                else:
                    self.step()
                    result.steps += 1
        except BaseException:
            self.rt.clear()
            self._metas.clear()
            self._stream_base = None
            raise
        self.microbatches_seen += len(fwd_order)
        if keep_open:
            return result
        self._stream_base = None
        self._metas.clear()
        self._wait_sends()
        if self.rt.in_flight:
            raise StageError(
                f"stage {self.stage}: {self.rt.in_flight} micro-batches are still in flight at the end of "
                "the run; a run that closes a stream must hold the backward of every forward"
            )
        return result

    def evaluate(
        self,
        num_microbatches: int,
        inputs: InputFn | None = None,
        targets: InputFn | None = None,
        weights: Callable[[int], float] | None = None,
        run_length: Callable[[int], int] | None = None,
    ) -> RunResult:
        """Forward ``num_microbatches`` micro-batches without gradients (modules in eval mode)."""
        self.rt.module.eval()
        result = RunResult()
        self._reset_channels()
        try:
            for mb in range(num_microbatches):
                if self.act_in is None:
                    assert inputs is not None, "the first stage needs inputs"
                    x = batch_to(inputs(mb), self.device)
                    run = max(1, run_length(mb)) if run_length is not None else 1
                else:
                    x, run = self.act_in.get(prefetch_next=mb + 1 < num_microbatches)
                target = targets(mb) if self.rt.is_last and targets is not None else None
                out, loss, metrics = self.rt.evaluate(x, target)
                if self.act_out is not None:
                    self.act_out.send(out, run)
                if loss is not None:
                    w = weights(mb) if weights is not None else 1.0
                    result.losses[mb], result.weights[mb] = loss, w
                    if metrics:
                        result.metrics[mb] = metrics
        finally:
            self.rt.module.train()
        if self.act_out is not None:
            self.act_out.wait()  # not the gradient sends of an open stream: a later window receives them
        return result

    # ------------------------------------------------------------------ helpers

    def _prefetch_grad(self, bwd_order: list[int], b_pos: int, metas: dict[int, Meta]) -> None:
        if self.grad_in is None or self.grad_in.posted or b_pos >= len(bwd_order):
            return
        nxt = bwd_order[b_pos]
        if nxt in metas:
            self.grad_in.prefetch(nxt, metas[nxt])

    def _reset_channels(self) -> None:
        if self.act_in is not None:
            self.act_in.reset()
        if self.act_out is not None:
            self.act_out.reset()

    def _wait_sends(self) -> None:
        for ch in (self.act_out, self.grad_out):
            if ch is not None:
                ch.wait()
