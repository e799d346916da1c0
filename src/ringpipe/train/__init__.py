"""The config-driven trainer behind ``ringpipe train``: config, data, models, modes, loop, outputs."""

from ringpipe.train.config import ConfigError, TrainConfig, load_config
from ringpipe.train.loop import train
from ringpipe.train.modes import MODES, Engine, ModeUnavailable

__all__ = ["ConfigError", "Engine", "MODES", "ModeUnavailable", "TrainConfig", "load_config", "train"]
