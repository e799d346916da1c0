"""The config sections of the parallel modes: ``pipeline`` (stages, micro-batches, the async keys) and ``dp``.

The asynchronous pipeline's keys (``pipeline.step_every``, ``pipeline.mitigations`` and their
options) may also be written at the top level, with ``pipeline.recompute``; they are moved into
the ``pipeline`` section before validation (:func:`nest_short_keys`), and the combination of
mitigations is checked by :func:`ringpipe.pipeline.staleness.make_policy` itself
(:func:`resolve_async`), so the config refuses exactly what the pipeline would refuse.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from ringpipe.train.config_sections import Section as _Section

__all__ = [
    "MITIGATION_DOCS",
    "GA_STAGE_POLICIES",
    "ASYNC_KEYS",
    "PIPELINE_SHORT_KEYS",
    "mitigations_help",
    "PipelineConfig",
    "DPConfig",
    "dp_algorithms",
    "nest_short_keys",
    "resolve_async",
]

#: Staleness mitigations of mode ``async`` (the names of ``ringpipe.pipeline.staleness.MITIGATIONS``).
MITIGATION_DOCS = {
    "stale": "no mitigation. The forward uses the weights current at forward time, the backward those "
    "current at backward time; with recompute=true the forward is replayed on the current weights, "
    "without it the saved activations keep the old weights and only the parameter gradients use the new ones",
    "ws": "weight stashing (PipeDream): each backward runs on the weights its forward used; with "
    "step_every > 1 one stash per optimizer step, taken by the step's first stale forward: every "
    "micro-batch of the step runs its forward and backward on it",
    "wp": "weight prediction: each forward uses the weights predicted d steps ahead from the optimizer "
    "state and the LR schedule; msnag for step_every=1, aggmsnag for step_every>1",
    "msnag": "weight prediction from the optimizer state alone (future gradients taken as zero)",
    "aggmsnag": "weight prediction that also uses the partially accumulated gradient (step_every>1 only)",
    "ga": "Gap Aware (Barkai et al. 2020): stale gradients divided by 1 + Gap/C on the stages of ga_stages; "
    "Adam and AdamW need ws with it",
    "ga_jfl": "Gap Aware just for loss: backward on the current weights, the stash only sizes the gap "
    "(needs ws and recompute=true); on stages outside ga_stages the backward also runs on the current "
    "weights, with no penalty and no stash",
}
#: Which stages Gap Aware applies to (``ringpipe.pipeline.staleness.GA_STAGE_POLICIES``).
GA_STAGE_POLICIES = ("almost_last_partition", "all_except_last", "all_except_last_two")
#: Keys of the ``pipeline`` section that read only for mode ``async``.
ASYNC_KEYS = ("step_every", "mitigations", "ga_stages", "nag_with_predictor")
#: Pipeline keys that may also be written at the top level (``--set step_every=2``).
PIPELINE_SHORT_KEYS = ("recompute", *ASYNC_KEYS)


def mitigations_help(width: int = 100) -> str:
    """The mitigation names, how they combine and their options, as text for ``ringpipe train`` help."""
    rows = [*MITIGATION_DOCS.items(),
            ("ga_stages", f"{' | '.join(GA_STAGE_POLICIES)} (default all_except_last)"),
            ("nag_with_predictor", "also predict one step ahead at staleness 0 (last stage); needs a predictor"),
            ("step_every", "optimizer step, and LR schedule step, every k micro-batches (k divides "
                           "pipeline.microbatches)")]
    lines = ["staleness mitigations, mode async (e.g. --set mitigations=wp,ws,ga; default stale).",
             "Combine with ',' or '+': at most one predictor (wp, msnag, aggmsnag), ws, one of ga | ga_jfl;",
             "'stale' stands alone. Options (pipeline.KEY or top-level KEY):"]
    pad = max(len(name) for name, _ in rows) + 4
    for name, doc in rows:
        lines.append(textwrap.fill(doc, width, initial_indent=f"  {name:<{pad - 2}}",
                                   subsequent_indent=" " * pad))
    return "\n".join(lines)


class PipelineConfig(_Section):
    """How pipeline modes cut the model: ``stages`` per replica (world = stages x replicas).

    ``step_every``, ``mitigations``, ``ga_stages`` and ``nag_with_predictor`` are read by mode
    ``async`` only; left out, they resolve to 1, ``[stale]`` and the defaults of the chosen names.
    ``chunks`` is read by mode ``interleaved`` only (left out: 2), and ``balance`` then gives
    ``stages x chunks`` layer counts.
    """

    stages: int = Field(default=2, ge=1)
    microbatches: int = Field(default=4, ge=1)
    balance: list[Annotated[int, Field(gt=0)]] | None = None
    partition: Literal["parameters", "time", "uniform"] = "parameters"
    recompute: bool = Field(
        default=False,
        description="replay each forward before its backward instead of keeping activations "
        "(async: the backward then sees the current weights, see mitigation 'stale')",
    )
    step_every: int | None = Field(
        default=None, ge=1,
        description="async only: optimizer step (and LR schedule step) every step_every micro-batches",
    )
    mitigations: list[str] | None = Field(
        default=None,
        description="async only: staleness mitigations, a list or 'wp,ws,ga'; "
        + "; ".join(f"{k}: {v}" for k, v in MITIGATION_DOCS.items()),
    )
    ga_stages: Literal["almost_last_partition", "all_except_last", "all_except_last_two"] | None = Field(
        default=None,
        description="async with ga or ga_jfl: the stages Gap Aware applies to (default all_except_last)",
    )
    nag_with_predictor: bool | None = Field(
        default=None,
        description="async with a predictor: also predict one step ahead at staleness 0 (a Nesterov look-ahead)",
    )
    split_points: list[str] | None = Field(
        default=None,
        description="qualified module names where a new stage begins (e.g. [transformer.h.2]); the model "
        "(any nn.Module, a Hugging Face one too) is traced and cut there into len+1 = stages x chunks parts. "
        "Without it a model that is not an nn.Sequential is traced and balanced by parameters",
    )
    chunks: int | None = Field(
        default=None, ge=1,
        description="mode interleaved only: model chunks per rank (default 2); the model is cut into "
        "stages x chunks parts, rank r holds parts r, r+stages, ...; microbatches must be a multiple of stages",
    )
    memory_budget: str | None = Field(
        default=None,
        description="bytes a stage may hold (e.g. 2G, 512M): a mode whose predicted peak per stage "
        "(`ringpipe plan`) exceeds it is refused before training, with the figures",
    )

    @field_validator("mitigations", mode="before")
    @classmethod
    def _split_names(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [n.strip().lower() for n in v.replace("+", ",").split(",") if n.strip()]
        if isinstance(v, list | tuple):
            return [n.strip().lower() if isinstance(n, str) else n for n in v]
        return v


class DPConfig(_Section):
    """ringpipe's DistributedOptimizer settings (``dp`` mode)."""

    bucket_mb: float = Field(default=25.0, gt=0.0)
    compression: Literal["none", "fp16", "bf16"] = "none"
    backward_passes_per_step: int = Field(default=1, ge=1)
    algorithm: str = Field(default="native", description="allreduce algorithm, one of dp_algorithms()")

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, v: str) -> str:
        valid = dp_algorithms()
        if v not in valid:
            raise ValueError(f"{v!r} is not an allreduce algorithm; valid algorithms: {', '.join(valid)}")
        return v


