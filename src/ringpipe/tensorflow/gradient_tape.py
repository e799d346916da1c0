"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged over ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from ringpipe.comm.base import ReduceOp
from ringpipe.core.calls import parse_op
from ringpipe.core.process_sets import ProcessSet, global_process_set

from .bridge import graph_op
from .compression import Compression
from .mpi_ops import allreduce, fused_allreduce

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "reduce_gradients"]


def _key(var: Any) -> Any:
    """A hashable identity for a TF or Keras 3 variable (Keras 3 variables have no ``ref()``)."""
    return var.ref() if hasattr(var, "ref") else id(var)


def scale_factors(op: ReduceOp, gradient_predivide_factor: float) -> tuple[float, float]:
    """Horovod's split of an average: times ``1 / f`` before the sum, ``f / size`` after it."""
    if gradient_predivide_factor != 1.0 and op is not ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op is ReduceOp.AVERAGE:
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0


@graph_op
def reduce_gradients(grads: Sequence[Any], op: ReduceOp = ReduceOp.AVERAGE, compression: Any = Compression.none,
                     sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Reduce a list of gradients as Horovod's gradient tape and optimizers do.

    ``None`` stays ``None``; dense gradients go as one fused message per dtype; an
    ``IndexedSlices`` becomes dense with ``sparse_as_dense``, else is allgathered. On a rank
    outside ``process_set``, or with a set of one rank, the gradients stay local, as Horovod's
    ``_grouped_allreduce_cond`` leaves them (``process_set.included() and size() > 1``).
    """
    pre, post = scale_factors(op, gradient_predivide_factor)
    out = list(grads)
    if sparse_as_dense:
        out = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in out]
    included = process_set.included()  # None before init: the collectives below say so
    if included is False or (included and process_set.size() == 1):
        return out
    dense = [i for i, g in enumerate(out) if g is not None and not isinstance(g, tf.IndexedSlices)]
    for i, r in zip(dense, fused_allreduce([out[i] for i in dense], op, pre, post, compression, process_set),
                    strict=True):
        out[i] = r
    for i, g in enumerate(out):
        if isinstance(g, tf.IndexedSlices):
            out[i] = allreduce(g, op=op, process_set=process_set)
    return out


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns the gradients reduced over the ranks of ``process_set``.

    ``tape = hvd.DistributedGradientTape(tape)`` after recording, or
    ``with hvd.DistributedGradientTape(tf.GradientTape()) as tape:``; every other method is the
    wrapped tape's. ``op`` is Average by default; ``gradient_predivide_factor`` ``f`` scales by
    ``1/f`` before the sum and ``f/size`` after it; ``groups`` / ``num_groups`` are accepted (all
    dense gradients of a dtype already travel as one message). Sources registered with
    :meth:`register_local_source` keep their local gradient (divided by the set's size when
    ``scale_local_gradients``, as in Horovod).
    """

    def __init__(self, gradtape: Any, device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False,
                 op: ReduceOp | str = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True) -> None:
        if not hasattr(gradtape, "gradient"):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        self._tape = gradtape
        self._op = parse_op(op, None)
        scale_factors(self._op, gradient_predivide_factor)  # refuses a predivide factor without Average
        if groups is None and num_groups:
            groups = num_groups
        if groups is not None and not (isinstance(groups, list) or groups > 0):
            raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
        self._compression = Compression.parse(compression)
        self._sparse_as_dense = sparse_as_dense
        self._predivide = gradient_predivide_factor
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources: set[Any] = set()

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local (model-parallel variables)."""
        self._local_sources.add(_key(source))

    @graph_op
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False,
                 **kwargs: Any) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        shared = [i for i, s in enumerate(flat_sources) if _key(s) not in self._local_sources]
        reduced = reduce_gradients([flat_grads[i] for i in shared], self._op, self._compression,
                                   self._sparse_as_dense, self._predivide, self.process_set)
        out = list(flat_grads)
        for i, r in zip(shared, reduced, strict=True):
            out[i] = r
        if self.scale_local_gradients and self._local_sources:
            size = float(len(self.process_set.ranks or []))
            for i, s in enumerate(flat_sources):
                g = out[i]
                if _key(s) in self._local_sources and g is not None:
                    out[i] = (tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                              if isinstance(g, tf.IndexedSlices) else g / size)
        return tf.nest.pack_sequence_as(grads, out)


class PartialDistributedGradientTape(DistributedGradientTape):
    """A :class:`DistributedGradientTape` whose ``local_layers``' variables keep local gradients."""

    def __init__(self, gradtape: Any, device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False,
                 op: ReduceOp | str = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
                 local_layers: Any = None, scale_local_gradients: bool = True) -> None:
        super().__init__(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                         gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
        layers = [] if local_layers is None else (local_layers if isinstance(local_layers, list) else [local_layers])
        for layer in layers:
            for var in layer.trainable_weights:
                self.register_local_source(var)
