"""Horovod's ``horovod.keras.elastic`` for Keras 3 (the states and callbacks of :mod:`ringpipe.tensorflow.keras.elastic`)."""

from ringpipe.tensorflow.keras.elastic import *  # noqa: F403 - the same states and callbacks
from ringpipe.tensorflow.keras.elastic import __all__  # noqa: F401
