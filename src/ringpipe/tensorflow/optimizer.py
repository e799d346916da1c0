"""``hvd.DistributedOptimizer`` of ``horovod.tensorflow``: TF1-style optimizers wrapped, Keras ones handed on.

A ``tf.compat.v1.train.Optimizer`` (still shipped by TensorFlow 2.21: ``GradientDescentOptimizer``,
``MomentumOptimizer``, ``AdamOptimizer``...) is wrapped by :class:`LegacyDistributedOptimizer`,
whose ``compute_gradients`` returns the gradients reduced over ranks (Average by default) and
whose ``apply_gradients`` is the wrapped optimizer's, as in Horovod; ``minimize`` therefore trains
on the mean gradient, eagerly or inside ``tf.function``. A Keras optimizer goes to
:func:`ringpipe.tensorflow.keras.DistributedOptimizer`, as Horovod does.
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf

from ringpipe.comm.base import ReduceOp
from ringpipe.core.calls import parse_op
from ringpipe.core.compression import Compression
from ringpipe.core.process_sets import ProcessSet, global_process_set

from .gradient_tape import _key, reduce_gradients, scale_factors

__all__ = ["DistributedOptimizer", "LegacyDistributedOptimizer"]

_LegacyOptimizer: Any = getattr(getattr(tf.compat.v1, "train", None), "Optimizer", None)


class LegacyDistributedOptimizer(_LegacyOptimizer or object):  # type: ignore[misc]
    """A ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` reduces the gradients over ranks."""

    def __init__(self, optimizer: Any, name: str | None = None, use_locking: bool = False,
                 compression: Any = Compression.none, sparse_as_dense: bool = False,
                 op: ReduceOp = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> None:
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        self._optimizer = optimizer
        self._op = op
        self._compression = Compression.parse(compression)
        self._sparse_as_dense = sparse_as_dense
        self._predivide = gradient_predivide_factor
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_vars: set[Any] = set()

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local (model-parallel variables)."""
        self._local_vars.add(_key(var))

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's ``(gradient, variable)`` pairs with the gradients reduced over ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        shared = [i for i, v in enumerate(variables) if _key(v) not in self._local_vars]
        reduced = reduce_gradients([grads[i] for i in shared], self._op, self._compression, self._sparse_as_dense,
                                   self._predivide, self.process_set)
        for i, r in zip(shared, reduced, strict=True):
            grads[i] = r
        if self.scale_local_gradients and self._local_vars:
            n = float(len(self.process_set.ranks or []))
            for i, v in enumerate(variables):
                g = grads[i]
                if _key(v) in self._local_vars and g is not None:
                    grads[i] = (tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                                if isinstance(g, tf.IndexedSlices) else g / n)
        return list(zip(grads, variables, strict=True))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: str | None = None) -> Any:
        """The wrapped optimizer's ``apply_gradients``."""
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(  # noqa: N802 - Horovod's name for a call that returns an optimizer
    optimizer: Any, name: str | None = None, use_locking: bool = False, device_dense: str = "",
    device_sparse: str = "", compression: Any = Compression.none, sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1, op: ReduceOp | str = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
    process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
) -> Any:
    """Wrap a ``tf.compat.v1.train.Optimizer`` or a Keras optimizer so that gradients are reduced over ranks.

    Arguments and errors are Horovod's. ``backward_passes_per_step > 1`` is served for Keras
    optimizers; for a TF1-style optimizer it is refused (Horovod refuses it eagerly too and
    serves it only in TF1 graph sessions).
    """
    rop = parse_op(op, None)
    if gradient_predivide_factor != 1.0:
        scale_factors(rop, gradient_predivide_factor)  # "... not supported with op != Average"
    if rop is ReduceOp.ADASUM and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    if _LegacyOptimizer is not None and isinstance(optimizer, _LegacyOptimizer):
        if rop is ReduceOp.ADASUM:
            raise NotImplementedError("op=Adasum with a tf.compat.v1.train.Optimizer (Horovod's delta optimizer) "
                                      "is not served by ringpipe.tensorflow; use a Keras optimizer with "
                                      "ringpipe.tensorflow.keras.DistributedOptimizer, or op=Average")
        if backward_passes_per_step > 1:
            raise ValueError("backward_passes_per_step > 1 is not yet supported for _LegacyOptimizer with eager "
                             "execution (ringpipe.tensorflow serves it for Keras optimizers only).")
        return LegacyDistributedOptimizer(optimizer, name, use_locking, compression, sparse_as_dense, rop,
                                          gradient_predivide_factor, process_set, scale_local_gradients)
    if rop is ReduceOp.ADASUM:
        raise ValueError("op == Adasum is not supported yet with Keras")
    from .keras.optimizer import DistributedOptimizer as keras_distributed

    return keras_distributed(optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
                             gradient_predivide_factor=gradient_predivide_factor, op=rop,
                             backward_passes_per_step=backward_passes_per_step,
                             average_aggregated_gradients=average_aggregated_gradients, process_set=process_set,
                             scale_local_gradients=scale_local_gradients)
