"""The trainer's typed configuration: schema, loading from YAML/JSON, ``--set`` overrides, errors.

Every section is a pydantic model with ``extra="forbid"``, so an unknown key is refused, and
the sections whose content depends on a name (model, data, optimizer, schedule) are unions
discriminated by ``name``: a wrong name lists the valid ones, and a key that the chosen
variant does not read is refused rather than silently ignored. The ``pipeline`` and ``dp``
sections are read only by the modes that use them; setting them for another mode is an error.
The defaults are the default run: an MLP on the embedded digits, data-parallel on 2 processes.

The asynchronous pipeline's keys (``pipeline.step_every``, ``pipeline.mitigations`` and their
options) may also be written at the top level, with ``pipeline.recompute`` (``--set
mitigations=wp,ws,ga --set step_every=2 --set recompute=false``); they are moved into the
``pipeline`` section before validation, and the combination of mitigations is checked by
:func:`ringpipe.pipeline.staleness.make_policy` itself, so the config refuses exactly what the
pipeline would refuse.
"""

from __future__ import annotations

import difflib
import json
import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "ConfigError",
    "TrainConfig",
    "ModelConfig",
    "DataConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "CheckpointConfig",
    "PipelineConfig",
    "DPConfig",
    "PIPELINE_MODES",
    "MODE_NAMES",
    "MITIGATION_DOCS",
    "GA_STAGE_POLICIES",
    "PIPELINE_SHORT_KEYS",
    "mitigations_help",
    "dp_algorithms",
    "load_config",
    "resolve_raw",
    "default_sections",
    "merge",
    "read_file",
    "bundled_configs",
    "validate",
    "apply_overrides",
    "parse_override",
    "dump_config",
    "did_you_mean",
]

#: Every mode the schema knows (whether it can run in this build is decided by ``modes``).
MODE_NAMES = ("single", "ddp", "dp", "seq", "gpipe", "1f1b", "async")
#: Modes that split the model into stages and read the ``pipeline`` section.
PIPELINE_MODES = ("seq", "gpipe", "1f1b", "async")

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


class ConfigError(ValueError):
    """A configuration is invalid; the message names the field, the value and the valid choices."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------- models


class MLPConfig(_Section):
    """Multi-layer perceptron on flattened inputs."""

    name: Literal["mlp"] = "mlp"
    hidden: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [128, 64])
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)


class CNNConfig(_Section):
    """Small convolutional network: conv-ReLU-pool blocks, then a hidden dense layer."""

    name: Literal["cnn"] = "cnn"
    channels: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [16, 32], min_length=1)
    hidden: int = Field(default=64, gt=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)


class ResNetConfig(_Section):
    """Small residual network (basic blocks, He et al. 2016), one stage per entry of ``blocks``."""

    name: Literal["resnet"] = "resnet"
    width: int = Field(default=16, gt=0)
    blocks: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1, 1, 1], min_length=1)


class TransformerConfig(_Section):
    """Small decoder-only transformer language model (pre-norm blocks, causal attention)."""

    name: Literal["transformer"] = "transformer"
    d_model: int = Field(default=64, gt=0)
    heads: int = Field(default=4, gt=0)
    layers: int = Field(default=2, gt=0)
    ff: int = Field(default=128, gt=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerConfig:
        if self.d_model % self.heads:
            raise ValueError(
                f"model.d_model={self.d_model} must be divisible by model.heads={self.heads}"
            )
        return self


ModelConfig = Annotated[
    MLPConfig | CNNConfig | ResNetConfig | TransformerConfig, Field(discriminator="name")
]

# --------------------------------------------------------------------------------- data


class DigitsConfig(_Section):
    """scikit-learn's 8x8 handwritten digits (1,797 images), shipped with the package: no download."""

    name: Literal["digits"] = "digits"
    test_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)


class IDXConfig(_Section):
    """MNIST or Fashion-MNIST from the four IDX files (optionally gzipped) in ``root``."""

    name: Literal["mnist", "fashion_mnist"]
    root: Path


class CIFARConfig(_Section):
    """CIFAR-10 from its python pickle batches in ``root`` (or ``root/cifar-10-batches-py``)."""

    name: Literal["cifar10"] = "cifar10"
    root: Path


