"""Horovod's ``horovod.tensorflow.keras`` for Keras 3: ``import ringpipe.tensorflow.keras as hvd``.

Everything of :mod:`ringpipe.tensorflow` (``init``, ``rank``, ``size``, the collectives), plus
:func:`DistributedOptimizer`, :mod:`callbacks`, :mod:`elastic` (``KerasState`` and its
callbacks), :func:`load_model` and :func:`broadcast_global_variables`.
"""

from __future__ import annotations

import importlib
from typing import Any

import keras

from ringpipe.dp.compression import Compression

from .. import *  # noqa: F403 - the TensorFlow face's API
from .. import __all__ as _tf_all
from ..functions import broadcast_variables
from .optimizer import DistributedOptimizer, distributed_class  # type: ignore[assignment]  # noqa: F401 - the Keras one

# The Keras modules, over the star's ``elastic`` (a plain ``from . import`` would keep the star's).
callbacks = importlib.import_module(f"{__name__}.callbacks")
elastic = importlib.import_module(f"{__name__}.elastic")

__all__ = [*_tf_all, "broadcast_global_variables", "callbacks", "load_model"]


def broadcast_global_variables(root_rank: int, model: Any = None) -> None:
    """Give every rank ``root_rank``'s values of ``model``'s and its optimizer's variables.

    Keras 3 has no global variable collection, so the model is named (Horovod's Keras 2 form
    took none).
    """
    if model is None:
        raise ValueError("broadcast_global_variables(root_rank, model): Keras 3 has no global variables; pass the "
                         "model, or use hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)")
    broadcast_variables(model.variables, root_rank)
    if getattr(model, "optimizer", None) is not None:
        broadcast_variables(list(model.optimizer.variables), root_rank)


def load_model(filepath: Any, custom_optimizers: list[type] | None = None, custom_objects: dict[str, Any] | None = None,
               compression: Any = Compression.none, legacy_opts: bool = False, **wrap: Any) -> Any:
    """``keras.models.load_model`` whose optimizer comes back as a :func:`DistributedOptimizer` (with its state).

    ``custom_optimizers``: optimizer classes of your own to wrap as well; ``wrap``: further
    arguments of :func:`DistributedOptimizer` (``op``, ``backward_passes_per_step``...).
    ``legacy_opts=True`` (Keras 2's ``tf.keras.optimizers.legacy``) is refused: Keras 3 has none.
    """
    if legacy_opts:
        raise ValueError("load_model(legacy_opts=True): Keras 3 has no legacy optimizers "
                         "(tf.keras.optimizers.legacy); save the model with a keras.optimizers optimizer")
    classes = _optimizer_classes(keras.optimizers.Optimizer) + list(custom_optimizers or [])
    objects: dict[str, Any] = {cls.__name__: distributed_class(cls) for cls in classes}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "_rp_setup"):
        optimizer._rp_setup(compression=compression, **wrap)
    return model


def _optimizer_classes(base: type) -> list[type]:
    found: list[type] = []
    cls: type
    for cls in base.__subclasses__():
        if not cls.__name__.startswith("_"):
            found.append(cls)
        found.extend(_optimizer_classes(cls))
    return found