def dp_algorithms() -> tuple[str, ...]:
    """The names ``dp.algorithm`` accepts: the allreduce algorithms of ``ringpipe.collectives``."""
    try:
        from ringpipe.collectives import SUPPORTED
    except ImportError:  # a build without the collectives: the backend's own allreduce only
        return ("native",)
    return tuple(SUPPORTED["allreduce"])


def _same_value(key: str, a: Any, b: Any) -> bool:
    if key == "mitigations":
        split = PipelineConfig._split_names
        return bool(split(a) == split(b))
    return bool(a == b)


def _nest_short_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Move the top-level short forms (``step_every``, ``mitigations``, ...) into ``pipeline``."""
    out = dict(raw)
    short = [k for k in PIPELINE_SHORT_KEYS if k in out]
    section = out.get("pipeline")
    if not short or not isinstance(section, Mapping | None):
        return out  # nothing to move, or a malformed section that field validation reports
    section = dict(section or {})
    for key in short:
        value = out.pop(key)
        if key in section and not _same_value(key, section[key], value):
            raise ValueError(
                f"{key}={value!r} and pipeline.{key}={section[key]!r} disagree: give the key once"
            )
        section[key] = value
    out["pipeline"] = section
    return out


def _resolve_async(p: PipelineConfig, optimizer: Any) -> None:
    """Check mode async's keys with the staleness factory and fill in their defaults."""
    import torch

    from ringpipe.pipeline.staleness import gap_aware_stages, make_policy, parse_mitigations
    from ringpipe.train.optimizers import build_optimizer

    k = p.step_every or 1
    if p.microbatches % k:
        raise ValueError(
            f"pipeline.step_every={k} must divide pipeline.microbatches={p.microbatches}, so that every "
            f"optimizer step averages step_every micro-batches: change one of them"
        )
    names = list(p.mitigations or ["stale"])
    field = f"pipeline.mitigations={','.join(names)}"
    try:
        chosen = parse_mitigations(names, k)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None
    gap_aware = bool(chosen & {"ga", "ga_jfl"})
    predicts = bool(chosen & {"msnag", "aggmsnag"})
    if p.ga_stages is not None and not gap_aware:
        raise ValueError(f"pipeline.ga_stages={p.ga_stages!r} is read only with mitigation ga or ga_jfl; {field}")
    if p.nag_with_predictor is not None and not predicts:
        raise ValueError(
            f"pipeline.nag_with_predictor={p.nag_with_predictor} is read only with a weight predictor "
            f"(wp, msnag, aggmsnag); {field}"
        )
    ga_stages = p.ga_stages or "all_except_last"
    if gap_aware and not gap_aware_stages(ga_stages, p.stages):
        raise ValueError(
            f"pipeline.ga_stages={ga_stages!r} applies Gap Aware to no stage of a {p.stages}-stage pipeline; "
            f"choose another of {', '.join(GA_STAGE_POLICIES)} or drop ga from the mitigations"
        )
    # The factory decides which combinations make sense (with this optimizer, recompute and
    # step_every): build every stage's policy on a one-element stand-in parameter.
    param = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([param], optimizer, optimizer.lr)
    for stage in range(p.stages):
        try:
            make_policy(
                names, [param], opt, stage=stage, num_stages=p.stages, step_every=k,
                recompute=p.recompute, nag_with_predictor=bool(p.nag_with_predictor), ga_stages=ga_stages,
            )
        except ValueError as exc:
            raise ValueError(
                f"{field} with pipeline.recompute={str(p.recompute).lower()}, pipeline.step_every={k} and "
                f"optimizer.name={optimizer.name}: {exc}"
            ) from None
    p.__dict__.update(step_every=k, mitigations=names)
    if gap_aware:
        p.__dict__["ga_stages"] = ga_stages
    if predicts:
        p.__dict__["nag_with_predictor"] = bool(p.nag_with_predictor)


nest_short_keys = _nest_short_keys
resolve_async = _resolve_async
