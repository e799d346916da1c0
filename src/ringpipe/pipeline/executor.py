"""The executor: runs any schedule's actions for one rank over a communicator.

One interpreter for every schedule: a rank holds one or more model *chunks* (virtual stages,
:mod:`ringpipe.pipeline.schedules_interleaved`; a pipeline without them is the one-chunk case),
each a :class:`~ringpipe.pipeline.stage.StageRuntime`. Chunk ``c`` of rank ``r`` of ``n`` is
virtual stage ``g = c * n + r``; its input comes from virtual stage ``g - 1`` (rank ``r - 1``,
or rank ``n - 1``'s chunk ``c - 1`` for ``r = 0``) and its output goes to ``g + 1``. Every
boundary between two virtual stages is its own pair of channels
(:mod:`ringpipe.pipeline.channel`); with several chunks they are told apart by a tag offset of
``1000 * (1 + chunk of the upstream virtual stage)``, so two ranks exchange up to ``chunks``
streams of activations and gradients, each consumed in the order it is sent.

For each action of the rank's list: ``F m.c`` takes the input (the first virtual stage from its
data, the others from the previous one), runs the chunk forward and sends the output on;
``B m.c`` takes the output gradient (the last virtual stage starts from its loss), runs the
backward and sends the input gradient back (only the input gradient where the list holds
``W`` actions for the chunk: the runtime's split backward); ``W m.c`` computes the weight
gradient; ``S`` sums the gradients of weights tied across stages (synchronous schedules),
averages gradients over the stage's replicas, gathers a tied weight's gradients on its owner
(asynchronous schedules, :mod:`ringpipe.pipeline.tied_owner`), then runs the weight policy's
``before_step``, ``optimizer.step()`` over every chunk's parameters, the tied owner's send or
the mirror's update, the LR scheduler, ``after_step`` and clears the gradients. Receives are
posted one action ahead, one per channel, so transfers overlap compute.

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

from ringpipe.comm.base import Communicator, Work
from ringpipe.pipeline.channel import (
    ActivationReceiver,
    ActivationSender,
    GradReceiver,
    GradSender,
    Meta,
)
from ringpipe.pipeline.model_io import batch_to
from ringpipe.pipeline.recompute import microbatch_seed
from ringpipe.pipeline.replicas import TiedGroup, average_gradients, sum_tied_gradients
from ringpipe.pipeline.schedules import Action
from ringpipe.pipeline.stage import StageError, StageRuntime
from ringpipe.pipeline.tied_owner import TiedOwnership

__all__ = ["ChunkedExecutor", "PipelineExecutor", "Ports", "RunResult", "TAG_STRIDE", "TaggedComm", "staleness_of"]

log = logging.getLogger(__name__)

InputFn = Callable[[int], Any]

#: tag offset between the channel pairs of two chunk boundaries (several chunks per rank)
TAG_STRIDE = 1000


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


class TaggedComm:
    """A view of a communicator whose point-to-point tags are shifted by ``offset``."""

    def __init__(self, comm: Communicator, offset: int) -> None:
        self.comm, self.offset = comm, offset

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        return self.comm.isend(tensor, dst, tag + self.offset)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        return self.comm.irecv(tensor, src, tag + self.offset)


@dataclass
class Ports:
    """One chunk's channels: activations in from / out to its neighbours, gradients the other way
    (``None`` where the chunk holds the first or last part of the model)."""

    act_in: ActivationReceiver | None
    act_out: ActivationSender | None
    grad_in: GradReceiver | None
    grad_out: GradSender | None


class PipelineExecutor:
    """Runs schedules for one rank holding ``runtimes`` (one per chunk) over ``comm``.

    ``num_stages``: ranks per pipeline; ``stage``: this rank's place; ``rank_of(s)``: the
    communicator rank holding stage ``s`` of this rank's pipeline (replica). ``replica_comm``
    groups this stage's replicas for gradient averaging (``None``: no replicas). ``seed``: when
    given, every forward of micro-batch ``m`` on virtual stage ``g`` runs with the generators
    seeded by ``microbatch_seed(seed, g, m + offset)``, so dropout masks do not depend on how the
    model is split (a single-process reference can reproduce them). ``tied``: weights held by
    several stages, each group with the communicator of its holders, whose gradients are summed
    before every step (synchronous schedules). ``tied_owned``: this rank's side of each group
    under the asynchronous rule (:class:`~ringpipe.pipeline.tied_owner.TiedOwnership`: the
    first holder steps the weight, the others keep mirrors of it).
    """

    def __init__(
        self,
        comm: Communicator,
        runtimes: Sequence[StageRuntime],
        optimizer: torch.optim.Optimizer,
        num_stages: int,
        stage: int,
        rank_of: Callable[[int], int],
        scheduler: Any = None,
        replica_comm: Communicator | None = None,
        seed: int | None = None,
        device: torch.device | None = None,
        tied: Sequence[TiedGroup] = (),
        tied_owned: Sequence[TiedOwnership] = (),
    ) -> None:
        self.comm, self.runtimes, self.optimizer = comm, list(runtimes), optimizer
        self.scheduler, self.replica_comm, self.seed = scheduler, replica_comm, seed
        self.device = device or torch.device("cpu")
        self.tied = list(tied)
        self.tied_owned = list(tied_owned)
        self.num_stages, self.stage, self.chunks = num_stages, stage, len(self.runtimes)
        self.total = num_stages * self.chunks
        #: the weight policy (one for the rank: every chunk's runtime holds the same)
        self.policy = self.runtimes[0].policy
        self.params = [p for rt in self.runtimes for p in rt.module.parameters() if p.requires_grad]
        self.steps_taken = 0
        self.microbatches_seen = 0
        self._metas: dict[tuple[int, int], Meta] = {}  # output shapes of micro-batches in flight (for their gradients)
        self._stream_base: int | None = None  # microbatches_seen when the open stream began
        n = num_stages
        self.ports: list[Ports] = []
        for c in range(self.chunks):
            g = self.part(c)
            first, last = g == 0, g == self.total - 1
            up: Any = comm
            down: Any = comm
            if self.chunks > 1:
                up = TaggedComm(comm, TAG_STRIDE * (1 + (g - 1) // n))  # the boundary g-1 -> g
                down = TaggedComm(comm, TAG_STRIDE * (1 + g // n))  # the boundary g -> g+1
            prev = None if first else rank_of((g - 1) % n)
            nxt = None if last else rank_of((g + 1) % n)
            self.ports.append(Ports(
                act_in=None if prev is None else ActivationReceiver(up, prev, self.device),
                act_out=None if nxt is None else ActivationSender(down, nxt, g),
                grad_in=None if nxt is None else GradReceiver(down, nxt, self.device),
                grad_out=None if prev is None else GradSender(up, prev),
            ))

    def part(self, chunk: int) -> int:
        """The virtual stage (part of the model) chunk ``chunk`` of this rank holds."""
        return chunk * self.num_stages + self.stage

    # the first chunk's channels (a one-chunk pipeline's only ones), as benchmarks and tests read them
    @property
    def rt(self) -> StageRuntime:
        """The first chunk's runtime (a one-chunk pipeline's only one)."""
        return self.runtimes[0]

    @property
    def act_in(self) -> ActivationReceiver | None:
        return self.ports[0].act_in

    @property
    def act_out(self) -> ActivationSender | None:
        return self.ports[0].act_out

    @property
    def grad_in(self) -> GradReceiver | None:
        return self.ports[0].grad_in

    @property
    def grad_out(self) -> GradSender | None:
        return self.ports[0].grad_out

    @property
    def in_flight(self) -> int:
        """Micro-batches whose activations some chunk holds."""
        return sum(rt.in_flight for rt in self.runtimes)

    # ------------------------------------------------------------------ step

    def step(self) -> None:
        """Tied weights' and replicas' gradients, then the policy hooks around optimizer (and scheduler) step."""
        sum_tied_gradients(self.tied)
        if self.replica_comm is not None:
            average_gradients(self.params, self.replica_comm)
        for owned in self.tied_owned:  # the owner's sum is what its policy (Gap Aware) acts on
            owned.gather()
        self.policy.before_step()
        self.optimizer.step()
        for owned in self.tied_owned:  # the owner sends the new weights; a mirror takes an earlier update
            owned.after_step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.policy.after_step()
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
        """Run this rank's ``actions``.

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
        for rt in self.runtimes:
            rt.module.train()
        if staleness is None:
            staleness = staleness_of(actions)
        if self._stream_base is None:
            self._stream_base = self.microbatches_seen
        base = self._stream_base
        split = {a.chunk for a in actions if a.kind == "W"}
        fwd_left = [sum(1 for a in actions if a.kind == "F" and a.chunk == c) for c in range(self.chunks)]
        bwd_order = [[a.mb for a in actions if a.kind == "B" and a.chunk == c] for c in range(self.chunks)]
        b_pos = [0] * self.chunks
        metas = self._metas
        result = RunResult()
        self._reset_channels()
        for owned in self.tied_owned:
            owned.begin_run(sum(1 for a in actions if a.kind == "S"))
        for c, ports in enumerate(self.ports):
            if ports.act_in is not None and fwd_left[c]:
                ports.act_in.prefetch()

        def prefetch_grad(c: int) -> None:
            ch = self.ports[c].grad_in
            if ch is None or ch.posted or b_pos[c] >= len(bwd_order[c]):
                return
            key = (c, bwd_order[c][b_pos[c]])
            if key in metas:
                ch.prefetch(key[1], metas[key])

        try:
            for a in actions:
                c, mb = a.chunk, a.mb
                rt, ports = self.runtimes[c], self.ports[c]
                if a.kind == "F":
                    fwd_left[c] -= 1
                    x, run = self._input(c, mb, inputs, run_length, fwd_left[c] > 0)
                    target = None
                    if rt.is_last:
                        if targets is None:
                            raise ValueError(f"stage {self.stage} holds the last part of the model and needs targets")
                        target = batch_to(targets(mb), self.device)  # as the inputs are
                    w = weights(mb) if weights is not None else 1.0
                    seed = None if self.seed is None else microbatch_seed(self.seed, self.part(c), base + mb)
                    out, loss, metrics = rt.forward(mb, x, staleness.get(mb, 0), target, w, seed)
                    if ports.act_out is not None:
                        metas[(c, mb)] = Meta.of(out)
                        ports.act_out.send(out, run)
                    if loss is not None:
                        result.losses[mb], result.weights[mb] = loss, w
                        if metrics:
                            result.metrics[mb] = metrics
                    prefetch_grad(c)
                elif a.kind == "B":
                    grad = None
                    if ports.grad_in is not None:
                        grad = ports.grad_in.get(mb, metas.pop((c, mb)))
                    b_pos[c] += 1
                    prefetch_grad(c)
                    backward = rt.backward_input if c in split else rt.backward
                    grads_in = backward(mb, grad)
                    if ports.grad_out is not None:
                        ports.grad_out.send(grads_in)
                elif a.kind == "W":
                    rt.backward_weight(mb)
                else:
                    self.step()
                    result.steps += 1
        except BaseException:
            for rt in self.runtimes:
                rt.clear()
            for owned in self.tied_owned:
                owned.abandon()
            self._metas.clear()
            self._stream_base = None
            raise
        self.microbatches_seen += len({a.mb for a in actions if a.kind == "F"})
        if keep_open:
            return result
        self._stream_base = None
        self._metas.clear()
        self._wait_sends()
        for owned in self.tied_owned:  # the mirrors take the updates still pending: every copy is equal again
            owned.close()
        if self.in_flight:
            raise StageError(
                f"stage {self.stage}: {self.in_flight} micro-batches are still in flight at the end of "
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
        """Forward ``num_microbatches`` micro-batches through every chunk without gradients (modules in eval mode)."""
        result = RunResult()
        for rt in self.runtimes:
            rt.module.eval()
        self._reset_channels()
        try:
            for mb in range(num_microbatches):
                for c, rt in enumerate(self.runtimes):
                    x, run = self._input(c, mb, inputs, run_length, mb + 1 < num_microbatches)
                    target = batch_to(targets(mb), self.device) if rt.is_last and targets is not None else None
                    out, loss, metrics = rt.evaluate(x, target)
                    sender = self.ports[c].act_out
                    if sender is not None:
                        sender.send(out, run)
                    if loss is not None:
                        result.losses[mb] = loss
                        result.weights[mb] = weights(mb) if weights is not None else 1.0
                        if metrics:
                            result.metrics[mb] = metrics
        finally:
            for rt in self.runtimes:
                rt.module.train()
        for ports in self.ports:  # not the gradient sends of an open stream: a later window receives them
            if ports.act_out is not None:
                ports.act_out.wait()
        return result

    # ------------------------------------------------------------------ helpers

    def _input(self, c: int, mb: int, inputs: InputFn | None, run_length: Callable[[int], int] | None,
               more: bool) -> tuple[Any, int]:
        """Chunk ``c``'s input for micro-batch ``mb``: received, or the data (the first part of the model)."""
        ch = self.ports[c].act_in
        if ch is not None:
            return ch.get(prefetch_next=more)
        if inputs is None:
            raise ValueError(f"stage {self.stage} holds the first part of the model and needs inputs")
        x = batch_to(inputs(mb), self.device)
        return x, (max(1, run_length(mb)) if run_length is not None else 1)

    def _reset_channels(self) -> None:
        for ports in self.ports:
            for ch in (ports.act_in, ports.act_out):
                if ch is not None:
                    ch.reset()

    def _wait_sends(self) -> None:
        for ports in self.ports:
            for ch in (ports.act_out, ports.grad_out):
                if ch is not None:
                    ch.wait()


#: The former name of the executor of chunked and split-backward schedules: now the one executor.
ChunkedExecutor = PipelineExecutor

