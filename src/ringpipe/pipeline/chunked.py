"""The executor of schedules that hold several model chunks per rank or split the backward.

It runs :mod:`ringpipe.pipeline.schedules_interleaved` (chunks: virtual stages) and
:mod:`ringpipe.pipeline.zero_bubble` (``B`` and ``W``) for one rank. Chunk ``c`` of rank
``r`` of ``n`` is virtual stage ``g = c * n + r``; its input comes from virtual stage ``g - 1``
(rank ``r - 1``, or rank ``n - 1``'s chunk ``c - 1`` for ``r = 0``) and its output goes to
``g + 1``. Every boundary between two virtual stages is its own pair of channels
(:mod:`ringpipe.pipeline.channel`), told apart by a tag offset of ``1000 * (1 + chunk of the
upstream virtual stage)``: two ranks exchange up to ``chunks`` streams of activations and
gradients, each consumed in the order it is sent. Receives are posted ahead, one per channel.

Actions: ``F m.c`` forward (the first virtual stage reads the data, the last computes the
loss), ``B m.c`` backward (input gradient only where the list holds ``W`` actions for the
chunk, :class:`~ringpipe.pipeline.split_backward.SplitStageRuntime`), ``W m.c`` weight
gradient, ``S`` step: gradients averaged over the replicas, then one optimizer step over
every chunk's parameters. Synchronous schedules only: nothing is stale, and the weight policy
is the plain one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
from ringpipe.pipeline.executor import InputFn, RunResult
from ringpipe.pipeline.recompute import microbatch_seed
from ringpipe.pipeline.replicas import average_gradients, sum_tied_gradients
from ringpipe.pipeline.schedules import Action
from ringpipe.pipeline.model_io import batch_to
from ringpipe.pipeline.stage import StageError, StageRuntime

__all__ = ["ChunkedExecutor", "TaggedComm", "TAG_STRIDE"]

TAG_STRIDE = 1000


class TaggedComm:
    """A view of a communicator whose point-to-point tags are shifted by ``offset``."""

    def __init__(self, comm: Communicator, offset: int) -> None:
        self.comm, self.offset = comm, offset

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        return self.comm.isend(tensor, dst, tag + self.offset)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        return self.comm.irecv(tensor, src, tag + self.offset)


class ChunkedExecutor:
    """Runs chunked / split-backward schedules for one rank holding ``runtimes`` (one per chunk).

    ``num_stages``: ranks per pipeline; ``stage``: this rank's place; ``rank_of(s)``: the
    communicator rank holding stage ``s`` of this rank's pipeline (replica).
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
        tied: Sequence[tuple[Sequence[torch.nn.Parameter], Communicator]] = (),
    ) -> None:
        self.comm, self.runtimes, self.optimizer = comm, list(runtimes), optimizer
        self.scheduler, self.replica_comm, self.seed = scheduler, replica_comm, seed
        self.device = device or torch.device("cpu")
        self.tied = list(tied)
        self.num_stages, self.stage, self.chunks = num_stages, stage, len(self.runtimes)
        self.total = num_stages * self.chunks
        self.params = [p for rt in self.runtimes for p in rt.module.parameters() if p.requires_grad]
        self.steps_taken = 0
        self.microbatches_seen = 0
        n = num_stages
        self.act_in: list[ActivationReceiver | None] = []
        self.act_out: list[ActivationSender | None] = []
        self.grad_in: list[GradReceiver | None] = []
        self.grad_out: list[GradSender | None] = []
        for c in range(self.chunks):
            g = self.part(c)
            prev, nxt = rank_of((g - 1) % n), rank_of((g + 1) % n)
            up = TaggedComm(comm, TAG_STRIDE * (1 + (g - 1) // n))  # the boundary g-1 -> g
            down = TaggedComm(comm, TAG_STRIDE * (1 + g // n))  # the boundary g -> g+1
            first, last = g == 0, g == self.total - 1
            self.act_in.append(None if first else ActivationReceiver(up, prev, self.device))  # type: ignore[arg-type]
            self.grad_out.append(None if first else GradSender(up, prev))  # type: ignore[arg-type]
            self.act_out.append(None if last else ActivationSender(down, nxt, g))  # type: ignore[arg-type]
            self.grad_in.append(None if last else GradReceiver(down, nxt, self.device))  # type: ignore[arg-type]

    def part(self, chunk: int) -> int:
        """The virtual stage (part of the model) chunk ``chunk`` of this rank holds."""
        return chunk * self.num_stages + self.stage

    @property
    def in_flight(self) -> int:
        return sum(rt.in_flight for rt in self.runtimes)

    def step(self) -> None:
        sum_tied_gradients(self.tied)
        if self.replica_comm is not None:
            average_gradients(self.params, self.replica_comm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1

    def _input(self, c: int, mb: int, inputs: InputFn | None, run_length: Callable[[int], int] | None,
               more: bool) -> tuple[Any, int]:
        ch = self.act_in[c]
        if ch is not None:
            return ch.get(prefetch_next=more)
        if inputs is None:
            raise ValueError(f"stage {self.stage} holds the first part of the model and needs inputs")
        x = batch_to(inputs(mb), self.device)
        return x, (max(1, run_length(mb)) if run_length is not None else 1)

    def run(
        self,
        actions: Sequence[Action],
        inputs: InputFn | None = None,
        targets: InputFn | None = None,
        weights: Callable[[int], float] | None = None,
        run_length: Callable[[int], int] | None = None,
    ) -> RunResult:
        """Run this rank's ``actions`` (arguments as :meth:`PipelineExecutor.run`)."""
        for rt in self.runtimes:
            rt.module.train()
        split = {a.chunk for a in actions if a.kind == "W"}
        fwd_left = [sum(1 for a in actions if a.kind == "F" and a.chunk == c) for c in range(self.chunks)]
        bwd_order = [[a.mb for a in actions if a.kind == "B" and a.chunk == c] for c in range(self.chunks)]
        b_pos = [0] * self.chunks
        metas: dict[tuple[int, int], Meta] = {}
        result = RunResult()
        for c in range(self.chunks):
            for ch in (self.act_in[c], self.act_out[c]):
                if ch is not None:
                    ch.reset()
            if self.act_in[c] is not None and fwd_left[c]:
                self.act_in[c].prefetch()  # type: ignore[union-attr]

        def prefetch_grad(c: int) -> None:
            ch = self.grad_in[c]
            if ch is None or ch.posted or b_pos[c] >= len(bwd_order[c]):
                return
            key = (c, bwd_order[c][b_pos[c]])
            if key in metas:
                ch.prefetch(key[1], metas[key])

        try:
            for a in actions:
                c, mb = a.chunk, a.mb
                rt = self.runtimes[c]
                if a.kind == "F":
                    fwd_left[c] -= 1
                    x, run = self._input(c, mb, inputs, run_length, fwd_left[c] > 0)
                    target = None
                    if rt.is_last:
                        if targets is None:
                            raise ValueError(f"stage {self.stage} holds the last part of the model and needs targets")
                        target = targets(mb)
                    w = weights(mb) if weights is not None else 1.0
                    g = self.part(c)
                    seed = None if self.seed is None else microbatch_seed(self.seed, g, self.microbatches_seen + mb)
                    out, loss, metrics = rt.forward(mb, x, 0, target, w, seed)
                    sender = self.act_out[c]
                    if sender is not None:
                        metas[(c, mb)] = Meta.of(out)
                        sender.send(out, run)
                    if loss is not None:
                        result.losses[mb], result.weights[mb] = loss, w
                        if metrics:
                            result.metrics[mb] = metrics
                    prefetch_grad(c)
                elif a.kind == "B":
                    grad = None
                    receiver = self.grad_in[c]
                    if receiver is not None:
                        grad = receiver.get(mb, metas.pop((c, mb)))
                    b_pos[c] += 1
                    prefetch_grad(c)
                    backward = rt.backward_input if c in split else rt.backward  # type: ignore[attr-defined]
                    grads_in = backward(mb, grad)
                    gsender = self.grad_out[c]
                    if gsender is not None:
                        gsender.send(grads_in)
                elif a.kind == "W":
                    rt.backward_weight(mb)  # type: ignore[attr-defined]
                else:
                    self.step()
                    result.steps += 1
        except BaseException:
            for rt in self.runtimes:
                rt.clear()
            raise
        self.microbatches_seen += len({a.mb for a in actions if a.kind == "F"})
        pending: list[ActivationSender | GradSender | None] = [*self.act_out, *self.grad_out]
        for channel in pending:
            if channel is not None:
                channel.wait()
        if self.in_flight:
            raise StageError(f"stage {self.stage}: {self.in_flight} micro-batches are still in flight at the end of the run")
        return result

    def evaluate(
        self,
        num_microbatches: int,
        inputs: InputFn | None = None,
        targets: InputFn | None = None,
        weights: Callable[[int], float] | None = None,
        run_length: Callable[[int], int] | None = None,
    ) -> RunResult:
        """Forward ``num_microbatches`` micro-batches through every chunk, without gradients."""
        result = RunResult()
        for rt in self.runtimes:
            rt.module.eval()
        for c in range(self.chunks):
            for ch in (self.act_in[c], self.act_out[c]):
                if ch is not None:
                    ch.reset()
        try:
            for mb in range(num_microbatches):
                for c, rt in enumerate(self.runtimes):
                    x, run = self._input(c, mb, inputs, run_length, mb + 1 < num_microbatches)
                    target = targets(mb) if rt.is_last and targets is not None else None
                    out, loss, metrics = rt.evaluate(x, target)
                    sender = self.act_out[c]
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
        for sender in self.act_out:
            if sender is not None:
                sender.wait()
        return result
