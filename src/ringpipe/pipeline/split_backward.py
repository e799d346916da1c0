"""A stage runtime whose backward is two passes: the input gradient ``B`` now, the weight gradient ``W`` later.

``backward_input`` computes only the gradient of the stage input with
``torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True)`` (what the previous
stage waits for) and keeps the graph; ``backward_weight`` later accumulates the weight
gradient into ``p.grad`` with ``torch.autograd.backward(outputs, grad_outputs, inputs=params)``
and frees the graph. The sum of the two is the gradient one backward would give.

**Cost.** The weight pass walks the kept graph again from the stage output: to reach the
weights of a stage's first layers it propagates the gradient through the later layers'
activations a second time (autograd computes only what the requested inputs need, so the
input-gradient pass skips weight gradients, but the weight pass cannot skip the activation
gradients between layers). ``B + W`` therefore costs more than one fused backward, up to
about one more backward of the stage's activation path; the schedule gains where the time
saved from the bubble exceeds that. Splitting each layer's weight gradient from its input
gradient (per-layer ``W``, as the paper's implementation does inside each linear layer)
would remove the overhead and is not done here.

**Recomputation.** With ``recompute`` the forward keeps only its input; ``B`` replays it
(same random state, normalisation statistics untouched) and keeps the replayed graph until
``W``, so a micro-batch's activations live from its ``B`` to its ``W`` only.
"""

from __future__ import annotations

from typing import Any

import torch

from ringpipe.pipeline.stage import StageError, StageRuntime

__all__ = ["SplitStageRuntime"]


class SplitStageRuntime(StageRuntime):
    """:class:`StageRuntime` with ``backward_input`` / ``backward_weight`` (synchronous schedules only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[int, tuple[list[torch.Tensor], list[torch.Tensor] | None]] = {}
        self._params = [p for p in self.module.parameters() if p.requires_grad]

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded whose weight gradient has not been computed (their graph is held)."""
        return len(self._records) + len(self._pending)

    def backward_input(self, mb: int, grad_outputs: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """``B``: the gradients of micro-batch ``mb``'s floating-point inputs; the graph is kept for ``W``."""
        rec = self._records.pop(mb, None)
        if rec is None:
            raise StageError(f"stage {self.stage}: backward of micro-batch {mb} without its forward")
        if mb in self._pending:
            raise StageError(f"stage {self.stage}: backward of micro-batch {mb} twice before its weight pass")
        self.policy.before_backward(mb)
        leaves, outputs, loss = self._graph(rec)
        if self.is_last:
            assert loss is not None
            roots, grads = [loss], None
        else:
            if grad_outputs is None:
                raise StageError(f"stage {self.stage}: backward of micro-batch {mb} needs output gradients")
            pairs = [
                (o, g) for o, g in zip([o for o in outputs if o.is_floating_point()], grad_outputs, strict=True)
                if o.requires_grad
            ]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        wanted = [t for t in leaves if t.is_floating_point() and t.requires_grad]
        got: tuple[torch.Tensor | None, ...] = ()
        if wanted and roots and any(r.requires_grad for r in roots):
            got = torch.autograd.grad(roots, wanted, grads, retain_graph=True, allow_unused=True)
        by_leaf = {id(t): g for t, g in zip(wanted, got, strict=False)}
        self._pending[mb] = (roots, grads)
        if self.is_first:
            return ()
        return tuple(
            (by_leaf.get(id(t)) if by_leaf.get(id(t)) is not None else torch.zeros_like(t))  # type: ignore[misc]
            for t in leaves if t.is_floating_point()
        )

    def backward_weight(self, mb: int) -> None:
        """``W``: accumulate micro-batch ``mb``'s weight gradient into ``p.grad`` and free its graph."""
        pending = self._pending.pop(mb, None)
        if pending is None:
            raise StageError(f"stage {self.stage}: weight pass of micro-batch {mb} before its backward")
        roots, grads = pending
        try:
            params = [p for p in self._params if p.requires_grad]
            if params and roots and any(r.requires_grad for r in roots):
                torch.autograd.backward(roots, grads, inputs=params)
        finally:
            self.policy.after_backward(mb)

    def clear(self) -> None:
        self._pending.clear()
        super().clear()
