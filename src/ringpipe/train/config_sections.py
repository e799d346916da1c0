"""The trainer's config schema, section by section: models, data, optimizers, schedules, checkpoints.

Each section is a pydantic model with ``extra="forbid"``; the sections whose content depends on
a name are unions discriminated by ``name``. Besides the built-in names, a model or data section
may name the user's own factory: a name registered with ``MODELS.register`` / ``DATASETS.register``
or an import path ``package.module:function`` (:class:`UserModelConfig`, :class:`UserDataConfig`).
The root :class:`~ringpipe.train.config.TrainConfig` and the loading rules are in
:mod:`ringpipe.train.config`; the parallel sections (pipeline, dp) in :mod:`ringpipe.train.config_parallel`.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "ConfigError",
    "Section",
    "MODE_NAMES",
    "PIPELINE_MODES",
    "MLPConfig", "CNNConfig", "ResNetConfig", "TransformerConfig", "ModelConfig",
    "variant_fields", "DigitsConfig", "IDXConfig", "CIFARConfig", "SyntheticConfig", "SyntheticLMConfig", "DataConfig",
    "SGDConfig", "AdamConfig", "OptimizerConfig",
    "ConstantSchedule", "StepSchedule", "MultiStepSchedule", "CosineSchedule", "ScheduleConfig",
    "CheckpointConfig", "ObserveConfig",
    "UserModelConfig", "UserDataConfig", "FROM_PYTHON", "BUILTIN_MODELS", "BUILTIN_DATA", "SECTION_TAGS",
    "registered_names", "user_name",
]

#: Every mode the schema knows (whether it can run in this build is decided by ``modes``).
MODE_NAMES = ("single", "ddp", "dp", "seq", "gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2", "async")
#: Modes that split the model into stages and read the ``pipeline`` section.
PIPELINE_MODES = ("seq", "gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2", "async")


class ConfigError(ValueError):
    """A configuration is invalid; the message names the field, the value and the valid choices."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)



Section = _Section

# --------------------------------------------------------------------------------- user factories

#: The name of a model or data section that describes objects handed to :func:`ringpipe.train.fit`.
FROM_PYTHON = "python"
BUILTIN_MODELS = {"mlp": "MLPConfig", "cnn": "CNNConfig", "resnet": "ResNetConfig", "transformer": "TransformerConfig"}
BUILTIN_DATA = {"digits": "DigitsConfig", "mnist": "IDXConfig", "fashion_mnist": "IDXConfig",
                "cifar10": "CIFARConfig", "synthetic": "SyntheticConfig", "synthetic_lm": "SyntheticLMConfig"}
#: The variant tags of the model and data unions (dropped from the locations of errors).
SECTION_TAGS = frozenset({*BUILTIN_MODELS.values(), *BUILTIN_DATA.values(), "UserModelConfig", "UserDataConfig"})
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def _tag(value: Any, builtin: dict[str, str], user: str) -> str | None:
    name = value.get("name") if isinstance(value, dict) else getattr(value, "name", None)
    if name is None:
        return None
    return builtin.get(name, user) if isinstance(name, str) else user


def registered_names(kind: str) -> list[str]:
    """Names registered in the model or data registry beyond the built-in ones (registries are read
    only where already imported: a name registered by the user's code is there, and torch is not imported)."""
    module = sys.modules.get("ringpipe.train.models" if kind == "model" else "ringpipe.train.datasets")
    registry = getattr(module, "MODELS" if kind == "model" else "DATASETS", None)
    builtin = BUILTIN_MODELS if kind == "model" else BUILTIN_DATA
    return [n for n in (registry.names() if registry is not None else []) if n not in builtin]


def user_name(name: str, kind: str, builtin: dict[str, str]) -> str:
    """``name`` if it names a user factory (registered, or ``package.module:function``), else a clear error."""
    if name == FROM_PYTHON or name in registered_names(kind) or _IMPORT_PATH.match(name):
        return name
    if ":" in name:
        raise PydanticCustomError(
            "factory_path",
            "not an import path: write package.module:function (dotted module, a colon, the function's name)",
        )
    valid = [*builtin, *registered_names(kind)]
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    register = "MODELS.register" if kind == "model" else "DATASETS.register"
    raise PydanticCustomError(
        "unknown_name",
        f"unknown name{hint}; valid names: {', '.join(repr(v) for v in valid)}; or your own factory as "
        f"'package.module:function', or a name registered with ringpipe.train.{'models' if kind == 'model' else 'datasets'}.{register}",
    )


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


