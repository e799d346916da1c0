"""Weights tied across stages in the asynchronous pipeline: one owner steps them, the others hold mirrors.

In a synchronous schedule every holder of a tied weight sums the holders' gradients and steps
its own copy (:func:`~ringpipe.pipeline.replicas.sum_tied_gradients`). In the asynchronous
pipeline the holders step at different times (the last stage's ``k``-th step comes long before
the first stage's ``k``-th backward), so a collective at every step would make the later stage
wait for the earlier one and serialise the pipeline. The asynchronous rule instead:

- the first (lowest-stage) holder **owns** the weight. At its ``k``-th optimizer step it
  receives every other holder's ``k``-th gradient of the weight, adds them to its own in stage
  order, lets its weight policy act on the sum (``before_step``: Gap Aware rescales it), steps,
  and sends the new value to every other holder, all point to point and non-blocking;
- every other holder, at stage ``s`` (owner at stage ``f``), keeps a **mirror**: at its ``j``-th
  step it sends its ``j``-th gradient to the owner and does not step the mirror (its gradient is
  dropped before ``optimizer.step()``, so the optimizer keeps no state for it); after the step it
  replaces the mirror with the owner's weight after update ``j - D``,
  ``D = ceil((s - f) / step_every)`` (nothing while ``j <= D``).

``D`` is the smallest delay at which the owner's update is never one the owner takes later in
the stream. In the 1F1B stream stage ``i`` takes its ``j``-th step right after the backward of
micro-batch ``j*step_every - 1``, which follows its forward of micro-batch
``j*step_every - 1 + (stages - 1 - i)``: the owner's update ``j - D`` follows its forward of
``(j - D)*step_every - 1 + (stages - 1 - f)``, at most the micro-batch
``j*step_every - 1 + (stages - 1 - s)`` whose forward precedes the mirror's step ``j`` exactly
when ``D*step_every >= s - f``. So the owner's update lies in the same window of an open stream
(:meth:`~ringpipe.pipeline.trainer.PipelineTrainer.stream_step`) as the mirror's step or an
earlier one, and in the steady state it comes ``s - f`` slots or more before it: the mirror does
not wait, and never across a batch boundary. With ``D - 1`` the owner's update would depend on a
forward the mirror has already passed (the mirror would wait in the steady state), and on 2 stages
it would fall into the next window (``tests/unit/pipeline/test_tied_owner.py``).

The messages cannot deadlock: the owner's step ``k`` waits only for gradients the mirrors sent at
their step ``k``, and the mirror's step ``j`` only for the owner's update ``j - D``, whose own
gradients came from mirror steps ``<= j - D``. Sends stay bounded: the owner waits for its update
``k - 1`` once it has the mirrors' ``k``-th gradients (a mirror posts its receive of update
``k - 1`` before it sends gradient ``k``), and a mirror waits for its gradients up to ``j - D``
once it has the owner's update ``j - D``. A run that closes the stream (``train_step``,
``train_stream``, ``drain``) receives the updates still pending, so every copy is bit-identical
after it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from ringpipe.comm.base import Communicator, Work

__all__ = ["TiedOwnership", "TAG_TIED_GRAD", "TAG_TIED_WEIGHT", "mirror_delay"]

#: tags of a mirror's gradients to the owner and of the owner's new weights to a mirror (plus the
#: parameter's index); they travel on the holders' own communicator, apart from activations anyway
TAG_TIED_GRAD = 700
TAG_TIED_WEIGHT = 800


def mirror_delay(owner_stage: int, stage: int, step_every: int) -> int:
    """``D``: the owner's update a mirror at ``stage`` takes after its ``j``-th step is ``j - D``."""
    if stage <= owner_stage:
        raise ValueError(f"a mirror's stage ({stage}) comes after its owner's ({owner_stage})")
    return -(-(stage - owner_stage) // step_every)


class TiedOwnership:
    """This rank's side of one group of tied weights under the asynchronous rule.

    ``params``: this rank's copies; ``comm``: the communicator of the holders of one pipeline
    replica, member ``i`` holding stage ``stages[i]`` (``stages`` ascending: member 0 owns).
    The executor calls :meth:`begin_run` with the steps of each run, :meth:`gather` after the
    replicas' averaging and before the policy's ``before_step``, :meth:`after_step` right after
    ``optimizer.step()``, and :meth:`close` at the end of a run that closes the stream.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], comm: Communicator, stages: Sequence[int],
                 step_every: int) -> None:
        if list(stages) != sorted(set(stages)) or len(stages) != comm.size:
            raise ValueError(f"tied holders' stages {list(stages)} must be ascending, one per member of the group")
        self.params, self.comm, self.stages = list(params), comm, list(stages)
        self.is_owner = comm.rank == 0
        self.delay = 0 if self.is_owner else mirror_delay(self.stages[0], self.stages[comm.rank], step_every)
        self.steps = 0  # steps taken in the open stream
        self._steps_left = 0  # steps still to come in the current run (owner: when to post a gradient receive)
        self._grads_in: list[list[Work]] | None = None  # owner: the posted receives of the next step's gradients
        self._sends: deque[tuple[int, Work]] = deque()  # (step, send) not yet waited for
        self._updates: deque[tuple[list[torch.Tensor], list[Work]]] = deque()  # mirror: owner updates posted

    @property
    def mirrors(self) -> list[torch.nn.Parameter]:
        """The parameters this rank holds as mirrors (it never steps them); none on the owner."""
        return [] if self.is_owner else list(self.params)

    # ------------------------------------------------------------------ the executor's hooks

    def begin_run(self, steps: int) -> None:
        """A run with ``steps`` optimizer steps starts (the owner posts the receives of its first step)."""
        self._steps_left = steps
        if self.is_owner and steps and self._grads_in is None:
            self._post_grads()

    def gather(self) -> None:
        """Owner: add the others' gradients of this step to its own. Mirror: send its gradient, drop it."""
        if self.is_owner:
            if self._grads_in is None:
                self._post_grads()
            assert self._grads_in is not None
            posted, self._grads_in = self._grads_in, None
            for works in posted:  # stage order: the sum is the same on every replica and every run
                for p, work in zip(self.params, works, strict=True):
                    g = work.wait()
                    p.grad = g if p.grad is None else p.grad.add_(g)
            self._steps_left -= 1
            if self._steps_left > 0:
                self._post_grads()
            return
        for i, p in enumerate(self.params):
            g = p.grad.detach().contiguous().clone() if p.grad is not None else torch.zeros_like(p)
            self._sends.append((self.steps + 1, self.comm.isend(g, 0, TAG_TIED_GRAD + i)))
            p.grad = None  # the optimizer skips it: no step, no state for the mirror

    @torch.no_grad()
    def after_step(self) -> None:
        """Owner: send the new weights. Mirror: take the owner's update ``steps - D``."""
        self.steps += 1
        if self.is_owner:
            for i, p in enumerate(self.params):
                value = p.detach().contiguous().clone()
                for member in range(1, self.comm.size):
                    self._sends.append((self.steps, self.comm.isend(value, member, TAG_TIED_WEIGHT + i)))
            # each mirror posted its receive of the previous update before sending this step's gradient
            self._wait_sends(self.steps - 1)
            return
        bufs = [torch.empty_like(p) for p in self.params]
        self._updates.append((bufs, [self.comm.irecv(b, 0, TAG_TIED_WEIGHT + i) for i, b in enumerate(bufs)]))
        if self.steps > self.delay:
            self._apply(*self._updates.popleft())
            # the owner took gradient steps - D before sending that update
            self._wait_sends(self.steps - self.delay)

    def close(self) -> None:
        """End of a run that closes the stream: take every pending update, wait for every send."""
        while self._updates:
            self._apply(*self._updates.popleft())
        self._wait_sends(self.steps)
        self.steps = 0
        self._steps_left = 0

    def abandon(self) -> None:
        """After an error: forget the stream's messages (the weights stay as they are)."""
        self._sends.clear()
        self._updates.clear()
        self._grads_in = None
        self.steps = 0
        self._steps_left = 0

    # ------------------------------------------------------------------ helpers

    def _post_grads(self) -> None:
        self._grads_in = [
            [self.comm.irecv(torch.empty_like(p), member, TAG_TIED_GRAD + i) for i, p in enumerate(self.params)]
            for member in range(1, self.comm.size)
        ]

    @torch.no_grad()
    def _apply(self, bufs: list[torch.Tensor], works: list[Work]) -> None:
        for p, b, work in zip(self.params, bufs, works, strict=True):
            work.wait()
            p.copy_(b)

    def _wait_sends(self, upto: int) -> None:
        while self._sends and self._sends[0][0] <= upto:
            self._sends.popleft()[1].wait()
