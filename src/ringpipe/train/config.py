"""The trainer's typed configuration: schema, loading from YAML/JSON, ``--set`` overrides, errors.

Every section is a pydantic model with ``extra="forbid"``, so an unknown key is refused, and
the sections whose content depends on a name (model, data, optimizer, schedule) are unions
discriminated by ``name``: a wrong name lists the valid ones, and a key that the chosen
variant does not read is refused rather than silently ignored. The ``pipeline`` and ``dp``
sections are read only by the modes that use them; setting them for another mode is an error.
The defaults are the default run: an MLP on the embedded digits, data-parallel on 2 processes.

The sections live in :mod:`ringpipe.train.config_sections` (models, data, optimizers, schedules,
checkpoints) and :mod:`ringpipe.train.config_parallel` (pipeline, dp), the ``--set`` overrides in
:mod:`ringpipe.train.config_overrides`; every name is re-exported here.

The asynchronous pipeline's keys (``pipeline.step_every``, ``pipeline.mitigations`` and their
options) may also be written at the top level, with ``pipeline.recompute`` (``--set
mitigations=wp,ws,ga --set step_every=2 --set recompute=false``); they are moved into the
``pipeline`` section before validation, and the combination of mitigations is checked by
:func:`ringpipe.pipeline.staleness.make_policy` itself, so the config refuses exactly what the
pipeline would refuse.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from ringpipe.train.config_errors import did_you_mean, format_error
from ringpipe.train.config_overrides import apply_overrides, parse_override
from ringpipe.train.config_parallel import (
    ASYNC_KEYS,
    GA_STAGE_POLICIES,
    MITIGATION_DOCS,
    PIPELINE_SHORT_KEYS,
    DPConfig,
    PipelineConfig,
    dp_algorithms,
    mitigations_help,
)
from ringpipe.train.config_parallel import nest_short_keys as _nest_short_keys
from ringpipe.train.config_parallel import resolve_async as _resolve_async
from ringpipe.train.config_sections import (
    BUILTIN_DATA,
    BUILTIN_MODELS,
    MODE_NAMES,
    PIPELINE_MODES,
    AdamConfig,
    CheckpointConfig,
    CIFARConfig,
    CNNConfig,
    ConfigError,
    ConstantSchedule,
    CosineSchedule,
    DataConfig,
    DigitsConfig,
    IDXConfig,
    MLPConfig,
    ModelConfig,
    MultiStepSchedule,
    ObserveConfig,
    OptimizerConfig,
    ResNetConfig,
    ScheduleConfig,
    SGDConfig,
    StepSchedule,
    SyntheticConfig,
    SyntheticLMConfig,
    TransformerConfig,
)
from ringpipe.train.config_sections import Section as _Section

__all__ = [
    "ASYNC_KEYS",
    "MLPConfig", "CNNConfig", "ResNetConfig", "TransformerConfig", "DigitsConfig", "IDXConfig",
    "CIFARConfig", "SyntheticConfig", "SyntheticLMConfig", "SGDConfig", "AdamConfig", "ConstantSchedule",
    "StepSchedule", "MultiStepSchedule", "CosineSchedule", "ObserveConfig",
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
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32",
        description="forward passes under torch.autocast in this dtype (bf16 runs on CPU too); fp16 scales "
        "the loss (dynamic loss scale, steps with inf/nan gradients skipped on every rank)",
    )
    accumulate: int = Field(
        default=1, ge=1,
        description="backward passes (equal chunks of each batch) per optimizer step in modes single, ddp "
        "and dp (dp: dp.backward_passes_per_step); pipeline modes accumulate over pipeline.microbatches",
    )
    logger: Literal["csv", "tensorboard"] = Field(
        default="csv",
        description="metrics.jsonl and metrics.csv are always written; tensorboard adds event files in "
        "<run-dir>/tensorboard (needs the tensorboard package: pip install ringpipe[tensorboard])",
    )
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
        self._check_steps()
        if self.logger == "tensorboard":
            from ringpipe.train.metric_loggers import tensorboard_problem

            if tensorboard_problem():
                raise ValueError(tensorboard_problem())
        builtin = self.model.name in BUILTIN_MODELS and self.data.name in BUILTIN_DATA
        if builtin and self.model.name == "transformer" and self.data.name != "synthetic_lm":
            raise ValueError(
                f"model 'transformer' is a language model and needs token data (data.name=synthetic_lm), "
                f"got data.name={self.data.name!r}"
            )
        if builtin and self.data.name == "synthetic_lm" and self.model.name != "transformer":
            raise ValueError(
                f"data 'synthetic_lm' holds token sequences for model 'transformer', got model.name={self.model.name!r}"
            )
        if (self.model.name in ("cnn", "resnet") and isinstance(self.data, SyntheticConfig)
                and len(self.data.shape) != 3):
            raise ValueError(
                f"model {self.model.name!r} needs images: data.shape must be [channels, height, width], "
                f"got {self.data.shape}"
            )
        return self

    def _check_steps(self) -> None:
        """Accumulation, clipping and loss scaling against the mode that runs them."""
        clip = self.optimizer.clip_grad_norm
        if self.mode == "async" and (clip is not None or self.precision == "fp16"):
            what = f"optimizer.clip_grad_norm={clip}" if clip is not None else "precision=fp16"
            raise ValueError(
                f"{what} is not available in mode 'async': its stages step at different times on the gradients "
                f"of different micro-batches, so there is no whole-model gradient to clip or to check for "
                f"overflow; use a synchronous pipeline mode (seq, gpipe, 1f1b), or precision=bf16 (no loss scale)"
            )
        if clip is not None and self.dp is not None and self.dp.algorithm == "adasum":
            raise ValueError(
                f"optimizer.clip_grad_norm={clip} with dp.algorithm=adasum: Adasum combines each replica's own "
                f"update, so no averaged gradient exists to clip; use another dp.algorithm or drop the clipping"
            )
        if self.accumulate == 1:
            return
        if self.mode in PIPELINE_MODES:
            assert self.pipeline is not None
            raise ValueError(
                f"accumulate={self.accumulate} is read by modes single, ddp and dp; mode {self.mode!r} already "
                f"accumulates the gradients of pipeline.microbatches={self.pipeline.microbatches} micro-batches "
                f"per step: raise pipeline.microbatches (and batch_size) instead"
            )
        if self.dp is not None:
            given = "backward_passes_per_step" in self.dp.model_fields_set
            if given and self.dp.backward_passes_per_step != self.accumulate:
                raise ValueError(
                    f"accumulate={self.accumulate} and dp.backward_passes_per_step="
                    f"{self.dp.backward_passes_per_step} disagree: give one of them"
                )
            self.dp.__dict__["backward_passes_per_step"] = self.accumulate
        if self.batch_size % self.accumulate:
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by accumulate={self.accumulate} "
                f"(each backward pass takes an equal share of the batch)"
            )

    def total_steps(self, records: int, replicas: int) -> int:
        """Optimizer steps for ``epochs`` passes, epochs counted as ``step * global_batch / records``."""
        return max(1, math.ceil(self.epochs * records / (self.batch_size * replicas) - 1e-9))


# --------------------------------------------------------------------------------- loading


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
    raw, given = default_sections(), dict[str, Any]()
    for layer in (base, read_file(path) if path is not None else None):
        if layer is not None:
            try:
                raw = merge(raw, _nest_short_keys(layer))
                given = merge(given, _nest_short_keys(layer))
            except ValueError as exc:
                raise ConfigError(f"invalid configuration:\n  {exc}") from None
    return apply_overrides(raw, overrides, given)


def validate(raw: Mapping[str, Any]) -> TrainConfig:
    """A :class:`TrainConfig` from a raw dict, or a :class:`ConfigError` listing every problem."""
    try:
        return TrainConfig.model_validate(dict(raw))
    except ValidationError as err:
        raise ConfigError(format_error(err, raw, TrainConfig)) from None


def dump_config(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved configuration as plain data (sections a mode does not read are left out)."""
    out = cfg.model_dump(mode="json", exclude_none=False, exclude={k for k in ("pipeline", "dp") if getattr(cfg, k) is None})
    if out.get("pipeline"):  # async keys that the mode or the chosen mitigations do not read
        out["pipeline"] = {k: v for k, v in out["pipeline"].items() if not (k in ASYNC_KEYS and v is None)}
    return out
