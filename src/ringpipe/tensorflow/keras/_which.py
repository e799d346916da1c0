"""Which Keras the Keras face serves: the one ``tf.keras`` is (Keras 3, or tf-keras with ``TF_USE_LEGACY_KERAS=1``).

TensorFlow decides this once per process from ``TF_USE_LEGACY_KERAS``, and so does Horovod's
``horovod.tensorflow.keras`` (it uses ``tf.keras``): the callbacks and ``load_model`` follow it.
``DistributedOptimizer`` looks at the optimizer it is given instead, so it wraps either kind.
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow as tf

__all__ = ["KERAS2", "is_keras2_optimizer", "keras"]


def _tf_keras() -> Any:
    try:
        module = tf.keras
        module.callbacks  # noqa: B018 - the lazy loader imports tf-keras here
    except ImportError as exc:  # pragma: no cover - depends on the environment
        if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes"):
            raise ImportError(
                "TF_USE_LEGACY_KERAS=1 needs tf-keras: pip install --no-deps tf-keras==2.21.0 (without --no-deps "
                "it pulls the full tensorflow and its CUDA packages)"
            ) from exc
        raise
    return module


#: ``tf.keras``: Keras 3's ``keras``, or ``tf_keras`` (Keras 2).
keras: Any = _tf_keras()
#: True when ``tf.keras`` is tf-keras (Keras 2).
KERAS2: bool = keras.callbacks.Callback.__module__.startswith("tf_keras")


def is_keras2_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a tf-keras (Keras 2) optimizer, new or ``tf.keras.optimizers.legacy``."""
    return any(c.__module__.startswith("tf_keras.") for c in type(optimizer).__mro__)
