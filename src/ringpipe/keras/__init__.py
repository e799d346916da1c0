"""Horovod's standalone ``horovod.keras`` for Keras 3: ``import ringpipe.keras as hvd``.

Keras 3 is itself the standalone Keras (``import keras``), so this is not a face of its own: it is
the TensorFlow face's Keras API, :mod:`ringpipe.tensorflow.keras`, under Horovod's other import
path (as Horovod's own ``horovod.keras`` is built on ``horovod.tensorflow``), and a program written
for ``horovod.keras`` runs with only its import line changed. It imports the TensorFlow face and
:mod:`ringpipe.core`, never the torch face. Keras must run on its TensorFlow
backend (the default); the collectives move TensorFlow tensors. Like
:mod:`ringpipe.tensorflow.keras`, its callbacks are those of the Keras ``tf.keras`` is: with
``TF_USE_LEGACY_KERAS=1`` they are tf-keras (Keras 2) callbacks, for models built with
``tf.keras`` (``DistributedOptimizer`` wraps either kind of optimizer).
"""

from __future__ import annotations

import importlib as _importlib
from typing import Any

import keras as _keras

if _keras.backend.backend() != "tensorflow":  # pragma: no cover - depends on the environment
    raise ImportError(
        f"ringpipe.keras needs Keras on its TensorFlow backend, but KERAS_BACKEND is "
        f"{_keras.backend.backend()!r}: set KERAS_BACKEND=tensorflow (for a torch model use ringpipe's torch API, "
        f"import ringpipe.api as hvd)"
    )

from ringpipe.comm.base import ReduceOp  # noqa: E402
from ringpipe.core.compression import Compression  # noqa: E402
from ringpipe.core.process_sets import ProcessSet, global_process_set  # noqa: E402
from ringpipe.tensorflow.keras import *  # noqa: E402, F403 - the same face
from ringpipe.tensorflow.keras import DistributedOptimizer  # noqa: E402
from ringpipe.tensorflow.keras import __all__ as _tf_keras_all  # noqa: E402
from ringpipe.tensorflow.keras._which import keras as _tf_keras  # noqa: E402

__all__ = [*_tf_keras_all, "PartialDistributedOptimizer"]

# ringpipe.keras.callbacks / .elastic, as in Horovod, over the star's modules of the same names
callbacks = _importlib.import_module(f"{__name__}.callbacks")
elastic = _importlib.import_module(f"{__name__}.elastic")


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's name for a call that returns an optimizer
    optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
    compression: Any = Compression.none, sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
    op: ReduceOp | str = ReduceOp.AVERAGE, backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False, groups: Any = None,
    process_set: ProcessSet = global_process_set, local_layers: Any = None, scale_local_gradients: bool = True,
) -> Any:
    """``DistributedOptimizer`` whose ``local_layers`` (a layer or a list of them) keep their gradients local.

    The trainable variables of the local layers are not reduced across ranks (model-parallel
    layers); with ``scale_local_gradients`` their gradients are divided by the set's size, as
    Horovod does. Without ``local_layers`` it is ``DistributedOptimizer``.
    """
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, _tf_keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    bad = [type(layer).__name__ for layer in local_layers if not isinstance(layer, _tf_keras.layers.Layer)]
    if bad:
        raise ValueError(f"local_layers must be Keras layers (keras.layers.Layer), got {bad}: pass e.g. "
                         f"model.layers[:2]")
    opt = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for layer in local_layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt
