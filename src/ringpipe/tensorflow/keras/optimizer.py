"""``DistributedOptimizer`` for Keras 3 (and tf-keras, by :mod:`.optimizer_keras2`): any Keras optimizer whose ``apply`` first averages the gradients over ranks.

Why a subclass of the wrapped optimizer's class, made per class: Keras saves an optimizer by its
class's module and name, so a model saved during distributed training must name the wrapped class
(``keras.optimizers.Adam``) to load again without ringpipe; and Keras looks its methods up on
the class (``fit`` calls ``apply_gradients``, which calls ``apply``). The subclass keeps the
wrapped class's name and module and adds :class:`DistributedMixin`'s ``apply``.
"""

from __future__ import annotations

import functools
from typing import Any

import keras
import tensorflow as tf

from ringpipe.comm.base import ReduceOp
from ringpipe.core.calls import parse_op
from ringpipe.core.compression import Compression
from ringpipe.core.process_sets import ProcessSet, global_process_set

from ..gradient_tape import _key, reduce_gradients

__all__ = ["DistributedMixin", "DistributedOptimizer", "distributed_class"]


class Reducing:
    """What the Keras 3 and the Keras 2 (tf-keras) wrappers share: the settings, the reduction, the local sums."""

    _rp: dict[str, Any]

    def _rp_setup(self, compression: Any = Compression.none, sparse_as_dense: bool = False,
                  gradient_predivide_factor: float = 1.0, op: ReduceOp | str = ReduceOp.AVERAGE,
                  backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                  process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> None:
        if backward_passes_per_step <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
        rop = parse_op(op, None)
        if gradient_predivide_factor != 1.0 and rop is not ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        # object.__setattr__: not tracked by Keras as optimizer state (saved and broadcast).
        object.__setattr__(self, "_rp", {
            "compression": Compression.parse(compression), "sparse_as_dense": sparse_as_dense,
            "predivide": gradient_predivide_factor, "op": rop, "passes": backward_passes_per_step,
            "average_aggregated": average_aggregated_gradients, "process_set": process_set,
            "scale_local": scale_local_gradients, "local": set(), "sums": None, "counter": None,
            "reduced": None,
        })
        if backward_passes_per_step > 1:
            with tf.init_scope():  # Horovod's aggregation counter: local passes summed since the last reduction
                self._rp["counter"] = tf.Variable(0, dtype=tf.int32, trainable=False)

    @property
    def _agg_helper(self) -> Any:
        """Horovod's local-aggregation state (``None`` without ``backward_passes_per_step`` > 1).

        Its ``counter`` is the number of backward passes summed locally since the last reduction
        (``0`` right after the ``backward_passes_per_step``-th pass reduced and applied them).
        """
        cfg = getattr(self, "_rp", None)
        if cfg is None or cfg["passes"] == 1:
            return None
        return _AggregationState(cfg["counter"])

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local (model-parallel variables)."""
        self._rp["local"].add(_key(var))

    def _rp_reduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        cfg = self._rp
        shared = [i for i, v in enumerate(variables) if _key(v) not in cfg["local"]]
        reduced = reduce_gradients([grads[i] for i in shared], cfg["op"], cfg["compression"],
                                   cfg["sparse_as_dense"], cfg["predivide"], cfg["process_set"])
        out = list(grads)
        for i, r in zip(shared, reduced, strict=True):
            out[i] = r
        if cfg["scale_local"] and cfg["local"]:
            size = float(len(cfg["process_set"].ranks or []))
            out = [g / size if g is not None and _key(v) in cfg["local"] else g
                   for g, v in zip(out, variables, strict=True)]
        return out

    def _rp_accumulate(self, apply: Any, grads: list[Any], variables: list[Any]) -> Any:
        """Horovod's local aggregation: sum ``passes`` gradients, then reduce and ``apply(reduced)`` once.

        The optimizer's own variables are made first (not inside the ``tf.cond`` branch).
        """
        cfg = self._rp
        if any(isinstance(g, tf.IndexedSlices) for g in grads):
            if not cfg["sparse_as_dense"]:
                raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
                                 "`sparse_as_dense` is False.")
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        self._rp_build(variables)
        if cfg["sums"] is None:
            with tf.init_scope():
                cfg["sums"] = [None if g is None else tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False)
                               for g in grads]
        sums, counter, passes = cfg["sums"], cfg["counter"], cfg["passes"]
        for s, g in zip(sums, grads, strict=True):
            if s is not None and g is not None:
                s.assign_add(g)
        counter.assign_add(1)

        def reduce_and_apply() -> tf.Tensor:
            total = [None if s is None else s.read_value() for s in sums]
            reduced = self._rp_reduce(total, variables)
            if cfg["average_aggregated"]:
                reduced = [None if g is None else g / passes for g in reduced]
            apply(reduced)
            for s in sums:
                if s is not None:
                    s.assign(tf.zeros_like(s))
            counter.assign(0)
            return tf.constant(True)

        def count_only() -> tf.Tensor:
            # as in Horovod, every call counts as an iteration
            self.iterations.assign_add(1)  # type: ignore[attr-defined]
            return tf.constant(False)

        return tf.cond(tf.equal(counter, passes), reduce_and_apply, count_only)

    def _rp_build(self, variables: list[Any]) -> None:
        raise NotImplementedError


class _AggregationState:
    """What Horovod's ``optimizer._agg_helper`` shows: the ``counter`` variable."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter


class DistributedMixin(Reducing):
    """The distributed ``apply`` of a Keras 3 optimizer: reduce the gradients, every ``backward_passes_per_step`` calls."""

    def _rp_build(self, variables: list[Any]) -> None:
        if not self.built:  # type: ignore[attr-defined]
            self.build(variables)  # type: ignore[attr-defined]

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        base: Any = super()
        if not hasattr(self, "_rp"):
            self._rp_setup()
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else list(
            self._trainable_variables)  # type: ignore[attr-defined]
        reduced, self._rp["reduced"] = self._rp["reduced"], None
        if self._rp["passes"] == 1:
            if reduced is not None and len(reduced) == len(grads) and all(
                    g is r for g, r in zip(grads, reduced, strict=True)):
                return base.apply(grads, trainable_variables)  # reduced already by _compute_gradients
            return base.apply(self._rp_reduce(grads, variables), trainable_variables)
        return self._rp_accumulate(lambda reduced: base.apply(reduced, trainable_variables), grads, variables)

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list[tuple[Any, Any]]:
        """Horovod's ``compute_gradients``: ``(gradient, variable)`` pairs, the gradients reduced over ranks."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list[tuple[Any, Any]]:
        """The gradients of ``loss`` for ``var_list``, reduced over ranks (Horovod's Keras wrapper method).

        ``loss``: a tensor recorded on ``tape``, or a function of no arguments (run on a new tape);
        ``var_list``: the variables, or a function returning them. Keras 3 optimizers compute no
        gradients themselves, so the tape does it here. ``apply_gradients`` given exactly these
        gradients applies them without reducing again; with ``backward_passes_per_step`` > 1 they
        are this pass's local gradients, summed and reduced by ``apply_gradients`` as ``fit`` does.
        """
        if not hasattr(self, "_rp"):
            self._rp_setup()
        tape = tf.GradientTape() if tape is None else tape
        if callable(loss):
            with tape:
                if not callable(var_list):
                    tape.watch([_tf_variable(v) for v in var_list])
                loss = loss()
        variables = list(var_list() if callable(var_list) else var_list)
        grads = list(tape.gradient(loss, variables, grad_loss))
        if self._rp["passes"] == 1:
            grads = self._rp_reduce(grads, variables)
            self._rp["reduced"] = list(grads)
        return list(zip(grads, variables, strict=True))


def _tf_variable(var: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable (what a tape watches)."""
    return getattr(var, "value", var) if not isinstance(var, tf.Variable) else var



@functools.cache
def distributed_class(cls: type) -> type:
    """The distributed subclass of a Keras optimizer class, with its name and module (see the module docstring)."""
    if issubclass(cls, DistributedMixin):
        return cls
    return type(cls.__name__, (DistributedMixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def DistributedOptimizer(  # noqa: N802 - Horovod's name for a call that returns an optimizer
    optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
    compression: Any = Compression.none, sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
    op: ReduceOp | str = ReduceOp.AVERAGE, backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
    process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
) -> Any:
    """A new optimizer like ``optimizer`` (its config) whose ``apply`` averages the gradients over ranks.

    Keras 3 optimizers reduce in ``apply``; tf-keras (Keras 2) ones where Horovod's Keras 2
    wrapper does (:mod:`.optimizer_keras2`). Wrap before ``compile``, as in Horovod. ``backward_passes_per_step`` ``k``: gradients are
    summed locally over ``k`` calls and reduced and applied on the ``k``-th (divided by ``k`` with
    ``average_aggregated_gradients``); every call counts as an optimizer iteration, as in Horovod.
    """
    from ._which import is_keras2_optimizer

    cls: Any
    if isinstance(optimizer, keras.optimizers.Optimizer):
        cls = distributed_class(type(optimizer))  # type: ignore[arg-type]
    elif is_keras2_optimizer(optimizer):  # tf-keras: TF_USE_LEGACY_KERAS=1
        from .optimizer_keras2 import distributed_class_keras2

        cls = distributed_class_keras2(type(optimizer))  # type: ignore[arg-type]
    else:
        raise TypeError(f"DistributedOptimizer wraps a Keras optimizer (keras.optimizers, or tf-keras's "
                        f"tf.keras.optimizers / tf.keras.optimizers.legacy), got {type(optimizer).__name__}")
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    opt = cls.from_config(config)
    opt._rp_setup(compression, sparse_as_dense, gradient_predivide_factor, op, backward_passes_per_step,
                  average_aggregated_gradients, process_set, scale_local_gradients)
    return opt
