"""Horovod's ``horovod.keras.callbacks`` for Keras 3 (the callbacks of :mod:`ringpipe.tensorflow.keras.callbacks`)."""

from ringpipe.tensorflow.keras.callbacks import *  # noqa: F403 - the same callbacks
from ringpipe.tensorflow.keras.callbacks import __all__  # noqa: F401
