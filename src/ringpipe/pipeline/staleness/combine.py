"""One stage's composition of weight prediction, weight stashing and Gap Aware behind the hooks.

Order inside each hook, for micro-batch ``mb`` with staleness ``d``:

- ``before_forward``: if another micro-batch of the same optimizer step already stashed its
  weights, load that stash; else predict ``d`` steps ahead (if prediction is on and ``d > 0``,
  or ``d = 0`` with ``nag_with_predictor``), then stash the weights the forward will use (if
  stashing is on and ``d > 0`` or the weights were predicted).
- ``after_forward``: put the true weights back.
- ``before_backward``: load the stash of ``mb``'s step (not under ``ga_jfl``, whose backward
  runs on the current weights).
- ``after_backward``: measure ``Gap = |theta_true - theta_stashed|`` for Gap Aware, restore the
  true weights, drop the stash once every micro-batch of its step is done.
- ``before_step``: if any micro-batch of this step was stale, divide the accumulated gradient by
  the Gap-Aware penalty (the elementwise largest gap of the step's micro-batches; without a
  stash, the gap estimated from the gradient, see below).
- ``after_step``: update the Gap-Aware statistics.

**One stash per optimizer step.** With ``step_every = k`` the micro-batches ``jk .. jk+k-1``
accumulate into one step, and the first of them to need a stash (the first of the step: the
staleness of a step's micro-batches never grows from one to the next) stashes the weights
for all of them: every later micro-batch of the step runs its forward and its backward on
those same weights, and counts as stale as the one that stashed them (their backwards all
come before the same step). A stage thus holds at most one stash per step in flight rather
than one per micro-batch, and each step's gradient is taken at a single weight version.

**Gap Aware without weight stashing** (``ga`` without ``ws``, SGD only). The weights the
gradient was computed on are not kept, so the gap cannot be measured; the penalty uses the
delay-1 estimate ``Gap = eta |g|`` (:meth:`~ringpipe.pipeline.staleness.gap_aware.GapAware.apply_from_grad`,
``g`` the accumulated gradient of the step) whatever the stage's staleness, as in the
reference formulation. A stage with staleness ``d > 1`` is therefore penalised as if its
weights had moved by one step only; stash the weights (``ws+ga``) to measure the real gap.

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
    from any weight prediction of its forwards.
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
    ) -> None:
        if just_for_loss and (stash is None) != (gap_aware is None):
            raise ValueError(
                "ga_jfl's stash only measures the Gap-Aware gap: give both a weight stash and a Gap Aware "
                f"object, or neither (got stash={stash is not None}, gap_aware={gap_aware is not None})"
            )
        self.predictor = predictor
        self.stash = stash
        self.gap_aware = gap_aware
        self.just_for_loss = just_for_loss
        self.requires_recompute = requires_recompute
        if step_every < 1:
            raise ValueError(f"step_every must be >= 1, got {step_every}")
        self.step_every = step_every
        self.name = name
        self._staleness: dict[int, int] = {}
        self._key: dict[int, int] = {}  # micro-batch -> its step's stash, while in flight
        self._users: dict[int, int] = {}  # stash -> micro-batches using it, not yet backwarded
        self._stash_staleness: dict[int, int] = {}  # stash -> staleness of the micro-batch that took it
        self._backwards: dict[int, int] = {}  # step group -> backwards done
        self._forward_loaded = False
        self._gaps: list[torch.Tensor] | None = None
        self._stale_in_step = False
        self.last_penalties: list[torch.Tensor] = []

    def __repr__(self) -> str:
        return f"MitigationPolicy({self.name!r})"

    @property
    def stash_count(self) -> int:
        """Stashes held now (one per micro-batch, or per optimizer step with ``step_every > 1``)."""
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
        group = mb // self.step_every
        if self.stash is not None and group in self.stash:
            # a micro-batch of the same step took the stash: forward (and backward) on its weights
            self.stash.load(group)
            self._forward_loaded = True
            self._staleness[mb] = self._stash_staleness[group]
            self._key[mb] = group
            self._users[group] += 1
            return
        self._staleness[mb] = staleness
        predicted = False
        if self.predictor is not None and self.predictor.horizon(staleness) > 0:
            predicted = self.predictor.setup(staleness)
        if self.stash is not None and (staleness > 0 or predicted):
            self.stash.stash(group)
            self._stash_staleness[group] = staleness
            self._key[mb] = group
            self._users[group] = 1

    def after_forward(self, mb: int) -> None:
        if self._forward_loaded:
            assert self.stash is not None
            self.stash.restore()
            self._forward_loaded = False
        if self.predictor is not None:
            self.predictor.revert()

    def before_backward(self, mb: int) -> None:
        key = self._key.get(mb)
        if self.stash is not None and key is not None and not self.just_for_loss:
            self.stash.load(key)

    def after_backward(self, mb: int) -> None:
        d = self._staleness.pop(mb, 0)
        self._stale_in_step |= d > 0
        key = self._key.pop(mb, None)
        group = mb // self.step_every
        done = self._backwards[group] = self._backwards.get(group, 0) + 1
        if self.stash is not None and key is not None:
            if self.gap_aware is not None and d > 0:
                gaps = self.stash.gap(key)
                if self._gaps is None:
                    self._gaps = gaps
                else:
                    self._gaps = [torch.maximum(a, b) for a, b in zip(self._gaps, gaps, strict=True)]
            self.stash.restore()
            self._users[key] -= 1
        if done == self.step_every:  # every micro-batch of the step is done
            del self._backwards[group]
            self._release(group)

    def _release(self, key: int) -> None:
        if self.stash is not None and self._users.get(key) == 0:
            self.stash.pop(key)
            del self._users[key], self._stash_staleness[key]

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
        # A step closes its micro-batches' group, also a shorter last one: release what they used.
        for key in [k for k, n in self._users.items() if n == 0]:
            self._release(key)
        self._backwards.clear()

    def clear(self) -> None:
        if self.stash is not None:
            self.stash.restore()
            for key in list(self._users):
                self.stash.pop(key)
        if self.predictor is not None:
            self.predictor.revert()
        self._staleness.clear()
        self._key.clear()
        self._users.clear()
        self._stash_staleness.clear()
        self._backwards.clear()
        self._forward_loaded = False
        self._gaps = None
        self._stale_in_step = False
