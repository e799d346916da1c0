"""The config-driven trainer behind ``ringpipe train``: config, data, models, modes, loop, outputs.

The names below are imported on first use, so that ``ringpipe train --help`` and the config
checks do not import torch. :func:`fit` lives in :mod:`ringpipe.train.fitting` (a module named
``fit`` would shadow the function: ``from ringpipe.train import fit`` gave the module).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ConfigError", "Engine", "MODES", "ModeRunner", "ModeUnavailable", "TrainConfig", "fit", "load_config", "train"]

_HOME = {
    "ConfigError": "ringpipe.train.config",
    "TrainConfig": "ringpipe.train.config",
    "load_config": "ringpipe.train.config",
    "train": "ringpipe.train.loop",
    "fit": "ringpipe.train.fitting",
    "ModeRunner": "ringpipe.train.modes",
    "MODES": "ringpipe.train.modes",
    "ModeUnavailable": "ringpipe.train.modes",
}

#: Public names kept for what was renamed: ``Engine`` is the per-mode step runner, :class:`ModeRunner`.
_FORMERLY = {"Engine": "ModeRunner"}


def __getattr__(name: str) -> Any:
    name = _FORMERLY.get(name, name)
    if name not in _HOME:
        raise AttributeError(f"module 'ringpipe.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
