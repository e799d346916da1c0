"""``DistributedOptimizer`` for Keras 2 (tf-keras, ``TF_USE_LEGACY_KERAS=1``): gradients reduced where Horovod reduces them.

Keras 2's ``fit`` trains through ``optimizer.minimize(loss, variables, tape)``, which computes the
gradients with ``compute_gradients`` (tf-keras's optimizers) or ``_compute_gradients``
(``tf.keras.optimizers.legacy``), and graph-mode Keras through ``get_gradients``; Horovod's Keras 2
wrapper reduces the gradients in those methods, and so does this one. With
``backward_passes_per_step`` ``k`` > 1 they return the local gradients and ``apply_gradients`` sums
them, reducing and applying on every ``k``-th call (:class:`~.optimizer.Reducing`). The class made
per wrapped class keeps its name and module, so a saved model loads again without ringpipe.
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

from .optimizer import Reducing

__all__ = ["Keras2DistributedMixin", "distributed_class_keras2"]


class Keras2DistributedMixin(Reducing):
    """The distributed gradient methods of a tf-keras optimizer (new or legacy)."""

    def _rp_build(self, variables: list[Any]) -> None:
        with tf.init_scope():
            if hasattr(self, "_create_all_weights"):  # tf.keras.optimizers.legacy
                self._create_all_weights(variables)
            else:
                self.build(variables)  # type: ignore[attr-defined]

    def _rp_pairs(self, pairs: Any) -> list[tuple[Any, Any]]:
        pairs = list(pairs)
        if not hasattr(self, "_rp"):
            self._rp_setup()
        if self._rp["passes"] > 1:  # summed locally by apply_gradients
            return pairs
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        return list(zip(self._rp_reduce(grads, variables), variables, strict=True))

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list[tuple[Any, Any]]:
        """The ``(gradient, variable)`` pairs with the gradients reduced over ranks."""
        base: Any = super()
        if not hasattr(base, "compute_gradients"):  # legacy optimizers compute in _compute_gradients
            return self._compute_gradients(loss, var_list, None, tape)
        return self._rp_pairs(base.compute_gradients(loss, var_list, tape))

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None) -> Any:
        base: Any = super()
        if hasattr(base, "_compute_gradients"):  # tf.keras.optimizers.legacy
            return self._rp_pairs(base._compute_gradients(loss, var_list, grad_loss, tape))
        # tf-keras's optimizers have only compute_gradients; Horovod's wrapper answers both names
        tape = tf.GradientTape() if tape is None else tape
        return self._rp_pairs(base.compute_gradients(loss, var_list, tape))

    def get_gradients(self, loss: Any, params: Any) -> list[Any]:
        base: Any = super()
        params = list(params)
        return [g for g, _ in self._rp_pairs(zip(base.get_gradients(loss, params), params, strict=True))]

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        base: Any = super()
        if not hasattr(self, "_rp"):
            self._rp_setup()
        if self._rp["passes"] == 1:
            return base.apply_gradients(grads_and_vars, *args, **kwargs)
        pairs = list(grads_and_vars)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        return self._rp_accumulate(
            lambda reduced: base.apply_gradients(list(zip(reduced, variables, strict=True)), *args, **kwargs),
            grads, variables)


@functools.cache
def distributed_class_keras2(cls: type) -> type:
    """The distributed subclass of a tf-keras optimizer class, with its name and module."""
    if issubclass(cls, Keras2DistributedMixin):
        return cls
    return type(cls.__name__, (Keras2DistributedMixin, cls),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
