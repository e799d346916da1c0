"""One stage's composition of weight prediction, weight stashing and Gap Aware behind the hooks.

Order inside each hook, for micro-batch ``mb`` with staleness ``d`` (optimizer steps between its
forward and its backward on this stage):

- ``before_forward``: predict ``d`` steps ahead (if prediction is on and ``d > 0``; with
  ``nag_with_predictor`` one step at ``d = 0``), then keep the weights the forward uses for
  the backward: with stashing when ``d > 0``, and always for a Nesterov look-ahead (``d = 0``
  with ``nag_with_predictor``).
- ``after_forward``: put the true weights back.
- ``before_backward``: load the weights kept for ``mb`` (a stash is not loaded under
  ``ga_jfl``, whose backward runs on the current weights; a look-ahead always is).
- ``after_backward``: measure ``Gap = |theta_true - theta_stashed|`` for Gap Aware, restore the
  true weights, free what no micro-batch in flight still needs.
- ``before_step``: if any micro-batch of this step was stale, divide the accumulated gradient by
  the Gap-Aware penalty (the elementwise largest gap of the step's stale micro-batches; without
  a stash, the gap of staleness 1 estimated from the gradient).
- ``after_step``: update the Gap-Aware statistics.

**Stashing with ``step_every > 1``** (the rule of the reference implementation, FTPipe): every
forward runs on the weights current at that moment (predicted, if prediction is on), and its
backward on exactly those weights. A stash is shared between micro-batches only when they are
the same weights: forwards with no optimizer step between them and no prediction (a
prediction depends on the micro-batch's staleness and, for ``aggmsnag``, on the gradient
accumulated so far, so each predicted forward keeps its own). Worked example, stage 0 of 2,
``step_every = 2`` (order ``F0 F1 B0 F2 B1 S1 F3 B2 F4 B3 S2 F5 B4 B5 S3``, staleness
``0 0 1 0 1 0``): ``F2`` runs on ``theta_0`` and stashes it (``S1`` comes before ``B2``);
``F3`` runs on ``theta_1`` (after ``S1``) and needs no stash (``B3`` also precedes ``S2``);
``F4`` runs on ``theta_1`` and stashes it. So ``B2`` takes its gradient at ``theta_0``, ``B3``
and ``B4`` at ``theta_1``: each micro-batch is exactly as stale as without stashing, never more;
stashing only makes its backward use its forward's weights. With ``step_every = 1`` every
stash is its own micro-batch's.

**Nesterov look-ahead** (``nag_with_predictor``): at staleness 0 (the last stage, and warm-up or
mid-step micro-batches of the others) the forward runs on the weights one step ahead,
``theta - eta gamma v`` for SGD, and so does the backward (loaded as a stash is, also when the
backward replays the forward), so that the gradient is taken at the look-ahead point; the true
weights come back after the backward, before the optimizer steps on them.

**Gap Aware without weight stashing** (``ga`` without ``ws``, SGD only). The weights the gradient
was computed on are not kept, so the gap cannot be measured; the penalty uses ``Gap = eta |g|``
(:meth:`~ringpipe.pipeline.staleness.gap_aware.GapAware.apply_from_grad`, ``g`` the accumulated
gradient of the step), the gap of staleness 1. A micro-batch of staleness 2 or more on such a
stage raises (:func:`~ringpipe.pipeline.staleness.make_policy` refuses those stages up front).

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
    """Weight prediction, weight stashing and Gap Aware composed for one pipeline stage.

    ``just_for_loss`` (``ga_jfl``): every backward runs on the current weights, never on a
    stash. With Gap Aware, a stash then only measures the gap; without it (a stage outside
    the Gap-Aware stages) no stash is kept at all, and the stage behaves as ``stale`` apart
    from any weight prediction of its forwards. ``stage`` names the stage in errors.
    """

    def __init__(
        self,
        *,
        predictor: WeightPredictor | None = None,
        stash: WeightStash | None = None,
        gap_aware: GapAware | None = None,
        just_for_loss: bool = False,
        requires_recompute: bool = False,
        step_every: int = 1,
        name: str = "",
        stage: int | None = None,
    ) -> None:
        if just_for_loss and (stash is None) != (gap_aware is None):
            raise ValueError(
                "ga_jfl's stash only measures the Gap-Aware gap: give both a weight stash and a Gap Aware "
                f"object, or neither (got stash={stash is not None}, gap_aware={gap_aware is not None})"
            )
        if step_every < 1:
            raise ValueError(f"step_every must be >= 1, got {step_every}")
        self.predictor = predictor
        self.stash = stash
        self.gap_aware = gap_aware
        self.just_for_loss = just_for_loss
        self.requires_recompute = requires_recompute
        self.step_every = step_every
        self.name = name
        self.stage = stage
        # Where kept weights live: the weight stash, or (look-ahead only) a private one.
        self._store = stash
        if self._store is None and predictor is not None and predictor.nag_with_predictor:
            self._store = WeightStash(predictor.params)
        self._steps = 0  # optimizer steps taken: the weight version of unpredicted forwards
        self._staleness: dict[int, int] = {}
        self._key: dict[int, tuple[str, int]] = {}  # micro-batch -> the weights kept for its backward
        self._users: dict[tuple[str, int], int] = {}  # kept weights -> micro-batches in flight using them
        self._gaps: list[torch.Tensor] | None = None
        self._stale_in_step = False
        self.last_penalties: list[torch.Tensor] = []

    def __repr__(self) -> str:
        return f"MitigationPolicy({self.name!r})"

    @property
    def stash_count(self) -> int:
        """Weight copies held now for backwards to come (stashes and look-aheads)."""
        return 0 if self._store is None else len(self._store)

    @property
    def stashed_bytes(self) -> int:
        """Bytes held by those copies now."""
        return 0 if self._store is None else self._store.nbytes

    def uses_recompute(self) -> bool:
        """Whether this policy is only correct with activation recomputation (``ga_jfl``)."""
        return self.requires_recompute

    def _where(self) -> str:
        return f"stage {self.stage}" if self.stage is not None else f"policy {self.name!r}"

    def before_forward(self, mb: int, staleness: int) -> None:
        if staleness < 0:
            raise ValueError(f"micro-batch {mb}: staleness must be >= 0, got {staleness}")
        if self.gap_aware is not None and self.stash is None and staleness > 1:
            raise ValueError(
                f"{self._where()}: micro-batch {mb} has staleness {staleness}, but Gap Aware without "
                "weight stashing estimates only the gap of staleness 1 (Gap = eta |g|); add 'ws' "
                "(e.g. 'ws+ga') so the gap is measured, or limit ga_stages to stages of staleness 1 "
                "('almost_last_partition')"
            )
        self._staleness[mb] = staleness
        predicted = False
        if self.predictor is not None and self.predictor.horizon(staleness) > 0:
            predicted = self.predictor.setup(staleness)
        key: tuple[str, int] | None = None
        if predicted and staleness == 0:
            key = ("lookahead", mb)  # Nesterov: the backward takes its gradient here too
        elif self.stash is not None and staleness > 0:
            key = ("predicted", mb) if predicted else ("step", self._steps)
        if key is None:
            return
        assert self._store is not None
        if key not in self._store:
            self._store.stash(key)
        self._key[mb] = key
        self._users[key] = self._users.get(key, 0) + 1

    def after_forward(self, mb: int) -> None:
        if self.predictor is not None:
            self.predictor.revert()

    def before_backward(self, mb: int) -> None:
        key = self._key.get(mb)
        if key is None or (self.just_for_loss and key[0] != "lookahead"):
            return
        assert self._store is not None
        self._store.load(key)

    def after_backward(self, mb: int) -> None:
        d = self._staleness.pop(mb, 0)
        self._stale_in_step |= d > 0
        key = self._key.pop(mb, None)
        if key is None:
            return
        assert self._store is not None
        if self.gap_aware is not None and d > 0:
            gaps = self._store.gap(key)
            if self._gaps is None:
                self._gaps = gaps
            else:
                self._gaps = [torch.maximum(a, b) for a, b in zip(self._gaps, gaps, strict=True)]
        self._store.restore()
        self._users[key] -= 1
        if self._users[key] == 0:
            del self._users[key]
            self._store.pop(key)

    def before_step(self) -> None:
        self.last_penalties = []
        if self.gap_aware is None:
            return
        self.gap_aware.record_step()
        if not self._stale_in_step:
            return
        if self._gaps is not None:
            self.last_penalties = self.gap_aware.apply_gap(self._gaps)
        elif self.stash is None:
            self.last_penalties = self.gap_aware.apply_from_grad()

    def after_step(self) -> None:
        if self.gap_aware is not None:
            self.gap_aware.update_running_stats()
        self._steps += 1
        self._gaps = None
        self._stale_in_step = False

    def clear(self) -> None:
        if self._store is not None:
            self._store.restore()
            for key in list(self._users):
                self._store.pop(key)
        if self.predictor is not None:
            self.predictor.revert()
        self._staleness.clear()
        self._key.clear()
        self._users.clear()
        self._gaps = None
        self._stale_in_step = False
