"""Horovod's standalone ``horovod.keras`` for Keras 3: ``import ringpipe.keras as hvd``.

Keras 3 is itself the standalone Keras (``import keras``), so this face is
:mod:`ringpipe.tensorflow.keras` under Horovod's other import path: a program written for
``horovod.keras`` runs with only its import line changed. Keras must run on its TensorFlow
backend (the default); the collectives move TensorFlow tensors. Like
:mod:`ringpipe.tensorflow.keras`, its callbacks are those of the Keras ``tf.keras`` is: with
``TF_USE_LEGACY_KERAS=1`` they are tf-keras (Keras 2) callbacks, for models built with
``tf.keras`` (``DistributedOptimizer`` wraps either kind of optimizer).
"""

from __future__ import annotations

import importlib as _importlib

import keras as _keras

if _keras.backend.backend() != "tensorflow":  # pragma: no cover - depends on the environment
    raise ImportError(
        f"ringpipe.keras needs Keras on its TensorFlow backend, but KERAS_BACKEND is "
        f"{_keras.backend.backend()!r}: set KERAS_BACKEND=tensorflow (for a torch model use ringpipe's torch API, "
        f"import ringpipe.api as hvd)"
    )

from ringpipe.tensorflow.keras import *  # noqa: E402, F403 - the same face
from ringpipe.tensorflow.keras import __all__  # noqa: E402, F401

# ringpipe.keras.callbacks / .elastic, as in Horovod, over the star's modules of the same names
callbacks = _importlib.import_module(f"{__name__}.callbacks")
elastic = _importlib.import_module(f"{__name__}.elastic")