class UserModelConfig(BaseModel):
    """The user's own model: a name registered with ``MODELS.register`` (called as ``factory(section, data)``),
    or an import path ``package.module:function`` (called with this section's other keys as keyword
    arguments, and ``data=`` the loaded dataset when it has a parameter of that name). ``python``
    names a model handed to :func:`ringpipe.train.fit` (the run's record of it, not a factory)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return user_name(v, "model", BUILTIN_MODELS)


ModelConfig = Annotated[
    Annotated[MLPConfig, Tag("MLPConfig")] | Annotated[CNNConfig, Tag("CNNConfig")]
    | Annotated[ResNetConfig, Tag("ResNetConfig")] | Annotated[TransformerConfig, Tag("TransformerConfig")]
    | Annotated[UserModelConfig, Tag("UserModelConfig")],
    Discriminator(lambda v: _tag(v, BUILTIN_MODELS, "UserModelConfig")),
]

# --------------------------------------------------------------------------------- data


class DigitsConfig(_Section):
    """The 8x8 handwritten digits (UCI, 1,797 images), shipped with the package: no download."""

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


class UserDataConfig(BaseModel):
    """The user's own data: a name registered with ``DATASETS.register`` (called as ``factory(section)``), or an
    import path ``package.module:function`` called with this section's other keys as keyword arguments;
    it returns ``(train, test)`` torch Datasets (``test`` may be None), a dict with those keys, or a
    :class:`ringpipe.train.datasets.Dataset`. ``python`` names data handed to :func:`ringpipe.train.fit`."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return user_name(v, "data", BUILTIN_DATA)


DataConfig = Annotated[
    Annotated[DigitsConfig, Tag("DigitsConfig")] | Annotated[IDXConfig, Tag("IDXConfig")]
    | Annotated[CIFARConfig, Tag("CIFARConfig")] | Annotated[SyntheticConfig, Tag("SyntheticConfig")]
    | Annotated[SyntheticLMConfig, Tag("SyntheticLMConfig")] | Annotated[UserDataConfig, Tag("UserDataConfig")],
    Discriminator(lambda v: _tag(v, BUILTIN_DATA, "UserDataConfig")),
]

# --------------------------------------------------------------------------------- optimizers


class _OptimizerBase(_Section):
    lr: float = Field(gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    scale_lr: bool = True
    clip_grad_norm: float | None = Field(
        default=None, gt=0.0,
        description="clip the gradient of the whole model (every replica's average, every pipeline stage) "
        "to this L2 norm before each optimizer step, as torch.nn.utils.clip_grad_norm_ on one process",
    )


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

def variant_fields(section: str, name: Any) -> frozenset[str] | None:
    """The keys that the built-in variant ``name`` of ``section`` (model, data, optimizer, schedule) reads
    (None: not a built-in variant, e.g. the user's own factory, which may read any key)."""
    classes: dict[str, Any] = {
        "optimizer": {"sgd": SGDConfig, "adam": AdamConfig, "adamw": AdamConfig},
        "schedule": {"constant": ConstantSchedule, "step": StepSchedule, "multistep": MultiStepSchedule,
                     "cosine": CosineSchedule},
        "model": {k: globals()[v] for k, v in BUILTIN_MODELS.items()},
        "data": {k: globals()[v] for k, v in BUILTIN_DATA.items()},
    }.get(section, {})
    cls = classes.get(name) if isinstance(name, str) else None
    return frozenset(cls.model_fields) if cls is not None else None


# --------------------------------------------------------------------------------- other sections


class CheckpointConfig(_Section):
    """Checkpoints in ``<run-dir>/checkpoints``, written by rank 0 (also at the end and on ``max_steps``)."""

    every_epochs: int = Field(default=1, ge=0)
    keep: int = Field(default=3, ge=1)
    best: Literal["test_accuracy", "test_loss", "train_accuracy", "train_loss"] | None = Field(
        default=None,
        description="also keep the checkpoint of the best evaluation of this metric in checkpoints/best/",
    )


class ObserveConfig(_Section):
    """Where the time went, written by rank 0 when the run ends (all ranks' events gathered on one clock).

    ``profile``: ``comm_profile.txt`` (MPI-style table of time, calls and bytes per operation and
    rank), ``doctor.txt`` (late ranks, placement) and ``events.json`` (every rank's calls, read by
    ``ringpipe doctor RUN`` and ``ringpipe trace RUN``). ``timeline``: also ``timeline.json``
    (Chrome trace: chrome://tracing or ui.perfetto.dev).
    """

    profile: bool = True
    timeline: bool = False