class SyntheticConfig(_Section):
    """Gaussian class clusters of any input shape, for throughput runs and tests."""

    name: Literal["synthetic"] = "synthetic"
    samples: int = Field(default=2048, gt=1)
    classes: int = Field(default=10, gt=1)
    shape: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1, 8, 8], min_length=1)
    noise: float = Field(default=1.0, ge=0.0)
    test_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)


class SyntheticLMConfig(_Section):
    """Token sequences from a noisy fixed successor map, for the transformer language model."""

    name: Literal["synthetic_lm"] = "synthetic_lm"
    samples: int = Field(default=2048, gt=1)
    vocab: int = Field(default=32, gt=1)
    seq_len: int = Field(default=16, gt=1)
    noise: float = Field(default=0.1, ge=0.0, le=1.0)
    test_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)


DataConfig = Annotated[
    DigitsConfig | IDXConfig | CIFARConfig | SyntheticConfig | SyntheticLMConfig,
    Field(discriminator="name"),
]

# --------------------------------------------------------------------------------- optimizers


class _OptimizerBase(_Section):
    lr: float = Field(gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    scale_lr: bool = True


class SGDConfig(_OptimizerBase):
    """SGD with (Nesterov) momentum; ``lr`` is the single-process rate, scaled by the replicas if ``scale_lr``."""

    name: Literal["sgd"] = "sgd"
    lr: float = Field(default=0.05, gt=0.0)
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    nesterov: bool = False

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDConfig:
        if self.nesterov and self.momentum == 0:
            raise ValueError("optimizer.nesterov=true needs optimizer.momentum > 0")
        return self


class AdamConfig(_OptimizerBase):
    """Adam (L2 weight decay) or AdamW (decoupled weight decay)."""

    name: Literal["adam", "adamw"] = "adam"
    lr: float = Field(default=0.001, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0.0)


OptimizerConfig = Annotated[SGDConfig | AdamConfig, Field(discriminator="name")]

# --------------------------------------------------------------------------------- schedules


class _ScheduleBase(_Section):
    warmup_epochs: float = Field(default=0.0, ge=0.0)
    warmup_start_factor: float | None = Field(default=None, gt=0.0, le=1.0)


class ConstantSchedule(_ScheduleBase):
    """Constant learning rate after the warmup."""

    name: Literal["constant"] = "constant"


class StepSchedule(_ScheduleBase):
    """Multiply the rate by ``gamma`` every ``step_epochs`` epochs."""

    name: Literal["step"] = "step"
    step_epochs: float = Field(default=10.0, gt=0.0)
    gamma: float = Field(default=0.1, gt=0.0, le=1.0)


class MultiStepSchedule(_ScheduleBase):
    """Multiply the rate by ``gamma`` at each epoch of ``milestones``."""

    name: Literal["multistep"] = "multistep"
    milestones: list[float] = Field(default_factory=lambda: [30.0, 60.0, 80.0])
    gamma: float = Field(default=0.1, gt=0.0, le=1.0)

    @field_validator("milestones")
    @classmethod
    def _increasing(cls, v: list[float]) -> list[float]:
        if any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError(f"milestones {v} must be strictly increasing")
        return v


class CosineSchedule(_ScheduleBase):
    """Half-cosine decay from the rate to ``min_factor`` x the rate at the last epoch."""

    name: Literal["cosine"] = "cosine"
    min_factor: float = Field(default=0.0, ge=0.0, le=1.0)


ScheduleConfig = Annotated[
    ConstantSchedule | StepSchedule | MultiStepSchedule | CosineSchedule,
    Field(discriminator="name"),
]

# --------------------------------------------------------------------------------- other sections


class CheckpointConfig(_Section):
    """Checkpoints in ``<run-dir>/checkpoints``, written by rank 0 (also at the end and on ``max_steps``)."""

    every_epochs: int = Field(default=1, ge=0)
    keep: int = Field(default=3, ge=1)


class ObserveConfig(_Section):
    """Where the time went, written by rank 0 when the run ends (all ranks' events gathered on one clock).

    ``profile``: ``comm_profile.txt`` (MPI-style table of time, calls and bytes per operation and
    rank) and ``doctor.txt`` (late ranks, placement). ``timeline``: also ``events.json`` and
    ``timeline.json`` (Chrome trace: chrome://tracing or ui.perfetto.dev).
    """

    profile: bool = True
    timeline: bool = False


class PipelineConfig(_Section):
    """How pipeline modes cut the model: ``stages`` per replica (world = stages x replicas).

    ``step_every``, ``mitigations``, ``ga_stages`` and ``nag_with_predictor`` are read by mode
    ``async`` only; left out, they resolve to 1, ``[stale]`` and the defaults of the chosen names.
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


# --------------------------------------------------------------------------------- root


class TrainConfig(_Section):
    """A complete training run. The defaults are ``ringpipe train`` with no arguments."""

    mode: str = "dp"
    nprocs: int = Field(default=2, ge=1)
    backend: Literal["gloo", "nccl", "mpi"] = "gloo"
    seed: int = 0
    epochs: float = Field(default=20.0, gt=0.0)
    batch_size: int = Field(default=32, ge=1)
    max_steps: int | None = Field(default=None, ge=1)
    log_every: int = Field(default=10, ge=1)
    model: ModelConfig = Field(default_factory=lambda: MLPConfig())
    data: DataConfig = Field(default_factory=lambda: DigitsConfig())
    optimizer: OptimizerConfig = Field(default_factory=lambda: AdamConfig())
    schedule: ScheduleConfig = Field(default_factory=lambda: CosineSchedule(warmup_epochs=2.0))
    checkpoint: CheckpointConfig = Field(default_factory=lambda: CheckpointConfig())
    observe: ObserveConfig = Field(default_factory=lambda: ObserveConfig())
    pipeline: PipelineConfig | None = None
    dp: DPConfig | None = None

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, v: str) -> str:
        if v not in MODE_NAMES:
            raise ValueError(f"unknown mode {v!r}{did_you_mean(v, MODE_NAMES)}; valid modes: {', '.join(MODE_NAMES)}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _short_keys(cls, data: Any) -> Any:
        return _nest_short_keys(data) if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _sections_match_mode(self) -> TrainConfig:
        given = [k for k in ASYNC_KEYS if self.pipeline is not None and getattr(self.pipeline, k) is not None]
        if given and self.mode != "async":
            key = given[0]
            raise ValueError(
                f"pipeline.{key}={getattr(self.pipeline, key)!r} (or top-level {key}) is read only by mode "
                f"'async', not by mode {self.mode!r}, whose schedule steps once per batch with no stale "
                f"weight: remove it or set mode=async"
            )
        if self.pipeline is not None and self.mode not in PIPELINE_MODES:
            keys = ", ".join(f"pipeline.{k}" for k in sorted(self.pipeline.model_fields_set))
            raise ValueError(
                f"the pipeline section is read only by modes {', '.join(PIPELINE_MODES)}, not by mode "
                f"{self.mode!r}{f' (given: {keys})' if keys else ''}: remove it or change the mode"
            )
        if self.dp is not None and self.mode != "dp":
            raise ValueError(
                f"the dp section is read only by mode 'dp', not by mode {self.mode!r}: remove it or change the mode"
            )
        # Fill in the section the mode reads (plain dict writes: no re-validation on assignment).
        if self.mode in PIPELINE_MODES and self.pipeline is None:
            self.__dict__["pipeline"] = PipelineConfig()
        if self.mode == "dp" and self.dp is None:
            self.__dict__["dp"] = DPConfig()
        if self.mode == "async":
            assert self.pipeline is not None
            _resolve_async(self.pipeline, self.optimizer)
        if self.dp is not None and self.batch_size % self.dp.backward_passes_per_step:
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by dp.backward_passes_per_step="
                f"{self.dp.backward_passes_per_step} (each backward pass takes an equal share of the batch)"
            )
        if self.mode == "single" and "nprocs" in self.model_fields_set and self.nprocs != 1:
            raise ValueError(f"mode 'single' runs one process but nprocs={self.nprocs}: set nprocs=1 or pick ddp/dp")
        if self.mode == "single":
            self.__dict__["nprocs"] = 1
        if self.model.name == "transformer" and self.data.name != "synthetic_lm":
            raise ValueError(
                f"model 'transformer' is a language model and needs token data (data.name=synthetic_lm), "
                f"got data.name={self.data.name!r}"
            )
        if self.data.name == "synthetic_lm" and self.model.name != "transformer":
            raise ValueError(
                f"data 'synthetic_lm' holds token sequences for model 'transformer', got model.name={self.model.name!r}"
            )
        if self.model.name in ("cnn", "resnet") and self.data.name == "synthetic" and len(self.data.shape) != 3:
            raise ValueError(
                f"model {self.model.name!r} needs images: data.shape must be [channels, height, width], "
                f"got {self.data.shape}"
            )
        return self

    def total_steps(self, records: int, replicas: int) -> int:
        """Optimizer steps for ``epochs`` passes, epochs counted as ``step * global_batch / records``."""
        return max(1, math.ceil(self.epochs * records / (self.batch_size * replicas) - 1e-9))


# --------------------------------------------------------------------------------- async pipeline


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


# --------------------------------------------------------------------------------- loading


def _format_error(err: ValidationError, raw: Mapping[str, Any]) -> str:
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        # Discriminated unions put the variant tag in the location (model.mlp.hidden): drop it.
        clean = [p for i, p in enumerate(loc) if not (i > 0 and _is_tag(raw, loc[:i], p))]
        field = ".".join(clean) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            valid = _valid_keys(raw, clean[:-1])
            hint = f"; valid keys here: {', '.join(valid)}" if valid else ""
            lines.append(f"{field}: unknown key (value {e['input']!r}){did_you_mean(clean[-1], valid)}{hint}")
        elif e["type"] == "union_tag_invalid":
            ctx = e.get("ctx", {})
            tag, expected = str(ctx.get("tag")), str(ctx.get("expected_tags", ""))
            names = [n.strip(" '\"") for n in expected.split(",")]
            lines.append(f"{field}.name={tag!r}: unknown name{did_you_mean(tag, names)}; valid names: {expected}")
        elif e["type"] == "missing":
            lines.append(f"{field}: required field is missing")
        elif field == "<root>":
            lines.append(msg)
        elif e["type"] == "value_error":
            lines.append(f"{field}: {msg}")
        else:
            lines.append(f"{field}={e['input']!r}: {msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'epochs'?)"`` for the closest of ``choices``, or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_tag(raw: Mapping[str, Any], path: Sequence[str], part: str) -> bool:
    node: Any = raw
    for p in path:
        if not isinstance(node, Mapping) or p not in node:
            return False
        node = node[p]
    return isinstance(node, Mapping) and node.get("name") == part and part not in node


def _valid_keys(raw: Mapping[str, Any], path: Sequence[str]) -> list[str]:
    """The field names of the section at ``path`` (for the section variant chosen by ``name``)."""
    model: Any = TrainConfig
    node: Any = raw
    for p in path:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or p not in model.model_fields:
            return []
        node = node.get(p, {}) if isinstance(node, Mapping) else {}
        model = _resolve(model.model_fields[p].annotation, node)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields) + (list(PIPELINE_SHORT_KEYS) if not path else [])
    return []


def _resolve(annotation: Any, node: Any) -> Any:
    """The concrete section class behind ``annotation`` for the raw value ``node``."""
    candidates = [a for a in _flatten_union(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(candidates) == 1:
        return candidates[0]
    name = node.get("name") if isinstance(node, Mapping) else None
    for c in candidates:
        field = c.model_fields.get("name")
        if field is not None and name in getattr(field.annotation, "__args__", ()):
            return c
    return candidates[0] if candidates else None


def _flatten_union(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    meta = getattr(annotation, "__metadata__", None)
    if meta is not None:  # Annotated[X, ...]
        return _flatten_union(annotation.__origin__)
    if args:
        out: list[Any] = []
        for a in args:
            out.extend(_flatten_union(a))
        return out
    return [annotation]


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is read as YAML (numbers, bools, lists, null)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected key=value with a dotted key, e.g. --set optimizer.lr=0.1")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``--set key=value`` items to a raw config dict (a copy is returned).

    Setting ``section.name`` to another variant drops the section's keys that the old variant
    had and the new one does not read, so ``--set model.name=cnn`` works on an MLP config.
    A top-level pipeline short key (``--set step_every=2``) sets ``pipeline.step_every``.
    """
    out = json.loads(json.dumps(raw, default=str))
    for item in overrides:
        path, value = parse_override(item)
        if len(path) == 1 and path[0] in PIPELINE_SHORT_KEYS:
            path = ["pipeline", path[0]]  # the short form of a pipeline key
        node = out
        for p in path[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is a value ({child!r}), not a section")
            node = child
        last = path[-1]
        if last == "name" and node.get("name") not in (None, value) and len(path) == 2:
            node.clear()
        node[last] = value
    return out


#: The example configurations shipped with ringpipe (``--config NAME`` finds them by name).
BUNDLED = Path(__file__).resolve().parents[1] / "configs"


def bundled_configs() -> list[str]:
    """Names of the example configs shipped with ringpipe (``gpipe``, ``async``, ...)."""
    return sorted(p.stem for p in BUNDLED.glob("*.yaml"))


def read_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict; a bare name such as ``gpipe`` is a bundled example."""
    p = Path(path)
    if not p.is_file() and p.parent == Path(".") and (BUNDLED / f"{p.stem}.yaml").is_file() and p.suffix in ("", ".yaml"):
        p = BUNDLED / f"{p.stem}.yaml"
    if p.is_dir():
        raise ConfigError(
            f"config file {str(p)!r} is a directory; give a YAML or JSON config file, or the name of a "
            f"bundled example: {', '.join(bundled_configs())}"
        )
    if not p.is_file():
        hint = did_you_mean(p.stem, bundled_configs()) if p.parent == Path(".") else ""
        raise ConfigError(
            f"config file {str(p)!r} does not exist{hint}; give a path, or the name of a bundled example: "
            f"{', '.join(bundled_configs())}"
        )
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys, got {type(data).__name__}")
    return data


def default_sections() -> dict[str, Any]:
    """The default variant of each named section, the base that files and ``--set`` refine."""
    cfg = TrainConfig()
    return {k: getattr(cfg, k).model_dump(mode="json") for k in ("model", "data", "optimizer", "schedule")}


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``update`` onto ``base``; a section whose ``name`` changes is replaced, not merged."""
    out = dict(base)
    for key, value in update.items():
        old = out.get(key)
        if (
            isinstance(old, Mapping)
            and isinstance(value, Mapping)
            and value.get("name", old.get("name")) == old.get("name")
        ):
            out[key] = merge(old, value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    base: Mapping[str, Any] | None = None,
) -> TrainConfig:
    """Validate the defaults refined by ``base``, the file at ``path`` and ``--set`` overrides, in order."""
    return validate(resolve_raw(path, overrides, base))


def resolve_raw(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The raw config dict of :func:`load_config`, before validation (keys left out take their defaults)."""
    raw = default_sections()
    for layer in (base, read_file(path) if path is not None else None):
        if layer is not None:
            try:
                raw = merge(raw, _nest_short_keys(layer))
            except ValueError as exc:
                raise ConfigError(f"invalid configuration:\n  {exc}") from None
    return apply_overrides(raw, overrides)


def validate(raw: Mapping[str, Any]) -> TrainConfig:
    """A :class:`TrainConfig` from a raw dict, or a :class:`ConfigError` listing every problem."""
    try:
        return TrainConfig.model_validate(dict(raw))
    except ValidationError as err:
        raise ConfigError(_format_error(err, raw)) from None


def dump_config(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved configuration as plain data (sections a mode does not read are left out)."""
    out = cfg.model_dump(mode="json", exclude_none=False, exclude={k for k in ("pipeline", "dp") if getattr(cfg, k) is None})
    if out.get("pipeline"):  # async keys that the mode or the chosen mitigations do not read
        out["pipeline"] = {k: v for k, v in out["pipeline"].items() if not (k in ASYNC_KEYS and v is None)}
    return out
