"""Build a stage's weight policy from mitigation names such as ``"wp+ws+ga"``."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from ringpipe.pipeline.policy import WeightPolicy
from ringpipe.pipeline.staleness.combine import MitigationPolicy
from ringpipe.pipeline.staleness.gap_aware import gap_aware_for, gap_aware_stages
from ringpipe.pipeline.staleness.optimizer_kind import optimizer_kind
from ringpipe.pipeline.staleness.predict import WeightPredictor
from ringpipe.pipeline.staleness.stash import WeightStash

__all__ = ["MITIGATIONS", "parse_mitigations", "make_policy"]

log = logging.getLogger(__name__)

MITIGATIONS: dict[str, str] = {
    "stale": "no mitigation: forward and backward use whatever weights the stage holds",
    "ws": "weight stashing (PipeDream): backward on the weights its forward used",
    "wp": "weight prediction: msnag for step_every=1, aggmsnag for step_every>1",
    "msnag": "weight prediction ignoring the partially accumulated gradient",
    "aggmsnag": "weight prediction using the partially accumulated gradient (step_every>1)",
    "ga": "Gap Aware: divide stale gradients by 1 + Gap/C (without ws: staleness-1 stages only)",
    "ga_jfl": "Gap Aware just for loss: backward on current weights, stash only sizes the gap "
    "(outside ga_stages: backward on current weights, no penalty, no stash)",
}
"""Valid mitigation names and what each does; combine with ``+`` (``"wp+ws+ga"``)."""

_PREDICTION = ("wp", "msnag", "aggmsnag")


def _valid() -> str:
    return ", ".join(MITIGATIONS) + " (combine with '+', e.g. 'wp+ws+ga')"


def parse_mitigations(names: str | Iterable[str], step_every: int = 1) -> frozenset[str]:
    """Normalise names to a set of ``{stale}`` or a subset of ``{msnag|aggmsnag, ws, ga|ga_jfl}``.

    ``wp`` resolves to ``msnag`` for ``step_every == 1`` and ``aggmsnag`` otherwise. Raises
    ``ValueError`` for unknown names and meaningless combinations, saying why.
    """
    if step_every < 1:
        raise ValueError(f"step_every must be >= 1, got {step_every}")
    raw = names.replace(",", "+").split("+") if isinstance(names, str) else list(names)
    items = [str(n).strip().lower() for n in raw if str(n).strip()]
    if not items:
        raise ValueError(f"no staleness mitigation given ({names!r}); valid names: {_valid()}")
    unknown = [n for n in items if n not in MITIGATIONS]
    if unknown:
        raise ValueError(f"unknown staleness mitigation {unknown[0]!r}; valid names: {_valid()}")
    if len(set(items)) != len(items):
        raise ValueError(f"mitigation names repeat in {names!r}; give each once. Valid names: {_valid()}")
    chosen = set(items)
    if "stale" in chosen and len(chosen) > 1:
        raise ValueError(
            f"'stale' means no mitigation and cannot be combined with {sorted(chosen - {'stale'})}; "
            f"valid names: {_valid()}"
        )
    predictors = chosen & set(_PREDICTION)
    if len(predictors) > 1:
        raise ValueError(f"choose one weight predictor, not {sorted(predictors)}; valid names: {_valid()}")
    if "aggmsnag" in chosen and step_every == 1:
        raise ValueError(
            "aggmsnag uses the partially accumulated gradient, which exists only with step_every > 1; "
            "use 'wp' or 'msnag' for step_every=1"
        )
    if "wp" in chosen:
        chosen.discard("wp")
        chosen.add("msnag" if step_every == 1 else "aggmsnag")
    if "ga" in chosen and "ga_jfl" in chosen:
        raise ValueError(f"'ga' and 'ga_jfl' are two ways of applying Gap Aware; choose one. Valid names: {_valid()}")
    if "ga_jfl" in chosen and "ws" not in chosen:
        raise ValueError("ga_jfl measures the gap against stashed weights; add 'ws' (e.g. 'ws+ga_jfl')")
    return frozenset(chosen)


def make_policy(
    names: str | Iterable[str],
    params: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
    *,
    stage: int,
    num_stages: int,
    step_every: int = 1,
    recompute: bool = False,
    nag_with_predictor: bool = False,
    ga_stages: str = "all_except_last",
    ga_big_gamma: float = 0.999,
    ga_eps: float = 1e-8,
    mirrors: Iterable[torch.Tensor] = (),
) -> WeightPolicy:
    """The weight policy of stage ``stage`` of ``num_stages`` for the mitigations ``names``.

    ``scheduler`` (optional) makes prediction scheduler-aware. ``ga_stages`` picks the stages
    Gap Aware (``ga``/``ga_jfl``) applies to: ``almost_last_partition``, ``all_except_last`` or
    ``all_except_last_two``. ``stale`` returns the no-op base :class:`WeightPolicy`.

    Gap Aware with stashing measures the gap against the stash; without stashing (SGD only)
    it uses ``Gap = eta |g|``, the gap of staleness 1, so it is refused on a stage whose
    staleness can reach 2 (``ceil((num_stages - 1 - stage) / step_every)``), with an error
    naming the stage and the fixes. On a stage outside ``ga_stages``, ``ga`` is simply absent
    (``ws+ga`` there is ``ws``), while ``ga_jfl`` keeps what its name promises everywhere: the
    backward runs on the current weights (as ``stale`` with recomputation). Since no gap is
    measured there, the stage keeps no stash (``ws+ga_jfl`` stashes only on the Gap-Aware
    stages); a predictor still shapes its forwards. ``nag_with_predictor``: at staleness 0 the
    forward *and the backward* run one step ahead (a Nesterov look-ahead), the true weights
    coming back before the step. With ``step_every > 1`` a stash is shared only by forwards
    that ran on the same weights (see :mod:`~ringpipe.pipeline.staleness.combine`). The caller
    clears gradients only after ``after_step`` (the SGD statistics read ``p.grad`` when there
    is no momentum buffer), and ``aggmsnag`` expects ``p.grad`` cleared after every step.

    ``mirrors``: parameters the stage holds but does not step, mirrors of a weight tied to an
    earlier stage that owns it (:mod:`~ringpipe.pipeline.tied_owner`). They have no optimizer
    state here, so they are not predicted (a forward uses the mirror as received); Gap Aware
    leaves them alone as they have no gradient at the step (the owner's policy acts on the
    weight's summed gradient); a stash keeps
    them with the stage's other weights, so a stashed backward uses the mirror its forward used.
    """
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not in [0, num_stages={num_stages})")
    chosen = parse_mitigations(names, step_every)
    if "ga_jfl" in chosen and not recompute:
        raise ValueError(
            "ga_jfl runs the backward on the current weights, which needs recomputation; "
            "pass recompute=True (or use 'ws+ga')"
        )
    if chosen == {"stale"}:
        return WeightPolicy()
    params = [p for p in params if p.requires_grad]
    mirrored = {id(p) for p in mirrors}
    stepped = [p for p in params if id(p) not in mirrored]
    kind = optimizer_kind(optimizer)
    ga_here = stage in gap_aware_stages(ga_stages, num_stages)
    ga_name = "ga" if "ga" in chosen else "ga_jfl" if "ga_jfl" in chosen else None
    if ga_name and kind in ("adam", "adamw") and "ws" not in chosen:
        raise ValueError(
            f"Gap Aware for {type(optimizer).__name__} measures the gap against stashed weights; "
            "add 'ws' (e.g. 'ws+ga')"
        )
    predictor = None
    if chosen & {"msnag", "aggmsnag"}:
        predictor = WeightPredictor(
            stepped,
            optimizer,
            scheduler,
            aggregate="aggmsnag" in chosen,
            nag_with_predictor=nag_with_predictor,
        )
    just_for_loss = ga_name == "ga_jfl"
    depth = num_stages - 1 - stage
    max_staleness = -(-depth // step_every)
    if ga_name == "ga" and ga_here and "ws" not in chosen and max_staleness > 1:
        raise ValueError(
            f"Gap Aware without weight stashing estimates the gap from the gradient (Gap = eta |g|), "
            f"the gap of staleness 1 only; stage {stage} of {num_stages} has staleness up to "
            f"{max_staleness} (step_every={step_every}) under ga_stages={ga_stages}. Add 'ws' (e.g. "
            "'ws+ga') so the gap is measured, or use ga_stages='almost_last_partition' (staleness 1)"
        )
    gap = None
    if ga_name and ga_here:
        gap = gap_aware_for(params, optimizer, big_gamma=ga_big_gamma, eps=ga_eps)
    elif ga_name:
        log.info(
            "stage %d of %d is outside ga_stages=%s: no Gap Aware%s", stage, num_stages, ga_stages,
            "; ga_jfl: backward on the current weights, no stash" if just_for_loss else "",
        )
    # Under ga_jfl the stash only sizes the gap: none where no gap is measured.
    stash = WeightStash(params) if "ws" in chosen and (gap is not None or not just_for_loss) else None
    name = "+".join(sorted(chosen))
    return MitigationPolicy(
        predictor=predictor,
        stash=stash,
        gap_aware=gap,
        just_for_loss=just_for_loss,
        requires_recompute="ga_jfl" in chosen,
        step_every=step_every,
        name=name,
        stage=stage,
    )
