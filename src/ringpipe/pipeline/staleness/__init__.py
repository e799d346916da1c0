"""Staleness mitigation for asynchronous pipelines: weight prediction, stashing, Gap Aware."""

from ringpipe.pipeline.staleness.combine import MitigationPolicy
from ringpipe.pipeline.staleness.gap_aware import (
    GA_STAGE_POLICIES,
    AdamGapAware,
    GapAware,
    SGDGapAware,
    gap_aware_for,
    gap_aware_stages,
)
from ringpipe.pipeline.staleness.live_params import live_forward
from ringpipe.pipeline.staleness.lr_lookahead import future_lrs
from ringpipe.pipeline.staleness.optimizer_kind import optimizer_kind
from ringpipe.pipeline.staleness.policy_factory import MITIGATIONS, make_policy, parse_mitigations
from ringpipe.pipeline.staleness.predict import WeightPredictor, momentum_coefficient
from ringpipe.pipeline.staleness.stash import WeightStash
from ringpipe.pipeline.staleness.sutskever import SutskeverSGD

__all__ = [
    "GA_STAGE_POLICIES",
    "MITIGATIONS",
    "AdamGapAware",
    "GapAware",
    "MitigationPolicy",
    "SGDGapAware",
    "SutskeverSGD",
    "WeightPredictor",
    "WeightStash",
    "future_lrs",
    "gap_aware_for",
    "gap_aware_stages",
    "live_forward",
    "make_policy",
    "momentum_coefficient",
    "optimizer_kind",
    "parse_mitigations",
]
