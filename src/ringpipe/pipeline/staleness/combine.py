"""One stage's composition of weight prediction, weight stashing and Gap Aware behind the hooks.

Order inside each hook, for micro-batch ``mb`` with staleness ``d``:

- ``before_forward``: predict ``d`` steps ahead (if prediction is on and ``d > 0``, or ``d = 0``
  with ``nag_with_predictor``), then stash the weights the forward will use (if stashing is on
  and ``d > 0`` or the weights were predicted).
- ``after_forward``: put the true weights back.
- ``before_backward``: load the stash of ``mb`` (not under ``ga_jfl``, whose backward runs on
  the current weights).
- ``after_backward``: measure ``Gap = |theta_true - theta_stashed|`` for Gap Aware, restore the
  true weights, drop the stash.
- ``before_step``: if any micro-batch of this step was stale, divide the accumulated gradient by
  the Gap-Aware penalty (the elementwise largest gap of the step's micro-batches; without a
  stash, the gap estimated from the gradient).
- ``after_step``: update the Gap-Aware statistics.

All weight changes are in-place copies into the parameters' storage (``p.copy_``), never
rebinding ``p.data``, so every reference to a parameter sees the weights the policy chose.
"""

from __future__ import annotations

import torch

from ringpipe.pipeline.policy import WeightPolicy
from ringpipe.pipeline.staleness.gap_aware import GapAware
from ringpipe.pipeline.staleness.predict import WeightPredictor
from ringpipe.pipeline.staleness.stash import WeightStash

__all__ = ["MitigationPolicy"]


class MitigationPolicy(WeightPolicy):
    """Weight prediction, weight stashing and Gap Aware composed for one pipeline stage."""

    def __init__(
        self,
        *,
        predictor: WeightPredictor | None = None,
        stash: WeightStash | None = None,
        gap_aware: GapAware | None = None,
        just_for_loss: bool = False,
        requires_recompute: bool = False,
        name: str = "",
    ) -> None:
        if just_for_loss and (stash is None or gap_aware is None):
            raise ValueError("ga_jfl needs both a weight stash and a Gap Aware object")
        self.predictor = predictor
        self.stash = stash
        self.gap_aware = gap_aware
        self.just_for_loss = just_for_loss
        self.requires_recompute = requires_recompute
        self.name = name
        self._staleness: dict[int, int] = {}
        self._gaps: list[torch.Tensor] | None = None
        self._stale_in_step = False
        self.last_penalties: list[torch.Tensor] = []

    def __repr__(self) -> str:
        return f"MitigationPolicy({self.name!r})"

    @property
    def stash_count(self) -> int:
        """Micro-batches whose weights are stashed now."""
        return 0 if self.stash is None else len(self.stash)

    @property
    def stashed_bytes(self) -> int:
        """Bytes held by stashes now."""
        return 0 if self.stash is None else self.stash.nbytes

    def uses_recompute(self) -> bool:
        """Whether this policy is only correct with activation recomputation (``ga_jfl``)."""
        return self.requires_recompute

    def before_forward(self, mb: int, staleness: int) -> None:
        if staleness < 0:
            raise ValueError(f"micro-batch {mb}: staleness must be >= 0, got {staleness}")
        self._staleness[mb] = staleness
        predicted = False
        if self.predictor is not None and self.predictor.horizon(staleness) > 0:
            predicted = self.predictor.setup(staleness)
        if self.stash is not None and (staleness > 0 or predicted):
            self.stash.stash(mb)

    def after_forward(self, mb: int) -> None:
        if self.predictor is not None:
            self.predictor.revert()

    def before_backward(self, mb: int) -> None:
        if self.stash is not None and mb in self.stash and not self.just_for_loss:
            self.stash.load(mb)

    def after_backward(self, mb: int) -> None:
        d = self._staleness.pop(mb, 0)
        self._stale_in_step |= d > 0
        if self.stash is None or mb not in self.stash:
            return
        if self.gap_aware is not None and d > 0:
            gaps = self.stash.gap(mb)
            if self._gaps is None:
                self._gaps = gaps
            else:
                self._gaps = [torch.maximum(a, b) for a, b in zip(self._gaps, gaps, strict=True)]
        self.stash.restore()
        self.stash.pop(mb)

    def before_step(self) -> None:
        self.last_penalties = []
        if self.gap_aware is None or not self._stale_in_step:
            return
        if self._gaps is not None:
            self.last_penalties = self.gap_aware.apply_gap(self._gaps)
        elif self.stash is None:
            self.last_penalties = self.gap_aware.apply_from_grad()

    def after_step(self) -> None:
        if self.gap_aware is not None:
            self.gap_aware.update_running_stats()
        self._gaps = None
        self._stale_in_step = False
