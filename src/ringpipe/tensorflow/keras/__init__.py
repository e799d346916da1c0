"""Horovod's ``horovod.tensorflow.keras``: ``import ringpipe.tensorflow.keras as hvd``.

Everything of :mod:`ringpipe.tensorflow` (``init``, ``rank``, ``size``, the collectives), plus
:func:`DistributedOptimizer`, :mod:`callbacks`, :mod:`elastic` (``KerasState`` and its
callbacks), :func:`load_model` and :func:`broadcast_global_variables`. It serves the Keras that
``tf.keras`` is: Keras 3, or tf-keras (Keras 2) when ``TF_USE_LEGACY_KERAS=1`` (:mod:`._which`).
"""

from __future__ import annotations

import importlib
from typing import Any

import tensorflow as tf

from ringpipe.core.compression import Compression

from .. import *  # noqa: F403 - the TensorFlow face's API
from .. import __all__ as _tf_all
from ..functions import broadcast_variables
from ._factories import is_factory, optimizer_factories_as_classes
from ._which import KERAS2, keras
from .optimizer import DistributedOptimizer, distributed_class  # type: ignore[assignment]  # noqa: F401 - the Keras one

# The Keras modules, over the star's ``elastic`` (a plain ``from . import`` would keep the star's).
callbacks = importlib.import_module(f"{__name__}.callbacks")
elastic = importlib.import_module(f"{__name__}.elastic")

__all__ = [*_tf_all, "broadcast_global_variables", "callbacks", "load_model"]


def broadcast_global_variables(root_rank: int, model: Any = None) -> Any:  # type: ignore[no-redef]
    """Give every rank ``root_rank``'s values of ``model``'s and its optimizer's variables.

    Eager Keras has no global variable collection, so the model is named (Horovod's Keras 2 form
    took none, and raised in eager mode); in a ``tf.compat.v1`` graph with no model, the graph's
    global variables are broadcast (an op to run, as in Horovod).
    """
    from .callbacks import optimizer_variables

    if model is None:
        if not tf.executing_eagerly():
            from ..hooks import broadcast_global_variables as graph_broadcast

            return graph_broadcast(root_rank)
        raise ValueError("broadcast_global_variables(root_rank, model): eager Keras has no global variables; pass "
                         "the model, or use hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)")
    broadcast_variables(model.variables, root_rank)
    if getattr(model, "optimizer", None) is not None:
        broadcast_variables(optimizer_variables(model.optimizer), root_rank)
    return None


def load_model(filepath: Any, custom_optimizers: list[type] | None = None, custom_objects: dict[str, Any] | None = None,
               compression: Any = Compression.none, legacy_opts: bool = False, **wrap: Any) -> Any:
    """``tf.keras.models.load_model`` whose optimizer comes back as a :func:`DistributedOptimizer` (with its state).

    ``custom_optimizers``: optimizer classes of your own to wrap as well; ``wrap``: further
    arguments of :func:`DistributedOptimizer` (``op``, ``backward_passes_per_step``...).
    ``custom_objects`` may map the saved optimizer's class name to a function that makes the
    optimizer from its config (``lambda **kw: DistributedOptimizer(MyOpt(**kw))``), as in Keras 2;
    its optimizer is kept as the function made it. ``legacy_opts=True``: the model was saved with a ``tf.keras.optimizers.legacy`` optimizer
    (tf-keras only; Keras 3 has none).
    """
    if legacy_opts and not KERAS2:
        raise ValueError("load_model(legacy_opts=True): Keras 3 has no legacy optimizers "
                         "(tf.keras.optimizers.legacy); save the model with a keras.optimizers optimizer, or run "
                         "with TF_USE_LEGACY_KERAS=1 (tf-keras)")
    if KERAS2:
        from .optimizer_keras2 import distributed_class_keras2 as wrap_class

        base = keras.optimizers.legacy.Optimizer if legacy_opts else keras.optimizers.Optimizer
    else:
        wrap_class, base = distributed_class, keras.optimizers.Optimizer
    classes = _optimizer_classes(base) + list(custom_optimizers or [])
    objects: dict[str, Any] = {}
    for cls in classes:
        # Keras 2 looks optimizers up by the lower-case name too (Horovod registers that one)
        objects[cls.__name__] = objects[cls.__name__.lower()] = wrap_class(cls)
    objects.update(custom_objects or {})
    if not KERAS2:  # a factory function named like the saved optimizer, as Keras 2 took it
        objects = optimizer_factories_as_classes(filepath, objects)
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    made_by_user = optimizer is not None and is_factory((custom_objects or {}).get(type(optimizer).__name__))
    if optimizer is not None and hasattr(optimizer, "_rp_setup") and not made_by_user:  # a factory's settings stay
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
