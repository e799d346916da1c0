"""Weight-version policy hooks a pipeline stage calls around forward, backward and step.

A :class:`WeightPolicy` decides which weights a stage uses for each micro-batch. The base class
does nothing in every hook, which is exactly the "stale" policy of an asynchronous pipeline and
the correct behaviour of every synchronous schedule. Mitigations (weight stashing, weight
prediction, gap awareness) subclass it in :mod:`ringpipe.pipeline.staleness`; the executor only
calls the hooks, in this order for each micro-batch ``mb``::

    before_forward(mb, staleness) -> forward -> after_forward(mb)
    before_backward(mb) -> [recompute] -> backward -> after_backward(mb)
    ... and, whenever the stage steps: before_step() -> optimizer.step() -> after_step()
"""

from __future__ import annotations

__all__ = ["WeightPolicy"]


class WeightPolicy:
    """Base class, every hook a no-op: the "stale" policy (and the synchronous one)."""

    def before_forward(self, mb: int, staleness: int) -> None:
        """Called before micro-batch ``mb``'s forward; may replace stage params or take a stash."""

    def after_forward(self, mb: int) -> None:
        """Called after the forward of ``mb``; restores the true weights if they were replaced."""

    def before_backward(self, mb: int) -> None:
        """Called before the backward (and recomputation) of ``mb``; may load its stash."""

    def after_backward(self, mb: int) -> None:
        """Called after the backward of ``mb``; restores true weights, may rescale ``p.grad``."""

    def before_step(self) -> None:
        """Called right before ``optimizer.step()``."""

    def after_step(self) -> None:
        """Called right after ``optimizer.step()`` (and the LR scheduler step, if any)."""

    def clear(self) -> None:
        """Forget every micro-batch in flight (after an error); the true weights stay in place."""
